"""Offline datasets: fake CIFAR pickles, tiny image folders and text corpora made in tmp_path.

Run: ``python -m pytest -q tests/unit/test_data.py`` (a few seconds; never touches ~/.cache).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from omnilearn.experiments.datasets import core as data

from omnilearn.experiments.datasets import images as imagedata

from omnilearn.experiments.datasets import text as textdata
from omnilearn.experiments.datasets.base import DataError
from omnilearn.experiments.datasets.core import DataSpec

# ---------------------------------------------------------------- generated datasets


def _old_synthetic(n_train=8192, n_test=2048, length=40, classes=10, seed=0):
    """The generator as it was before image/text datasets were added (must stay bit-for-bit)."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(length, classes, generator=g)
    x = torch.randn(n_train + n_test, length, generator=g)
    y = (x @ teacher).argmax(dim=1)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def _tensors(s: data.Splits) -> tuple[torch.Tensor, ...]:
    return s.train.x, s.train.y, s.test.x, s.test.y


def test_synthetic_default_unchanged():
    for splits in (data.load("synthetic"), data.load(DataSpec("synthetic"))):
        assert splits.num_classes == 10 and splits.input_shape == (40,)
        for new, old in zip(_tensors(splits), _old_synthetic()):
            assert new.dtype == old.dtype and torch.equal(new, old)


def test_mnist1d_unchanged(tmp_path, monkeypatch):
    """A fake cached .npz goes through exactly the old normalisation (no generation needed)."""
    monkeypatch.setenv("OMNILEARN_CACHE", str(tmp_path))
    rng = np.random.default_rng(1)
    arrays = {"x": rng.normal(2, 3, (50, 40)), "y": rng.integers(0, 10, 50),
              "x_test": rng.normal(2, 3, (20, 40)), "y_test": rng.integers(0, 10, 20)}
    np.savez(tmp_path / f"mnist1d-{data.MNIST1D_SAMPLES}-seed{data.MNIST1D_DATA_SEED}.npz", **arrays)
    s = data.load("mnist1d")
    mean, std = arrays["x"].mean(), arrays["x"].std()
    expect = [((arrays["x"] - mean) / std).astype(np.float32), arrays["y"].astype(np.int64),
              ((arrays["x_test"] - mean) / std).astype(np.float32), arrays["y_test"].astype(np.int64)]
    for new, old in zip(_tensors(s), expect):
        assert torch.equal(new, torch.from_numpy(old))
    assert s.num_classes == 10 and s.input_shape == (40,)


def test_synthetic_any_shape():
    s = data.load(DataSpec("synthetic", input_shape=(2, 3, 4), num_classes=5, seed=3))
    assert s.input_shape == (2, 3, 4) and s.num_classes == 5
    x, y = s.train.__getitems__([0, 5, 7])
    assert x.shape == (3, 2, 3, 4) and y.shape == (3,) and y.dtype == torch.long
    assert len(s.train) == 8192 and len(s.test) == 2048 and 0 <= int(s.train.y.min()) and int(s.train.y.max()) < 5
    again = data.load(DataSpec("synthetic", input_shape=(2, 3, 4), num_classes=5, seed=3))
    assert torch.equal(again.train.x, s.train.x) and torch.equal(again.test.y, s.test.y)
    assert len(torch.unique(s.train.y)) > 1


def test_synthetic_sizes_shrink_for_large_shapes():
    assert data.synthetic_sizes((40,)) == (8192, 2048)
    n_train, n_test = data.synthetic_sizes((3, 64, 64))
    assert 512 <= n_train < 8192 and (n_train + n_test) * 3 * 64 * 64 * 4 <= 200e6
    assert data.synthetic_sizes((3, 224, 224)) == (512, 128)
    with pytest.raises(DataError, match="smaller --input-shape"):
        data.synthetic_sizes((3, 1024, 1024))


