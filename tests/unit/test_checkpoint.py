"""Checkpoint files (:mod:`omnilearn.checkpoint`) and the session's checkpoints in one process.

- The store keeps the newest K, writes atomically (a cut write is no
  checkpoint), verifies the checksum and falls back past a damaged newest
  one (checksum, cut short, missing) with a warning, setting it aside so it
  never costs a good one its place; files load with ``weights_only=True`` only.
- A value that would not load back (a numpy scalar, a ``Path``, an object)
  is refused at save time naming its field, nothing written; what the check
  accepts does load. A file that passes its checksum and does not load is an
  error naming the file and the field, never a fallback; all damaged is an
  error, never "no checkpoint".
- ``ol.save_checkpoint`` / ``ol.load_checkpoint``: a session resumed from a
  checkpoint goes on with the same weights (and the same loader generator
  draws) as one never stopped, returns False when there is nothing to load
  and raises when there are checkpoints and none is usable.
- The session is a ``Stateful``: ``torch.distributed.checkpoint`` saves and
  loads it beside the model.

Run: ``python -m pytest -q tests/unit/test_checkpoint.py``
"""

from __future__ import annotations

import collections
import io
import pathlib
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn import checkpoint
from omnilearn.checkpoint import CheckpointError, CheckpointStore, CheckpointWarning
from omnilearn.weightsonly import first_refused


def state(v: float) -> dict:
    return {"w": torch.full((3,), v), "step": int(v), "name": "x", "nested": {"l": [1, 2.5, None]}}


def test_save_keeps_the_newest_and_loads_back(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    for step in (5, 10, 15):
        store.save(step, state(step))
    assert store.steps() == [10, 15]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000010.json", "step-000000010.pt",
                                                          "step-000000015.json", "step-000000015.pt"]
    step, loaded = store.load_latest()
    assert step == 15 and torch.equal(loaded["w"], torch.full((3,), 15.0)) and loaded["nested"]["l"] == [1, 2.5, None]


def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep=3)
    store.save(1, state(1))
    store.save(2, state(2))
    data = bytearray(store.path(2).read_bytes())
    data[len(data) // 2] ^= 0xFF
    store.path(2).write_bytes(bytes(data))
    with pytest.warns(CheckpointWarning, match="step-000000002.pt is damaged: its checksum does not match"):
        step, loaded = store.load_latest()
    assert step == 1 and loaded["step"] == 1
    with pytest.raises(CheckpointError, match="damaged"):
        store.load(2)


def test_a_cut_write_is_not_a_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    store.save(1, state(1))
    store.path(2).write_bytes(b"half of a checkpoint")  # the .pt landed, its manifest never did
    assert store.steps() == [1]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.load_latest()[0] == 1


def test_the_next_save_sweeps_what_cut_writes_left(tmp_path):
    """A writer killed mid-save leaves a temp file, or a .pt without its manifest; the next save removes them
    (found by an operator trial: kill -9 rank 0 while it writes, then --resume)."""
    store = CheckpointStore(tmp_path)
    store.save(1, state(1))
    leftovers = [tmp_path / ".step-000000002.pt.4242.tmp", tmp_path / ".step-000000002.json.4242.tmp",
                 store.path(3)]  # killed while writing the .pt; while writing the manifest; between the two
    for p in leftovers:
        p.write_bytes(b"cut short")
    aside = tmp_path / "step-000000000.pt.damaged"  # set aside on purpose by a fallback: kept for the operator
    aside.write_bytes(b"damaged")
    store.save(4, state(4))
    assert not [p for p in leftovers if p.exists()]
    assert aside.exists() and store.steps() == [1, 4] and store.load_latest()[0] == 4


def test_commit_writes_the_parts_then_the_mark_then_prunes(tmp_path):
    """The one save sequence: a failing part leaves no mark and prunes nothing; the mark lands whole (atomic)."""
    order = []
    mark = tmp_path / "mark.json"
    checkpoint.commit(mark, lambda: order.append("parts"), lambda: order.append("mark") or b"{}",
                      lambda: order.append("prune" if mark.read_bytes() == b"{}" else "prune before the mark"))
    assert order == ["parts", "mark", "prune"] and [p.name for p in tmp_path.iterdir()] == ["mark.json"]

    def broken():
        raise OSError("disk gone")

    order.clear()
    with pytest.raises(OSError, match="disk gone"):
        checkpoint.commit(tmp_path / "other.json", broken, lambda: b"{}", lambda: order.append("prune"))
    assert order == [] and not (tmp_path / "other.json").exists()


def test_a_failed_prune_leaves_the_new_checkpoint_complete_with_a_warning(tmp_path, monkeypatch):
    """Rotation comes after the mark: a prune that fails (a read-only old file) must not make a complete
    checkpoint look unwritten (the session's save would raise 'was not written' on every rank)."""
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, state(1))

    def read_only():
        raise PermissionError("read-only")

    monkeypatch.setattr(store, "prune", read_only)
    with pytest.warns(CheckpointWarning, match="step-000000002.json is complete, but removing older checkpoints"):
        assert store.save(2, state(2)) == store.path(2)
    assert store.steps() == [1, 2] and store.load_latest()[0] == 2


