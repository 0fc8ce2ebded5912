"""Byte-level text corpus for next-byte language modelling, read from local files only.

Usage (normally through :func:`omnilearn.experiments.datasets.core.load`)::

    splits = data.load(DataSpec("text", seq_len=128))                  # default corpus (see below)
    splits = data.load(DataSpec("text", data_dir="~/books/moby.txt"))  # one file, any extension
    splits = data.load(DataSpec("text", data_dir="~/notes"))           # every *.txt *.md *.py under it
    x, y = splits.train.__getitems__([0, 1])  # int64 (2, seq_len) each; y[:, t] is the byte after x[:, t]

The corpus is raw bytes (256 classes, no tokenizer). A folder contributes its ``.txt``,
``.md`` and ``.py`` files (case-insensitive, hidden entries skipped), concatenated in sorted
relative-path order. The default corpus (no ``data_dir``) is the Python standard library's
own top-level ``*.py`` sources (``sysconfig.get_paths()["stdlib"]``), sorted by name, whole
files until 2 MiB, cut to exactly 2 MiB; the files used are listed in ``splits.train.files``.
The first 90% of bytes train and the last 10% test (contiguous, so no overlap). Sample i of a
split is the window of seq_len + 1 bytes starting at byte i * seq_len: x is its first seq_len
bytes, y the last seq_len (x shifted by one), so consecutive windows share one byte.
:func:`check_text` checks a corpus from file sizes alone, before any worker starts.

Tests:  python -m pytest -q tests/unit/test_data.py
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset

from omnilearn.experiments.datasets.base import DataError, Splits

TEXT_EXTS = frozenset({".txt", ".md", ".py"})
DEFAULT_CORPUS_BYTES = 2 * 2**20
TEST_FRACTION = 0.1
MIN_WINDOWS = 2  # per split


class ByteWindows(Dataset):
    """Non-overlapping next-byte windows over a uint8 1-D tensor; batches gathered vectorised."""

    returns_batches = True  # __getitems__ returns a collated (x, y): use data.keep_batch as collate_fn

    def __init__(self, data: torch.Tensor, seq_len: int, files: tuple[str, ...] = ()) -> None:
        self.data, self.seq_len, self.files = data, seq_len, files
        self._offsets = torch.arange(seq_len + 1)

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.seq_len)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"window index out of range 0..{len(self) - 1}")
        windows = self.data[idx[:, None] * self.seq_len + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]


def default_corpus(limit: int = DEFAULT_CORPUS_BYTES) -> tuple[bytes, list[Path]]:
    """The first ``limit`` bytes of the stdlib's sorted top-level ``*.py`` files, and the files used."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    try:
        candidates = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    except OSError:
        candidates = []
    chunks, used, total = [], [], 0
    for path in candidates:
        if total >= limit:
            break
        try:
            chunk = path.read_bytes()
        except OSError:
            continue
        chunks.append(chunk)
        used.append(path)
        total += len(chunk)
    if not used:
        raise DataError(f"text: no Python sources in {stdlib} for the default corpus; pass --data-dir with a "
                        "text file or a folder of .txt/.md/.py files")
    return b"".join(chunks)[:limit], used


def corpus_files(path: Path) -> list[Path]:
    """A file itself, or every non-hidden ``.txt``/``.md``/``.py`` file under a folder, sorted."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"text: {path} does not exist; pass --data-dir with a text file or a folder of "
                        ".txt/.md/.py files")
    found = []
    for dirpath, dirnames, filenames in os.walk(path, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath, f) for f in filenames
                  if not f.startswith(".") and Path(f).suffix.lower() in TEXT_EXTS]
    if not found:
        raise DataError(f"text: {path} has no .txt, .md or .py files; pass --data-dir with a text file or a "
                        "folder of them")
    return sorted(found, key=lambda p: p.relative_to(path).as_posix())


def _read(files: list[Path]) -> bytes:
    try:
        return b"".join(p.read_bytes() for p in files)
    except OSError as e:
        raise DataError(f"text: cannot read {e.filename} ({e.strerror})") from None


def check_size(n_bytes: int, seq_len: int, data_dir: str | None) -> None:
    """Refuse a corpus of ``n_bytes`` too short for ``MIN_WINDOWS`` windows of ``seq_len`` in each split."""
    cut = int(n_bytes * (1 - TEST_FRACTION))
    need = int((MIN_WINDOWS * seq_len + 1) / TEST_FRACTION) + 1
    if (n_bytes - cut - 1) // seq_len < MIN_WINDOWS or (cut - 1) // seq_len < MIN_WINDOWS:
        raise DataError(f"text: corpus {data_dir or 'default'} has {n_bytes:,} bytes; seq_len {seq_len} needs "
                        f"at least {need:,} so the last 10% holds {MIN_WINDOWS} test windows")


def check_text(data_dir: str | None, seq_len: int) -> None:
    """The corpus files exist, are readable and long enough, from their sizes alone (nothing is read)."""
    if data_dir is None:
        return  # the default corpus: the standard library's own sources
    files = corpus_files(Path(data_dir).expanduser())
    unreadable = next((p for p in files if not os.access(p, os.R_OK)), None)
    if unreadable is not None:
        raise DataError(f"text: cannot read {unreadable} (permission denied); fix its permissions")
    check_size(sum(p.stat().st_size for p in files), seq_len, data_dir)


def load_text(data_dir: str | None, seq_len: int) -> Splits:
    """Byte corpus from a file, a folder, or (None) the default stdlib corpus, split 90/10 contiguously."""
    if data_dir is None:
        corpus, files = default_corpus()
        where = f"first {len(corpus):,} bytes of {len(files)} stdlib files in {files[0].parent}"
    else:
        path = Path(data_dir).expanduser()
        files = corpus_files(path)
        corpus = _read(files)
        where = f"{len(corpus):,} bytes of {len(files)} file(s) from {path}"
    check_size(len(corpus), seq_len, data_dir)
    cut = int(len(corpus) * (1 - TEST_FRACTION))
    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    names = tuple(str(p) for p in files)
    return Splits(ByteWindows(data[:cut], seq_len, names), ByteWindows(data[cut:], seq_len, names),
                  256, (seq_len,), f"text: {where}")