@pytest.mark.parametrize("spec, needle", [
    (DataSpec("mnist1d", data_dir="/some/where"), "--data-dir is not used by dataset mnist1d"),
    (DataSpec("synthetic", data_dir="/some/where"), "--data-dir is not used by dataset synthetic"),
    (DataSpec("imagenet"), "unknown dataset 'imagenet'"),
    (DataSpec("synthetic", input_shape=(3, 0)), "--input-shape"),
    (DataSpec("synthetic", num_classes=1), "--num-classes 1"),
    (DataSpec("text", seq_len=0), "--seq-len 0"),
    (DataSpec("imagefolder", data_dir="/x", image_size=2), "--image-size 2"),
])
def test_bad_spec(spec, needle):
    with pytest.raises(DataError, match=needle):
        data.load(spec)


def test_irrelevant_fields_are_ignored():
    s = data.load(DataSpec("synthetic", image_size=7, seq_len=3, augment=False))
    assert s.input_shape == (40,)


# ---------------------------------------------------------------- CIFAR


def _pickle(path: Path, n: int, label_key: bytes, classes: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    y = [int(v) for v in rng.integers(0, classes, n)]
    with open(path, "wb") as f:
        pickle.dump({b"data": x, label_key: y, b"batch_label": b"fake"}, f)
    return x, y


def _fake_cifar10(parent: Path) -> tuple[np.ndarray, list[int], np.ndarray, list[int]]:
    root = parent / "cifar-10-batches-py"
    root.mkdir(parents=True)
    parts = [_pickle(root / f"data_batch_{i}", 6, b"labels", 10, i) for i in range(1, 6)]
    xt, yt = _pickle(root / "test_batch", 8, b"labels", 10, 9)
    return np.concatenate([p[0] for p in parts]), sum((p[1] for p in parts), []), xt, yt


def _normalised(raw: np.ndarray, name: str) -> torch.Tensor:
    return imagedata.normalise(torch.from_numpy(raw.reshape(-1, 3, 32, 32)), imagedata.STATS[name])


def test_cifar10_shapes_labels_normalisation(tmp_path):
    x, y, xt, yt = _fake_cifar10(tmp_path)
    for where in (tmp_path / "cifar-10-batches-py", tmp_path):  # the folder or its parent
        s = data.load(DataSpec("cifar10", data_dir=str(where)))
        assert (len(s.train), len(s.test), s.num_classes, s.input_shape) == (30, 8, 10, (3, 32, 32))
        bx, by = s.test.__getitems__(list(range(8)))
        assert bx.dtype == torch.float32 and bx.shape == (8, 3, 32, 32) and by.tolist() == yt
        torch.testing.assert_close(bx, _normalised(xt, "cifar10"))
        assert s.train.targets.tolist() == y
    mean = torch.tensor(imagedata.STATS["cifar10"][0]).view(3, 1, 1)
    assert torch.allclose(_normalised(np.full((1, 3072), 0, np.uint8), "cifar10")[0],
                          -mean / torch.tensor(imagedata.STATS["cifar10"][1]).view(3, 1, 1))


def _is_crop_flip(aug: torch.Tensor, raw: torch.Tensor, pad: int) -> bool:
    padded = torch.nn.functional.pad(raw, (pad, pad, pad, pad))
    h, w = raw.shape[1:]
    return any(torch.equal(aug, c) or torch.equal(aug, c.flip(2))
               for c in (padded[:, i:i + h, j:j + w] for i in range(2 * pad + 1) for j in range(2 * pad + 1)))


def test_cifar_train_augmented_test_not(tmp_path):
    x, y, xt, yt = _fake_cifar10(tmp_path)
    s = data.load(DataSpec("cifar10", data_dir=str(tmp_path)))
    idx = list(range(30))
    a1, l1 = s.train.__getitems__(idx)
    a2, _ = s.train.__getitems__(idx)
    assert l1.tolist() == y and not torch.equal(a1, a2) and not torch.equal(a1, _normalised(x, "cifar10"))
    raw = torch.from_numpy(x.reshape(-1, 3, 32, 32))
    for i in range(0, 30, 7):  # every augmented image is a crop (pad 4) of the original, maybe flipped
        back = torch.round((a1[i] * torch.tensor(imagedata.STATS["cifar10"][1]).view(3, 1, 1)
                            + torch.tensor(imagedata.STATS["cifar10"][0]).view(3, 1, 1)) * 255).to(torch.uint8)
        assert _is_crop_flip(back, raw[i], 4)
    t1, _ = s.test.__getitems__(list(range(8)))
    assert torch.equal(t1, s.test.__getitems__(list(range(8)))[0])
    off = data.load(DataSpec("cifar10", data_dir=str(tmp_path), augment=False))
    torch.testing.assert_close(off.train.__getitems__(idx)[0], _normalised(x, "cifar10"))


@pytest.mark.parametrize("pad, h, w", [(0, 5, 7), (2, 5, 7), (4, 32, 32)])
def test_random_crop_flip_matches_a_loop(pad, h, w):
    x = torch.randint(0, 256, (9, 3, h, w), dtype=torch.uint8)
    got = imagedata.random_crop_flip(x, pad, torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    oy, ox = torch.randint(0, 2 * pad + 1, (2, 9), generator=g)
    flip = torch.rand(9, generator=g) < 0.5
    p = torch.nn.functional.pad(x, (pad,) * 4)
    for i in range(9):
        crop = p[i, :, oy[i]:oy[i] + h, ox[i]:ox[i] + w]
        assert torch.equal(got[i], crop.flip(2) if flip[i] else crop)


def test_cifar100(tmp_path):
    root = tmp_path / "cifar-100-python"
    root.mkdir()
    x, y = _pickle(root / "train", 20, b"fine_labels", 100, 1)
    xt, yt = _pickle(root / "test", 7, b"fine_labels", 100, 2)
    s = data.load(DataSpec("cifar100", data_dir=str(tmp_path)))
    assert (len(s.train), len(s.test), s.num_classes) == (20, 7, 100)
    bx, by = s.test.__getitems__([6, 0])
    assert by.tolist() == [yt[6], yt[0]]
    torch.testing.assert_close(bx, _normalised(xt[[6, 0]], "cifar100"))
    assert s.train.__getitem__(3)[0].shape == (3, 32, 32)


def test_cifar_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="needs --data-dir"):
        data.load("cifar10")
    with pytest.raises(DataError, match=f"{tmp_path / 'nope'} is not a directory"):
        data.load(DataSpec("cifar10", data_dir=str(tmp_path / "nope")))
    with pytest.raises(DataError, match=f"{tmp_path} has no data_batch_1..5 and test_batch.*cifar-10-batches-py"):
        data.load(DataSpec("cifar10", data_dir=str(tmp_path)))
    with pytest.raises(DataError, match=f"{tmp_path} has no train and test.*cifar-100-python"):
        data.load(DataSpec("cifar100", data_dir=str(tmp_path)))
    _fake_cifar10(tmp_path)
    bad = tmp_path / "cifar-10-batches-py" / "data_batch_3"
    bad.write_bytes(b"this is not a pickle")
    with pytest.raises(DataError, match=f"cannot read {bad} as a CIFAR pickle"):
        data.load(DataSpec("cifar10", data_dir=str(tmp_path)))
    with open(bad, "wb") as f:
        pickle.dump({b"data": np.zeros((4, 100), np.uint8), b"labels": [0] * 4}, f)
    with pytest.raises(DataError, match=f"{bad} lacks uint8 'data'"):
        data.load(DataSpec("cifar10", data_dir=str(tmp_path)))
    with open(bad, "wb") as f:
        pickle.dump({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}, f)
    with pytest.raises(DataError, match=f"{bad} has no samples or labels outside 0..9"):
        data.load(DataSpec("cifar10", data_dir=str(tmp_path)))


# ---------------------------------------------------------------- image folders

COLOURS = {"ant": (255, 0, 0), "bee": (0, 255, 0), "cat": (0, 0, 255)}


def _png(path: Path, size: tuple[int, int], colour: tuple[int, int, int], mode: str = "RGB") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, colour).convert(mode).save(path)


