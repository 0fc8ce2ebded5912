"""Image datasets read from local files: CIFAR-10/100 python pickles and class-per-folder trees.

Usage (normally through :func:`omnilearn.experiments.datasets.core.load`)::

    splits = data.load(DataSpec("cifar10", data_dir="~/data"))  # .../cifar-10-batches-py or its parent
    splits = data.load(DataSpec("imagefolder", data_dir="~/data/caltech256", image_size=64))
    x, y = splits.train.__getitems__([0, 1])  # float32 (2, 3, S, S) normalised, int64 (2,)

CIFAR is held in memory as uint8 (N, 3, 32, 32) and normalised per batch with the standard
per-channel mean/std. Image folders are decoded lazily with Pillow: RGB, shorter side resized
to ``image_size`` then centre-cropped square, normalised with the ImageNet mean/std. Train
splits (when ``augment``) get a random crop from the image zero-padded by ``size // 8``
(4 for CIFAR) plus a random horizontal flip, vectorised per batch; test splits never do.

Image-folder layouts, checked in this order: Food-101 (``root/meta/train.txt`` and
``test.txt`` listing ``class/id`` under ``root/images``); explicit ``root/train`` plus
``root/test`` (or ``root/val``); otherwise ``root/<class>/<images>`` split per class, 20% to
test by a permutation seeded with (seed, crc32(class name)) of the sorted file list, so the
split is a partition. A class is any folder holding image files directly (name = its path
relative to the split root), so nested Places365-style ``a/airfield`` trees work. Hidden
entries and non-image files (by extension) are ignored. Note: pickles can run code; only
load CIFAR files from the official archive.

Up-front checks (:mod:`omnilearn.experiments.train.preflight`, before any worker starts):
:func:`cifar_root` finds the batch files without reading them; :func:`check_imagefolder`
scans the tree and decodes a sample (first and last image of each class), since images
are otherwise decoded only inside the workers, after they started.

Tests:  python -m pytest -q tests/unit/test_data.py

Why one file over 300 lines: CIFAR pickles and class-per-folder trees (ImageFolder, Food-101's layout) share
their tensors, decoding, checks and augmentation; each reader is short.
"""

from __future__ import annotations

import os
import pickle
import zlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from omnilearn.experiments.datasets.base import DataError, Splits

CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
IMAGE_EXTS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp"})
TEST_FRACTION = 0.2
CHECK_IMAGES = 256  # images check_imagefolder decodes at most
Pairs = list[tuple[str, int]]  # (image file, class index)
STATS = {  # per-channel mean, std of pixel values in [0, 1]
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}
# name: (folder in the archive, train files, test files, label key, classes, what the files are)
CIFAR = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], "labels", 10,
                "data_batch_1..5 and test_batch"),
    "cifar100": ("cifar-100-python", ["train"], ["test"], "fine_labels", 100, "train and test"),
}


