"""Sums and maxima over any suffix of a long stream of records, in bounded memory.

A run's summary asks for statistics over "the last half" of its steps (or of
a worker's pushes), and where that half starts is known only when the run
ends. :class:`SuffixStats` takes fixed-width float records one at a time and
answers ``since(first)``: per column the sum (or the maximum) over records
``first .. count-1``, exactly as if every record had been kept. How: records
are grouped in chunks of ``chunk``; memory holds one aggregate per finished
chunk plus the open chunk's records, and the finished chunks' records go to
an anonymous temporary file (the spool, deleted when closed), from which a
query reads back at most the one chunk that the suffix starts inside.
Memory is ``O(count / chunk * width)`` floats; the run directory is not touched.

Run its tests: ``python -m pytest -q tests/unit/test_recorder.py``
"""

from __future__ import annotations

import os
import tempfile
from typing import Sequence

import numpy as np

OPS = ("sum", "max")
CHUNK_RECORDS = 256


class SuffixStats:
    """A stream of records with one aggregation op per column (``"sum"`` or ``"max"``)."""

    def __init__(self, ops: Sequence[str], chunk: int = CHUNK_RECORDS) -> None:
        if not ops or any(op not in OPS for op in ops):
            raise ValueError(f"ops must be a non-empty list of {', '.join(OPS)}, got {list(ops)}")
        if chunk < 1:
            raise ValueError(f"chunk {chunk} must be at least 1")
        self.ops, self.chunk, self.width = tuple(ops), chunk, len(ops)
        self.is_max = np.array([op == "max" for op in ops])
        self.count = 0
        self.chunk_aggregates: list[np.ndarray] = []  # one per finished (spooled) chunk
        self.open_records: list[list[float]] = []  # the chunk being filled
        self.spool = None

    @property
    def held_floats(self) -> int:
        """Floats held in memory: what the memory bound is about."""
        return self.width * (len(self.chunk_aggregates) + len(self.open_records))

    def add(self, values: Sequence[float]) -> None:
        if len(values) != self.width:
            raise ValueError(f"a record has {self.width} values, got {len(values)}")
        self.open_records.append([float(v) for v in values])
        self.count += 1
        if len(self.open_records) == self.chunk:
            self._spool_chunk()

    def extend(self, records: Sequence[Sequence[float]]) -> None:
        """Several records, as :meth:`add` each (one conversion for all: a window's rows at once)."""
        block = np.asarray(records, dtype=np.float64)
        if block.size == 0:
            return
        if block.ndim != 2 or block.shape[1] != self.width:
            raise ValueError(f"records of {self.width} values each, got an array of shape {block.shape}")
        self.open_records += block.tolist()
        self.count += len(block)
        while len(self.open_records) >= self.chunk:
            self._spool_chunk()

    def _spool_chunk(self) -> None:
        """The open chunk's first ``chunk`` records to the spool, their aggregate kept."""
        block = np.asarray(self.open_records[: self.chunk], dtype=np.float64)
        if self.spool is None:
            self.spool = tempfile.TemporaryFile(prefix="omnilearn-spool-")
        self.spool.write(block.tobytes())
        self.chunk_aggregates.append(self.aggregate(block))
        self.open_records = self.open_records[self.chunk :]

    def aggregate(self, block: np.ndarray) -> np.ndarray:
        """Per column: the sum, or the maximum, of ``block``'s rows (zeros / -inf for no rows)."""
        if len(block) == 0:
            return np.where(self.is_max, -np.inf, 0.0)
        return np.where(self.is_max, block.max(axis=0), block.sum(axis=0))

    def combine(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.where(self.is_max, np.maximum(a, b), a + b)

    def _chunk_records(self, index: int) -> np.ndarray:
        """The records of finished chunk ``index``, read back from the spool."""
        self.spool.flush()
        size = self.chunk * self.width * 8
        data = os.pread(self.spool.fileno(), size, index * size)
        return np.frombuffer(data, dtype=np.float64).reshape(self.chunk, self.width)

    def since(self, first: int) -> list[float]:
        """Per column, the sum or the maximum over records ``first .. count-1`` (``first`` clipped to ``0..count``)."""
        first = min(max(0, first), self.count)
        open_block = np.asarray(self.open_records, dtype=np.float64).reshape(-1, self.width)
        start_chunk, offset = divmod(first, self.chunk)
        if start_chunk >= len(self.chunk_aggregates):  # the suffix starts inside the open chunk (or is empty)
            return self.aggregate(open_block[offset:]).tolist()
        total = self.aggregate(self._chunk_records(start_chunk)[offset:])
        for agg in self.chunk_aggregates[start_chunk + 1 :]:
            total = self.combine(total, agg)
        return self.combine(total, self.aggregate(open_block)).tolist()

    def record(self, index: int) -> list[float]:
        """Record ``index`` (0-based) as it was added."""
        if not 0 <= index < self.count:
            raise IndexError(f"record {index} of {self.count}")
        chunk, offset = divmod(index, self.chunk)
        if chunk < len(self.chunk_aggregates):
            return self._chunk_records(chunk)[offset].tolist()
        return list(self.open_records[offset])

    def close(self) -> None:
        if self.spool is not None:
            self.spool.close()
            self.spool = None