def _tree(root: Path, per_class: int = 10) -> set[str]:
    files = set()
    for c, colour in COLOURS.items():
        for i in range(per_class):
            ext = (".png", ".PNG", ".bmp", ".jpg")[i % 4]
            p = root / c / f"img{i:02d}{ext}"
            _png(p, (12 + 5 * i, 40 - 2 * i), colour, "L" if i == 3 and c == "ant" else "RGB")
            files.add(str(p))
    (root / "ant" / "notes.txt").write_text("not an image")
    (root / "ant" / ".hidden.png").write_bytes(b"")
    _png(root / ".cache" / "x.png", (8, 8), (1, 2, 3))
    return files


def _paths(ds) -> list[str]:
    return list(ds.files)


def test_imagefolder_split_is_a_deterministic_partition(tmp_path):
    files = _tree(tmp_path)
    s = data.load(DataSpec("imagefolder", data_dir=str(tmp_path), image_size=16))
    train, test = _paths(s.train), _paths(s.test)
    assert s.num_classes == 3 and s.input_shape == (3, 16, 16)
    assert not set(train) & set(test) and len(train) + len(test) == len(files) == len(set(train) | set(test))
    assert set(train) | set(test) == files and len(test) == 6  # 20% of 10 per class
    again = data.load(DataSpec("imagefolder", data_dir=str(tmp_path), image_size=16))
    assert _paths(again.train) == train and _paths(again.test) == test
    other = data.load(DataSpec("imagefolder", data_dir=str(tmp_path), image_size=16, seed=1))
    assert set(_paths(other.test)) != set(test)