def random_crop_flip(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Per image: a random same-size crop of ``x`` zero-padded by ``pad``, then a random horizontal flip.

    One gather over precomputed flat indices (the flip reverses the column indices), ~2 ms per 512 CIFAR images.
    """
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad)) if pad > 0 else x
    oy, ox = torch.randint(0, 2 * pad + 1, (2, b), generator=gen)
    flip = torch.rand(b, generator=gen) < 0.5
    cols = torch.where(flip[:, None], torch.arange(w - 1, -1, -1), torch.arange(w)) + ox[:, None]
    rows = oy[:, None] + torch.arange(h)
    flat = (rows[:, :, None] * (w + 2 * pad) + cols[:, None, :]).view(b, 1, h * w).expand(b, c, h * w)
    return padded.reshape(b, c, -1).gather(2, flat).view(b, c, h, w)


def normalise(x: torch.Tensor, stats: tuple[tuple[float, ...], tuple[float, ...]]) -> torch.Tensor:
    """uint8 (B, 3, H, W) to float32, scaled to [0, 1] and standardised per channel."""
    mean = torch.tensor(stats[0], dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(stats[1], dtype=torch.float32).view(1, -1, 1, 1)
    return (x.float().div_(255) - mean) / std


class ImageBatches(Dataset):
    """Base: subclasses give uint8 images per index list; this augments (train) and normalises per batch."""

    returns_batches = True  # __getitems__ returns a collated (x, y): use data.keep_batch as collate_fn

    def __init__(self, targets: torch.Tensor, stats, augment: bool, pad: int, seed: int) -> None:
        self.targets, self.stats, self.augment, self.pad, self.seed = targets, stats, augment, pad, seed
        self._calls = 0

    def images(self, indices: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self.targets)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images(indices)
        if self.augment and len(indices):
            # Seeded per call and by the first index, so forked loader workers draw different crops.
            state = np.random.SeedSequence([self.seed, self._calls, int(indices[0])]).generate_state(1, np.uint64)
            x = random_crop_flip(x, self.pad, torch.Generator().manual_seed(int(state[0])))
            self._calls += 1
        return normalise(x, self.stats), self.targets[torch.as_tensor(indices, dtype=torch.long)]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]


class UInt8Images(ImageBatches):
    """Images held in memory as a uint8 (N, 3, H, W) tensor (CIFAR)."""

    def __init__(self, x: torch.Tensor, targets: torch.Tensor, stats, augment: bool, pad: int, seed: int) -> None:
        super().__init__(targets, stats, augment, pad, seed)
        self.x = x

    def images(self, indices: list[int]) -> torch.Tensor:
        return self.x[torch.as_tensor(indices, dtype=torch.long)]


class ImageFiles(ImageBatches):
    """Image files decoded on demand with Pillow to uint8 (3, size, size)."""

    def __init__(self, files: list[tuple[str, int]], size: int, augment: bool, seed: int) -> None:
        super().__init__(torch.tensor([c for _, c in files], dtype=torch.long), STATS["imagenet"],
                         augment, size // 8, seed)
        self.files, self.size = [f for f, _ in files], size

    def images(self, indices: list[int]) -> torch.Tensor:
        if not indices:
            return torch.empty(0, 3, self.size, self.size, dtype=torch.uint8)
        arrays = np.stack([decode(self.files[i], self.size) for i in indices])
        return torch.from_numpy(arrays).permute(0, 3, 1, 2).contiguous()


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("imagefolder needs Pillow to decode images; install it: pip install pillow") from None
    return Image


def decode(path: str, size: int) -> np.ndarray:
    """RGB uint8 (size, size, 3): shorter side resized to ``size``, then the centre square."""
    Image = _pil()
    try:
        with Image.open(path) as im:
            im.draft("RGB", (size, size))  # JPEG: decode at a reduced scale, never below size
            im = im.convert("RGBA" if im.mode in ("P", "PA", "LA") else "RGB").convert("RGB")
            scale = size / min(im.size)
            w, h = max(size, round(im.size[0] * scale)), max(size, round(im.size[1] * scale))
            im = im.resize((w, h), Image.Resampling.BILINEAR, reducing_gap=3.0)
            left, top = (w - size) // 2, (h - size) // 2
            return np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.uint8)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise DataError(f"imagefolder: cannot decode image {path} ({type(e).__name__}); "
                        "remove or replace the file") from None


def _dir(name: str, data_dir: str | None, expected: str) -> Path:
    if data_dir is None:
        raise DataError(f"{name} needs --data-dir: {expected}")
    path = Path(data_dir).expanduser()
    if not path.is_dir():
        raise DataError(f"{name}: {path} is not a directory; pass --data-dir pointing at {expected}")
    return path


def _read_cifar(name: str, path: Path, label_key: str, classes: int) -> tuple[np.ndarray, np.ndarray]:
    hint = f"re-extract the python version from {CIFAR_URL}"
    try:
        with open(path, "rb") as f:
            d = pickle.load(f, encoding="bytes")
    except Exception as e:  # unpickling garbage can raise almost anything
        raise DataError(f"{name}: cannot read {path} as a CIFAR pickle ({type(e).__name__}); {hint}") from None
    if not isinstance(d, dict):
        raise DataError(f"{name}: {path} holds a {type(d).__name__}, not a CIFAR batch dict; {hint}")
    x, y = (d.get(k.encode(), d.get(k)) for k in ("data", label_key))  # bytes keys; str if re-pickled
    x = np.asarray(x) if x is not None else None
    y = np.asarray(y) if y is not None else None
    if x is None or y is None or x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3072 or y.shape != (len(x),):
        raise DataError(f"{name}: {path} lacks uint8 'data' (N x 3072) and '{label_key}' (N); {hint}")
    if len(x) == 0 or y.min() < 0 or y.max() >= classes:
        raise DataError(f"{name}: {path} has no samples or labels outside 0..{classes - 1}; {hint}")
    return x.reshape(-1, 3, 32, 32), y.astype(np.int64)


def cifar_root(name: str, data_dir: str | None) -> Path:
    """The folder holding CIFAR ``name``'s batch files (``data_dir`` or its ``cifar-*`` child); no file is read."""
    folder, train_files, test_files, _, _, what = CIFAR[name]
    expected = f"the extracted '{folder}' folder from {CIFAR_URL} (python version)"
    path = _dir(name, data_dir, expected)
    root = next((p for p in (path, path / folder) if all((p / f).is_file() for f in train_files + test_files)), None)
    if root is None:
        raise DataError(f"{name}: {path} has no {what}; pass --data-dir pointing at {expected}")
    unreadable = next((root / f for f in train_files + test_files if not os.access(root / f, os.R_OK)), None)
    if unreadable is not None:
        raise DataError(f"{name}: cannot read {unreadable} (permission denied); fix its permissions")
    return root


def load_cifar(name: str, data_dir: str | None, augment: bool, seed: int) -> Splits:
    """CIFAR-10/100 from the extracted python-pickle folder (or the folder that contains it)."""
    _, train_files, test_files, label_key, classes, _ = CIFAR[name]
    root = cifar_root(name, data_dir)

    def read(files: list[str], train: bool) -> UInt8Images:
        parts = [_read_cifar(name, root / f, label_key, classes) for f in files]
        x = torch.from_numpy(np.concatenate([p[0] for p in parts]))
        y = torch.from_numpy(np.concatenate([p[1] for p in parts]))
        return UInt8Images(x, y, STATS[name], augment and train, 4, seed)

    return Splits(read(train_files, True), read(test_files, False), classes, (3, 32, 32), f"{name}: {root}")


def scan_classes(root: Path) -> dict[str, list[str]]:
    """Class name (folder path relative to root) -> sorted image files directly in it; sorted by name."""
    found: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        images = sorted(f for f in filenames if not f.startswith(".") and Path(f).suffix.lower() in IMAGE_EXTS)
        rel = Path(dirpath).relative_to(root).as_posix()
        if images and rel != ".":
            found[rel] = [os.path.join(dirpath, f) for f in images]
    return dict(sorted(found.items()))


def split_files(by_class: dict[str, list[str]], seed: int, test_fraction: float = TEST_FRACTION,
                ) -> tuple[Pairs, Pairs]:
    """Per class, a seeded permutation sends ~test_fraction (at least 1 of 2+) to test: a partition."""
    train: Pairs = []
    test: Pairs = []
    for label, (name, files) in enumerate(by_class.items()):
        files = sorted(files)
        order = np.random.default_rng([seed, zlib.crc32(name.encode())]).permutation(len(files))
        n_test = 0 if len(files) < 2 else min(len(files) - 1, max(1, int(len(files) * test_fraction + 0.5)))
        test += [(files[i], label) for i in order[:n_test]]
        train += [(files[i], label) for i in order[n_test:]]
    return train, test


def _explicit_split(root: Path, test_dir: Path) -> tuple[Pairs, Pairs, list[str]]:
    train_classes, test_classes = scan_classes(root / "train"), scan_classes(test_dir)
    unknown = sorted(set(test_classes) - set(train_classes))
    if unknown:
        raise DataError(f"imagefolder: {test_dir} has classes missing from {root / 'train'}: {', '.join(unknown[:3])}")
    index = {c: i for i, c in enumerate(train_classes)}
    train = [(f, index[c]) for c, files in train_classes.items() for f in files]
    test = [(f, index[c]) for c, files in test_classes.items() for f in files]
    return train, test, list(train_classes)


def _food101(root: Path) -> tuple[Pairs, Pairs, list[str]]:
    meta, images = root / "meta", root / "images"
    try:
        lists = {s: [ln.strip() for ln in (meta / f"{s}.txt").read_text().splitlines() if ln.strip()]
                 for s in ("train", "test")}
        classes_txt = meta / "classes.txt"
        classes = (classes_txt.read_text().split() if classes_txt.is_file()
                   else sorted({ln.split("/")[0] for ln in lists["train"]}))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"imagefolder: cannot read Food-101 split files in {meta} ({e.__class__.__name__})") from None
    index = {c: i for i, c in enumerate(classes)}
    out = {}
    for split, lines in lists.items():
        bad = next((ln for ln in lines if ln.split("/")[0] not in index), None)
        if bad is not None:
            raise DataError(f"imagefolder: {meta / (split + '.txt')} lists {bad!r}, whose class is not known")
        rel = [ln if Path(ln).suffix.lower() in IMAGE_EXTS else ln + ".jpg" for ln in lines]
        out[split] = [(str(images / r), index[ln.split("/")[0]]) for r, ln in zip(rel, lines)]
        missing = [f for f, _ in out[split] if not os.path.isfile(f)]
        if missing:
            raise DataError(f"imagefolder: {len(missing)} files listed in {meta / (split + '.txt')} are missing, "
                            f"e.g. {missing[0]}; expected Food-101's images/<class>/<id>.jpg")
    if set(f for f, _ in out["train"]) & set(f for f, _ in out["test"]):
        raise DataError(f"imagefolder: {meta} train.txt and test.txt share files; the split must be disjoint")
    return out["train"], out["test"], classes