def test_companion_shard_directories_are_pruned_with_their_checkpoint_and_swept_when_cut(tmp_path):
    """A sharded model's step-<n>.dcp (every rank's shards, written before the mark) goes with its checkpoint."""
    store = CheckpointStore(tmp_path, keep=1)
    (tmp_path / "step-000000009.pt.damaged").write_bytes(b"set aside")
    for step in (1, 2, 3, 4):
        (tmp_path / f"step-{step:09d}.dcp").mkdir()
        (tmp_path / f"step-{step:09d}.dcp" / "__0_0.distcp").write_bytes(b"shard")
        if step != 3:  # step 3's save was cut after its shards: no mark
            store.save(step, state(step))
        if step == 2:
            assert sorted(p.name for p in tmp_path.glob("*.dcp")) == ["step-000000002.dcp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000004.dcp", "step-000000004.json",
                                                          "step-000000004.pt", "step-000000009.pt.damaged"]


def test_nothing_to_load(tmp_path):
    assert CheckpointStore(tmp_path / "none").load_latest() is None


def write_unchecked(monkeypatch, store: CheckpointStore, step: int, state: dict) -> None:
    """A checksummed checkpoint written without the save check (as an older version or another program did)."""
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "first_refused", lambda state: None)
        store.save(step, state)