def test_imagefolder_pixels_labels_and_augmentation(tmp_path):
    _tree(tmp_path)
    s = data.load(DataSpec("imagefolder", data_dir=str(tmp_path), image_size=16))
    x, y = s.test.__getitems__(list(range(len(s.test))))
    assert x.shape == (6, 3, 16, 16) and x.dtype == torch.float32
    for img, label, path in zip(x, y.tolist(), s.test.files):
        cls = ["ant", "bee", "cat"][label]
        assert Path(path).parent.name == cls
        if not path.endswith(".jpg"):  # lossless: exactly the class colour everywhere
            colour = torch.tensor(COLOURS[cls], dtype=torch.uint8).view(1, 3, 1, 1).expand(1, 3, 16, 16)
            torch.testing.assert_close(img, imagedata.normalise(colour, imagedata.STATS["imagenet"])[0])
    idx = list(range(len(s.train)))
    assert not torch.equal(s.train.__getitems__(idx)[0], s.train.__getitems__(idx)[0])
    assert torch.equal(s.test.__getitems__([0, 1])[0], s.test.__getitems__([0, 1])[0])
    loader = DataLoader(s.train, batch_sampler=[[0, 1, 2], [3, 4]], collate_fn=data.keep_batch)
    assert [b[0].shape[0] for b in loader] == [3, 2]


def test_imagefolder_explicit_train_and_val(tmp_path):
    train_files = _tree(tmp_path / "train", 4)
    for c, colour in COLOURS.items():
        _png(tmp_path / "val" / c / "v.png", (20, 20), colour)
    _png(tmp_path / "val" / "bee" / "w.gif", (9, 30), (0, 255, 0))
    s = data.load(DataSpec("imagefolder", data_dir=str(tmp_path), image_size=8))
    assert set(_paths(s.train)) == train_files and len(s.test) == 4 and s.num_classes == 3
    assert sorted(s.test.targets.tolist()) == [0, 1, 1, 2]
    _png(tmp_path / "val" / "dog" / "d.png", (20, 20), (9, 9, 9))
    with pytest.raises(DataError, match="classes missing from .*train: dog"):
        data.load(DataSpec("imagefolder", data_dir=str(tmp_path)))


