"""The directory commit of :mod:`omnilearn.commit`: a crash after any filesystem step leaves a complete checkpoint.

Pure and fast: a "checkpoint" is a directory of two part files and the mark, all holding the same value, so a
reader can tell a whole one from a torn one. The crash: right after the k-th rename or removal
(``os.replace``, ``shutil.rmtree``) the process "dies": that call and every later one raise. For every k the
parent then holds a complete checkpoint (the old one or the new one), and the next commit leaves nothing but
committed directories behind.

Run: ``python -m pytest -q tests/unit/test_commit.py``
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from crashes import Crash, Ops
from omnilearn.commit import CheckpointWarning, commit_directory, committed_directories, recover_directories

MARK = "state.json"


def parts(value: str):
    def write(tmp: Path) -> None:
        (tmp / "a").write_text(value)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b").write_text(value)
    return write


def save(parent: Path, name: str, value: str, keep: int = 3) -> Path:
    def prune() -> None:
        for old in sorted(committed_directories(parent, MARK))[:-keep]:
            shutil.rmtree(committed_directories(parent, MARK)[old])
    return commit_directory(parent / name, parts(value), MARK, lambda: value.encode(), prune)


def values(parent: Path) -> dict[str, str]:
    """Each committed checkpoint's value, checked whole (every part agrees with the mark)."""
    out = {}
    for name, path in committed_directories(parent, MARK).items():
        value = (path / MARK).read_text()
        assert (path / "a").read_text() == value and (path / "sub" / "b").read_text() == value, (name, path)
        out[name] = value
    return out


@pytest.mark.parametrize("second, keep", [("step-10", 3), ("step-20", 1)], ids=["same-name-again", "next-keep-1"])
def test_a_crash_after_any_step_leaves_a_complete_checkpoint(tmp_path, second, keep):
    crash_after = 0
    while True:
        parent = tmp_path / f"crash-{crash_after}"
        save(parent, "step-10", "old", keep)
        try:
            with Ops(crash_after):
                save(parent, second, "new", keep)
            finished = True
        except Crash:
            finished = False
        found = values(parent)
        assert found.get("step-10") == "old" or found.get(second) == "new", (crash_after, found)
        save(parent, "step-30", "next", keep)  # the next save mends what the crash left
        left = sorted(p.name for p in parent.iterdir())
        assert not [n for n in left if n.startswith(".")] and values(parent)["step-30"] == "next", (crash_after, left)
        if finished:
            break
        crash_after += 1
    assert crash_after >= 3  # the crash hit the swap, the aside's removal and the prune, not only the mark


def test_the_parts_then_the_mark_then_the_swap_then_the_prune(tmp_path):
    order = []

    def write(tmp: Path) -> None:
        order.append(("parts", tmp.name))
        (tmp / "a").write_text("x")

    def mark() -> bytes:
        order.append(("mark", sorted(p.name for p in tmp_path.iterdir())))
        return b"x"

    def prune() -> None:
        order.append(("prune", sorted(committed_directories(tmp_path, MARK))))

    commit_directory(tmp_path / "step-1", write, MARK, mark, prune)
    pid = os.getpid()
    assert order == [("parts", f".step-1.tmp-{pid}"), ("mark", [f".step-1.tmp-{pid}"]), ("prune", ["step-1"])]


def test_a_failed_write_leaves_the_old_checkpoint_and_prunes_nothing(tmp_path):
    save(tmp_path, "step-1", "old")
    pruned = []

    def broken(tmp: Path) -> None:
        (tmp / "a").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        commit_directory(tmp_path / "step-1", broken, MARK, lambda: b"new", lambda: pruned.append(1))
    assert values(tmp_path) == {"step-1": "old"} and not pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]


def test_a_failed_prune_is_a_warning_and_the_new_checkpoint_stands(tmp_path):
    def prune() -> None:
        raise PermissionError(13, "Permission denied")

    with pytest.warns(CheckpointWarning, match="is complete, but removing older checkpoints failed"):
        commit_directory(tmp_path / "step-1", parts("v"), MARK, lambda: b"v", prune)
    assert values(tmp_path) == {"step-1": "v"}


def test_only_marked_directories_count_and_an_aside_counts_for_its_name(tmp_path):
    (tmp_path / "step-1").mkdir()  # no mark: torn
    (tmp_path / ".step-2.tmp-7").mkdir()
    (tmp_path / ".step-2.tmp-7" / MARK).write_text("x")  # a temporary directory never counts, even marked
    aside = tmp_path / ".step-3.old-7"
    aside.mkdir()
    (aside / MARK).write_text("x")
    assert committed_directories(tmp_path, MARK) == {"step-3": aside}
    recover_directories(tmp_path, MARK)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1", "step-3"]
    assert committed_directories(tmp_path, MARK) == {"step-3": tmp_path / "step-3"}


def test_a_claim_left_by_a_dead_writer_is_taken_over_and_a_live_ones_is_not(tmp_path):
    """A survivor SIGKILLed mid-save leaves its claim: the next failure at the same step must still save (it said
    "saved by another survivor" and saved nothing: issue 50). The claim names its writer; on this host a writer
    that is gone is seen; another host's writer cannot be, and its claim holds."""
    import signal
    import socket

    from omnilearn.checkpoint import CheckpointStore
    from omnilearn.commit import claimed, stale, sweep_claims

    store = CheckpointStore(tmp_path / "ckpt")
    pid = os.fork()
    if pid == 0:  # a survivor killed between its .pt and its manifest, its claim held
        store.save_once(7, {"v": 1}, after_parts=lambda: os.kill(os.getpid(), signal.SIGKILL))
        os._exit(0)
    os.waitpid(pid, 0)
    claim = store.dir / ".step-000000007.claim"
    assert claim.exists() and stale(claim) and store.steps() == []
    assert store.save_once(7, {"v": 2}) is not None and store.load(7) == {"v": 2}  # saved, not "by another"
    assert not claim.exists() and not list(store.dir.glob("*.stale-*"))

    with claimed(claim) as mine:  # live: this process holds it
        assert mine and not stale(claim)
        with claimed(claim) as again:
            assert not again
    here = socket.gethostname()
    for text, live in [(f"{here} {pid} 1\n", False), (f"elsewhere.example {pid} 1\n", True), ("", True)]:
        claim.write_text(text)  # a dead pid here; the same elsewhere; an older version's empty claim
        assert stale(claim) is not live
        sweep_claims(store.dir)
        assert claim.exists() is live
        claim.unlink(missing_ok=True)