def folder_split(root: Path, seed: int) -> tuple[Pairs, Pairs, list[str]]:
    """(train, test, class names) for an image-folder root; see the module docstring for the layouts."""
    if (root / "meta" / "train.txt").is_file() and (root / "meta" / "test.txt").is_file():
        return _food101(root)
    test_dir = next((root / d for d in ("test", "val") if (root / d).is_dir()), None)
    if (root / "train").is_dir() and test_dir is not None:
        return _explicit_split(root, test_dir)
    by_class = scan_classes(root)
    train, test = split_files(by_class, seed)
    return train, test, list(by_class)


def _imagefolder_split(data_dir: str | None, seed: int) -> tuple[Path, Pairs, Pairs, list[str]]:
    expected = "a folder of <class>/<image> subfolders (or train/ and test/ or val/ of them, or Food-101)"
    root = _dir("imagefolder", data_dir, expected)
    _pil()
    train, test, classes = folder_split(root, seed)
    if len(classes) < 2 or not train or not test:
        raise DataError(f"imagefolder: {root} has {len(classes)} classes, {len(train)} train and {len(test)} test "
                        f"images (.jpg .jpeg .png .bmp .gif .webp); expected {expected} with 2+ classes")
    return root, train, test, classes


def decode_sample(pairs: Pairs, limit: int = CHECK_IMAGES) -> list[str]:
    """The files a check decodes: the first and last file of every class, at most ``limit`` spread evenly."""
    by_class: dict[int, list[str]] = {}
    for f, c in pairs:
        by_class.setdefault(c, []).append(f)
    files = list(dict.fromkeys(f for fs in by_class.values() for f in (min(fs), max(fs))))
    if len(files) > limit:
        files = [files[i * len(files) // limit] for i in range(limit)]
    return files


def check_imagefolder(data_dir: str | None, size: int, seed: int) -> int:
    """What workers would hit later, now: the layout, and a sample of images decodes; the number decoded.

    Catches a tree of undecodable files (Git LFS pointers, HTML error pages, unreadable files, a cut
    extraction: the last file of a class) in about a second; a single bad file among many still shows
    when a worker reaches it.
    """
    _, train, test, _ = _imagefolder_split(data_dir, seed)
    files = decode_sample(train + test)
    for path in files:
        try:
            with open(path, "rb") as f:
                head = f.read(64)
        except OSError as e:
            raise DataError(f"imagefolder: cannot read image {path} ({e.strerror}); fix its permissions") from None
        if head.startswith(b"version https://git-lfs"):
            raise DataError(f"imagefolder: {path} is a Git LFS pointer, not an image; run `git lfs pull` "
                            "in the data repository")
        decode(path, size)
    return len(files)


def load_imagefolder(data_dir: str | None, size: int, augment: bool, seed: int) -> Splits:
    """A class-per-folder image tree (Food-101, Caltech-256, Places365 style), decoded lazily."""
    root, train, test, classes = _imagefolder_split(data_dir, seed)
    return Splits(ImageFiles(train, size, augment, seed), ImageFiles(test, size, False, seed),
                  len(classes), (3, size, size), f"imagefolder: {root}, {len(classes)} classes")