def test_imagefolder_nested_classes(tmp_path):
    for c in ("a/airfield", "a/alley", "b/bar"):
        for i in range(3):
            _png(tmp_path / c / f"{i}.png", (10, 10), (i, i, i))
    s = data.load(DataSpec("imagefolder", data_dir=str(tmp_path), image_size=8))
    assert s.num_classes == 3 and len(s.train) + len(s.test) == 9


def test_imagefolder_food101_meta_split(tmp_path):
    lines = {"train": [], "test": []}
    for c in ("apple_pie", "baklava"):
        for i in range(5):
            _png(tmp_path / "images" / c / f"{100 + i}.jpg", (20, 16), (200, 100, 50))
            lines["train" if i < 3 else "test"].append(f"{c}/{100 + i}")
    (tmp_path / "meta").mkdir()
    for split, ls in lines.items():
        (tmp_path / "meta" / f"{split}.txt").write_text("\n".join(ls) + "\n")
    s = data.load(DataSpec("imagefolder", data_dir=str(tmp_path), image_size=8))
    assert s.num_classes == 2 and (len(s.train), len(s.test)) == (6, 4)
    assert _paths(s.test)[0] == str(tmp_path / "images" / "apple_pie" / "103.jpg")
    assert s.test.targets.tolist() == [0, 0, 1, 1]
    assert s.train.__getitems__([0, 5])[0].shape == (2, 3, 8, 8)
    (tmp_path / "meta" / "test.txt").write_text("baklava/999\n")
    with pytest.raises(DataError, match="missing, e.g. .*baklava/999.jpg"):
        data.load(DataSpec("imagefolder", data_dir=str(tmp_path)))
    (tmp_path / "meta" / "test.txt").write_text("apple_pie/100\n")
    with pytest.raises(DataError, match="share files"):
        data.load(DataSpec("imagefolder", data_dir=str(tmp_path)))


def test_imagefolder_errors_name_the_path(tmp_path):
    with pytest.raises(DataError, match="imagefolder needs --data-dir"):
        data.load("imagefolder")
    with pytest.raises(DataError, match=f"{tmp_path / 'missing'} is not a directory"):
        data.load(DataSpec("imagefolder", data_dir=str(tmp_path / "missing")))
    with pytest.raises(DataError, match=f"{tmp_path} has 0 classes"):
        data.load(DataSpec("imagefolder", data_dir=str(tmp_path)))
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "readme.txt").write_text("x")
    with pytest.raises(DataError, match=f"{tmp_path} has 0 classes"):
        data.load(DataSpec("imagefolder", data_dir=str(tmp_path)))
    _png(tmp_path / "only" / "a.png", (8, 8), (0, 0, 0))
    _png(tmp_path / "other" / "b.png", (8, 8), (0, 0, 0))
    with pytest.raises(DataError, match="2 classes, 2 train and 0 test"):
        data.load(DataSpec("imagefolder", data_dir=str(tmp_path)))
    for i in range(3):
        (tmp_path / "other" / f"c{i}.png").write_bytes(b"corrupt")
    s = data.load(DataSpec("imagefolder", data_dir=str(tmp_path)))
    bad = next(i for i, f in enumerate(s.test.files + s.train.files) if "/c" in f)
    ds, i = (s.test, bad) if bad < len(s.test) else (s.train, bad - len(s.test))
    with pytest.raises(DataError, match=f"cannot decode image {tmp_path / 'other'}/c"):
        ds.__getitems__([i])


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=6), seed=st.integers(0, 2**32 - 1))
def test_split_files_is_a_partition(sizes, seed):
    by_class = {f"c{k}": [f"c{k}/{i}.png" for i in range(n)] for k, n in enumerate(sizes)}
    train, test = imagedata.split_files(by_class, seed)
    everything = [f for files in by_class.values() for f in files]
    assert sorted(f for f, _ in train + test) == sorted(everything)
    for k, n in enumerate(sizes):
        n_test = sum(1 for _, c in test if c == k)
        assert (n_test == 0) if n < 2 else (1 <= n_test <= n - 1 and abs(n_test - 0.2 * n) <= 1)
        assert all(f.startswith(f"c{k}/") for f, c in train + test if c == k)
    assert imagedata.split_files(by_class, seed) == (train, test)