def files(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("extra, field", [
    ({"best": np.float64(0.9)}, "extra['best']: numpy.float64"),
    ({"dir": pathlib.Path("runs")}, "extra['dir']: pathlib.PosixPath"),
    ({"hist": [1, (2, np.int64(3))]}, "extra['hist'][1][1]: numpy.int64"),
    ({"seen": frozenset({1})}, "extra['seen']: frozenset"),
    ({np.int32(1): "a"}, "key np.int32(1) of extra: numpy.int32"),
])
def test_save_refuses_a_value_that_would_not_load_back(tmp_path, extra, field):
    store = CheckpointStore(tmp_path, keep=1)
    store.save(1, state(1))
    before = files(tmp_path)
    with pytest.raises(CheckpointError) as e:
        store.save(2, {**state(2), "extra": extra})
    message = str(e.value)
    assert field in message and "add_safe_globals" in message and "\n" not in message, message
    assert files(tmp_path) == before  # nothing written, nothing pruned
    assert store.load_latest()[0] == 1


def test_what_the_save_check_accepts_loads_with_weights_only_and_what_it_refuses_does_not(tmp_path):
    accepted = {"none": None, "flags": [True, 3, 2**80, 1.5, 1 + 2j, "s", b"b", bytearray(b"a")],
                "torch": [torch.zeros(2), nn.Parameter(torch.ones(1)), torch.float16, torch.device("cpu"),
                          torch.strided, torch.Size([2, 3])],
                "containers": (collections.OrderedDict(a=1), collections.Counter({2: 1}), {1, 2}, (1,), [])}
    assert first_refused(accepted) is None
    buffer = io.BytesIO()
    torch.save(accepted, buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["torch"][5] == torch.Size([2, 3])
    for value in (np.float64(1), np.zeros(2), pathlib.Path("x"), frozenset(), range(2), CheckpointStore(tmp_path)):
        assert first_refused({"v": value}) is not None
        buffer = io.BytesIO()
        torch.save({"v": value}, buffer)
        with pytest.raises(Exception):
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)


@pytest.mark.parametrize("value, field, global_name", [
    (np.float64(0.5), "extra['best']", "numpy._core.multiarray.scalar"),
    (CheckpointStore("x"), "extra['best']", "omnilearn.checkpoint.CheckpointStore"),  # code is never run
    ([1, {"deep": pathlib.Path("p")}], "extra['best'][1]['deep']", "pathlib.PosixPath"),
])
def test_a_checksummed_file_that_does_not_load_is_an_error_naming_the_file_and_the_field(tmp_path, monkeypatch, value,
                                                                                           field, global_name):
    store = CheckpointStore(tmp_path)
    store.save(1, state(1))
    write_unchecked(monkeypatch, store, 2, {**state(2), "extra": {"best": value}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to step 1
        with pytest.raises(CheckpointError) as e:
            store.load_latest()
    message = str(e.value)
    assert "step-000000002.pt passed its checksum" in message and f"{field} holds a {global_name}" in message
    assert "\n" not in message
    assert store.steps() == [1, 2]  # both kept: the refused one is not damaged, and not set aside


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_a_damaged_write_falls_back_and_is_set_aside(tmp_path, damage):
    store = CheckpointStore(tmp_path)
    store.save(1, state(1))
    store.save(2, state(2))
    data = store.path(2).read_bytes()
    if damage == "truncate":
        store.path(2).write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        store.path(2).write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        store.path(2).unlink()
    with pytest.warns(CheckpointWarning, match=r"step-000000002.pt is damaged: .*set aside as step-000000002.pt."):
        assert store.load_latest()[0] == 1
    assert store.steps() == [1]
    assert (tmp_path / "step-000000002.json.damaged").is_file()


def test_every_checkpoint_damaged_is_an_error_not_a_missing_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path)
    for step in (1, 2):
        store.save(step, state(step))
        store.path(step).write_bytes(b"garbage")
    for _ in range(2):  # nothing is moved: the next try fails the same way, never finds "no checkpoint"
        with pytest.raises(CheckpointError, match=f"no usable checkpoint in {tmp_path}: all 2 are damaged"):
            store.load_latest()
    assert store.steps() == [1, 2]


def test_a_fallback_never_prunes_a_good_checkpoint(tmp_path):
    store = CheckpointStore(tmp_path, keep=2)
    store.save(10, state(10))
    store.save(20, state(20))
    store.path(20).write_bytes(b"cut")
    with pytest.warns(CheckpointWarning):
        assert store.load_latest()[0] == 10
    store.save(15, state(15))  # the resumed run checkpoints more often: the damaged 20 must not count among 2
    assert store.steps() == [10, 15] and store.load(10)["step"] == 10


def test_loading_decodes_in_place(tmp_path):
    """The verified bytes are deserialised without another copy of the file (``io.BytesIO`` would make one)."""
    import tracemalloc

    store = CheckpointStore(tmp_path)
    store.save(1, {"w": torch.randn(2**18)})
    data = store.read(1)
    tracemalloc.start()
    try:
        loaded = store.decode(data, store.path(1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert loaded["w"].numel() == 2**18 and peak < len(data) // 4, (peak, len(data))


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(96, 5, generator=g), torch.randint(3, (96,), generator=g)

    def __len__(self) -> int:
        return 96

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def make(**kw):
    ol = omnilearn.setup(global_batch=16, control_interval=3, device="cpu", **kw)
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.2), nn.Linear(8, 3)))
    loader = ol.data_loader(Data())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    return ol, model, loader, opt, sched


def run(ol, model, loader, opt, sched, epochs: int, stop_after: int | None = None, ckpt=None,
        draws: dict | None = None) -> None:
    """Train; ``draws``: per epoch, the loader generator's state once the epoch's iterator has drawn from it."""
    done = 0
    for epoch in range(ol.epoch, epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            if draws is not None:
                draws.setdefault(epoch, loader.loader.generator.get_state())
            opt.zero_grad()
            ol.backward(F.cross_entropy(model(x), y))
            opt.step()
            sched.step()
            ol.step()
            done += 1
            if done == stop_after:
                ol.save_checkpoint(ckpt, model=model, optimizer=opt, scheduler=sched, extra={"note": "mid"})
                return


def test_session_checkpoint_resumes_exactly(tmp_path):
    whole = make()
    run(*whole, epochs=3)
    first = make()
    assert not first[0].load_checkpoint(tmp_path, model=first[1], optimizer=first[3], scheduler=first[4])
    run(*first, epochs=3, stop_after=8, ckpt=tmp_path)  # mid-epoch (6 steps per epoch), mid-interval
    again = make()
    assert again[0].load_checkpoint(tmp_path, model=again[1], optimizer=again[3], scheduler=again[4])
    assert again[0].checkpoint_extra == {"note": "mid"} and again[0].next_step == 8 and again[0].epoch == 1
    run(*again, epochs=3)
    for a, b in zip(whole[1].state_dict().values(), again[1].state_dict().values()):
        assert torch.equal(a, b)
    assert whole[3].state_dict()["state"][0]["momentum_buffer"].equal(again[3].state_dict()["state"][0]["momentum_buffer"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: what DCP assumes
def test_session_is_stateful_for_dcp(tmp_path):
    import torch.distributed.checkpoint as dcp

    ol, model, loader, opt, sched = make()
    run(ol, model, loader, opt, sched, epochs=1)
    dcp.save({"session": ol, "model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
    other = make()
    target = {"session": other[0], "model": other[1].state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
    other[1].load_state_dict(target["model"])
    assert other[0].next_step == ol.next_step == 6 and other[0].epoch == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other[1].state_dict().values()))


def test_resumed_loader_generator_draws_what_the_uninterrupted_one_draws(tmp_path):
    """The DataLoader draws one number per iterator (its workers' seeds); resumed mid-epoch, the rest of the
    epoch and the epochs after draw the uninterrupted run's numbers, not one ahead and not from the start."""
    whole, resumed = {}, {}
    run(*make(), epochs=3, draws=whole)
    run(*make(), epochs=3, stop_after=8, ckpt=tmp_path)  # mid epoch 1 (6 steps per epoch)
    again = make()
    assert again[0].load_checkpoint(tmp_path, model=again[1], optimizer=again[3], scheduler=again[4])
    run(*again, epochs=3, draws=resumed)
    assert sorted(resumed) == [1, 2] and all(torch.equal(resumed[e], whole[e]) for e in (1, 2))


class Seeds(torch.utils.data.Dataset):
    """Each item is the seed of the loader worker that made it (DataLoader seeds it from its generator)."""

    def __len__(self) -> int:
        return 128

    def __getitem__(self, i):
        return torch.tensor(float(torch.initial_seed() % 2**20)), torch.tensor(0)


def test_resumed_persistent_loader_workers_get_the_uninterrupted_seed(tmp_path):
    def seeds(stop_after=None, resume=False) -> set[float]:
        ol = omnilearn.setup(global_batch=16, control_interval=5, device="cpu")
        model = ol.wrap_model(nn.Linear(1, 2))
        loader = ol.data_loader(Seeds(), num_workers=1)  # persistent: one iterator, seeded once for the run
        if resume:
            assert ol.load_checkpoint(tmp_path, model=model)
        seen = set()
        for epoch in range(ol.epoch, 2):
            loader.set_epoch(epoch)
            for x, _ in loader:
                seen |= set(x.tolist())
                ol.step()
                if ol.next_step == stop_after:
                    ol.save_checkpoint(tmp_path, model=model)
                    ol.release()  # the stopped run lets its loader workers go, as its process would at exit
                    return seen
        ol.release()
        return seen

    whole = seeds()
    seeds(stop_after=11)  # mid epoch 1 (8 steps per epoch)
    assert len(whole) == 1 and seeds(resume=True) == whole


def test_session_save_refuses_what_would_not_load_and_keeps_the_checkpoints(tmp_path):
    class Warmup:  # a schedule object: LambdaLR saves its __dict__
        def __init__(self) -> None:
            self.peak = np.float64(1.0)

        def __call__(self, step: int) -> float:
            return float(self.peak)

    ol, model, loader, opt, sched = make()
    run(ol, model, loader, opt, sched, epochs=1, stop_after=3, ckpt=tmp_path)
    before = files(tmp_path)
    with pytest.raises(CheckpointError, match=r"extra\['best'\]: numpy.float64 would not load back"):
        ol.save_checkpoint(tmp_path, model=model, extra={"best": np.float64(0.5)})
    warm = torch.optim.lr_scheduler.LambdaLR(opt, Warmup())
    with pytest.raises(CheckpointError, match=r"scheduler\['lr_lambdas'\]\[0\]\['peak'\]: numpy.float64"):
        ol.save_checkpoint(tmp_path, model=model, optimizer=opt, scheduler=warm)
    assert files(tmp_path) == before


def test_session_load_raises_when_checkpoints_exist_and_none_is_usable(tmp_path):
    ol, model, loader, opt, sched = make()
    run(ol, model, loader, opt, sched, epochs=1, stop_after=3, ckpt=tmp_path)
    CheckpointStore(tmp_path).path(3).write_bytes(b"cut short")
    again = make()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        again[0].load_checkpoint(tmp_path, model=again[1])
    assert again[0].next_step == 0


def test_release_ends_the_loader_workers_cleanly_mid_epoch():
    """A loop left early: release() asks the persistent workers to stop (exit 0), where the garbage collector
    used to close their queues first, wait 5 s per worker and then terminate them (exit -15)."""
    ol = omnilearn.setup(global_batch=16, control_interval=5, device="cpu")
    ol.wrap_model(nn.Linear(1, 2))
    loader = ol.data_loader(Seeds(), num_workers=1)
    batches = iter(loader)
    next(batches)
    ol.step()
    workers = list(loader.loader._iterator._workers)
    ol.release()
    assert loader.loader._iterator is None and [w.exitcode for w in workers] == [0]
    ol.release()  # idempotent


@pytest.mark.parametrize("again", [True, False], ids=["same-step-again", "next-step"])
def test_a_crash_after_any_filesystem_step_of_a_save_leaves_the_old_or_the_new_checkpoint(tmp_path, again):
    """Generated from the sequence: each ``os.replace``, ``os.unlink`` and ``shutil.rmtree`` a save makes is, in
    turn, where the process dies (tests/crashes.py). The same step saved again (an epoch-end save, then a stop
    save) included: its new ``.pt`` replaced the old one under the old manifest, and a crash there left neither
    (issue 50). Whatever the crash, the newest intact checkpoint is the old or the new one, no fallback over a
    damaged one, and the next save leaves only complete checkpoints behind."""
    from crashes import Crash, Ops

    crash_after, step = 0, 10 if again else 20
    while True:
        store = CheckpointStore(tmp_path / f"crash-{crash_after}", keep=1)
        store.save(10, {"v": torch.tensor(1.0)})
        try:
            with Ops(crash_after):
                store.save(step, {"v": torch.tensor(2.0)})
            finished = True
        except Crash:
            finished = False
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a damaged checkpoint set aside would warn
            found, state = store.load_latest()
        assert (found, float(state["v"])) in ((10, 1.0), (step, 2.0)), (crash_after, found, float(state["v"]))
        store.save(30, {"v": torch.tensor(3.0)})
        left = sorted(p.name for p in store.dir.iterdir())
        assert left == ["step-000000030.json", "step-000000030.pt"], (crash_after, left)
        if finished:
            break
        crash_after += 1
    assert crash_after >= 3  # the .pt, the manifest and the prune (the old generation or the older step) each hit


def test_an_ordinary_save_waits_for_a_survivors_save_of_the_same_step(tmp_path):
    """Rank 0's ordinary save of step 5 while a survivor writes step 5 (its claim held): the two writes would
    interleave (a manifest of one over the data of the other); the ordinary save waits for the claim."""
    import threading

    from omnilearn.commit import claimed

    store = CheckpointStore(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    done = []
    with claimed(tmp_path / ".step-000000005.claim") as mine:  # the survivor, mid-save
        assert mine
        writer = threading.Thread(target=lambda: done.append(store.save(5, {"v": torch.tensor(2.0)})))
        writer.start()
        writer.join(0.5)  # time for a save that did not wait (a wait, not a deadline)
        assert not done and store.steps() == []
    writer.join()
    assert done and store.steps() == [5] and float(store.load(5)["v"]) == 2.0