# ---------------------------------------------------------------- text


def _check_windows(ds, corpus: bytes) -> None:
    n = len(ds)
    assert n == (len(corpus) - 1) // ds.seq_len
    x, y = ds.__getitems__(list(range(n)))
    assert x.dtype == y.dtype == torch.long and x.shape == y.shape == (n, ds.seq_len)
    assert torch.equal(x[:, 1:], y[:, :-1]) and torch.equal(x[1:, 0], y[:-1, -1])
    assert bytes(x.flatten().tolist()) == corpus[:n * ds.seq_len]
    assert bytes(y.flatten().tolist()) == corpus[1:n * ds.seq_len + 1]


def test_text_default_corpus():
    s = data.load("text")
    assert s.num_classes == 256 and s.input_shape == (64,)
    corpus, files = textdata.default_corpus()
    assert len(corpus) == textdata.DEFAULT_CORPUS_BYTES and [str(f) for f in files] == list(s.train.files)
    assert all(f.suffix == ".py" for f in files) and files == sorted(files)
    cut = int(len(corpus) * 0.9)
    _check_windows(s.train, corpus[:cut])
    _check_windows(s.test, corpus[cut:])
    assert str(len(files)) in s.source


def test_text_custom_file_and_folder(tmp_path):
    text = bytes(range(256)) * 12
    (tmp_path / "book.bin").write_bytes(text)
    s = data.load(DataSpec("text", data_dir=str(tmp_path / "book.bin"), seq_len=16))
    assert s.input_shape == (16,)
    _check_windows(s.train, text[:int(len(text) * 0.9)])
    _check_windows(s.test, text[int(len(text) * 0.9):])
    x, y = s.train[3]
    assert x.tolist() == list(text[48:64]) and y.tolist() == list(text[49:65])
    folder = tmp_path / "notes"
    for name, body in (("b.md", b"B" * 300), ("a.txt", b"A" * 300), ("sub/c.py", b"C" * 300),
                       ("skip.bin", b"X" * 300), (".hidden/d.txt", b"D" * 300)):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(body)
    s = data.load(DataSpec("text", data_dir=str(folder), seq_len=8))
    assert [Path(f).name for f in s.train.files] == ["a.txt", "b.md", "c.py"]
    _check_windows(s.train, (b"A" * 300 + b"B" * 300 + b"C" * 300)[:810])


def test_text_errors_name_the_path(tmp_path):
    small = tmp_path / "small.txt"
    small.write_bytes(b"x" * 1000)
    with pytest.raises(DataError, match=f"corpus {small} has 1,000 bytes; seq_len 64 needs at least"):
        data.load(DataSpec("text", data_dir=str(small)))
    assert len(data.load(DataSpec("text", data_dir=str(small), seq_len=8)).test) >= 2
    with pytest.raises(DataError, match=f"{tmp_path / 'nope'} does not exist"):
        data.load(DataSpec("text", data_dir=str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"{tmp_path / 'empty'} has no .txt, .md or .py files"):
        data.load(DataSpec("text", data_dir=str(tmp_path / "empty")))
