"""Per-worker memory caps, micro-batches within them and out-of-memory recovery, in one process.

- ``max_batch`` in every accepted form (int, ``"256"``, ``"256,64,64,64"``,
  a list, ``"auto"``) and the one-line errors (count, below ``min_batch``,
  sum below the global batch, malformed); ``config.toml`` round-trips a
  per-worker list; ``--mode asp`` keeps one cap.
- Pure parts: split sizes (hypothesis: sum kept, every part within the cap,
  as few parts as possible), cutting a collated batch, the CUDA probe's
  arithmetic, the fault spec.
- The CUDA probe over several steps with a fake allocator: the first step's
  one-off allocations give a low cap, a later step raises it (best of the
  probes), an out-of-memory limit stays a ceiling.
- :class:`~omnilearn.bsp.memory.ReducerResets` on a stand-in for DDP: a
  reset only after an announced syncing forward, pending only when DDP had
  rebuilt its buckets, again after every step until a meeting, where every
  rank resets.
- A token-count step whose counts are all zero gets a zero gradient, not NaN.
- A session with an emulated cap (``OMNILEARN_FAULT_OOM``): ``run_step``
  lowers the cap, redoes the step and ends with the weights of a run without
  the error (with and without accumulation); one sample that does not fit is
  a clear error.

Run: ``python -m pytest -q tests/unit/test_memory.py``
"""

from __future__ import annotations

import tomllib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn

import omnilearn
from omnilearn.bsp.memory import (FAULT_OOM_ENV, CudaProbe, Failure, MemoryCap, ReducerResets, cap_from_memory,
                                  fault_oom_samples, lowered_cap, rank_cap, split_batch, split_sizes)
from omnilearn.config import BalanceConfig, ConfigError, dump_toml
from omnilearn.experiments.config import TrainConfig, normalise_keys
from tokendata import PairData


@pytest.mark.parametrize("value, parsed", [(64, 64), ("64", 64), ("256,64,64,64", (256, 64, 64, 64)),
                                           ([256, 64, 64, 64], (256, 64, 64, 64)), (" 256, 64,64 ,64", (256, 64, 64, 64)),
                                           ("auto", "auto"), ("AUTO", "auto"), (None, None)])
def test_max_batch_forms(value, parsed):
    cfg = BalanceConfig(workers=4, global_batch=256, max_batch=value)
    assert cfg.max_batch == parsed
    assert cfg.batch_caps == (None if parsed == "auto" else parsed)
    assert [rank_cap(cfg.max_batch, r) for r in range(4)] == (
        list(parsed) if isinstance(parsed, tuple) else [parsed if isinstance(parsed, int) else None] * 4)


@pytest.mark.parametrize("value, message", [
    ("256,64,64", "gives 3 caps for 4 workers; give one number or one per worker"),
    ([256, 4, 64, 64], "worker 1's cap 4 is below --min-batch 8"),
    ([64, 64, 64, 32], "larger than the sum of the per-worker max batches, 224"),
    ("256,x", "must be one number, one per worker separated by commas"),
    ([64.5, 64, 64, 64], "must be one number"), (True, "must be one number"), ("0", "must be positive")])
def test_max_batch_errors_name_the_value_and_the_fix(value, message):
    with pytest.raises(ConfigError, match=message) as e:
        BalanceConfig(workers=4, global_batch=256, max_batch=value, min_batch=8)
    assert "\n" not in str(e.value)


def test_per_worker_caps_round_trip_through_config_toml(tmp_path):
    cfg = TrainConfig(workers=4, global_batch=256, max_batch="256,64,64,64")
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(cfg))
    values = normalise_keys(tomllib.loads(path.read_text())["train"], str(path))
    assert values["max_batch"] == [256, 64, 64, 64] and TrainConfig(**values) == cfg


def test_asp_keeps_one_cap():
    assert TrainConfig(mode="asp", global_batch=128, max_batch=[64] * 4).max_batch == 64
    with pytest.raises(ConfigError, match="--mode asp keeps one cap for every worker"):
        TrainConfig(mode="asp", global_batch=128, max_batch=[64, 32, 64, 64])
    with pytest.raises(ConfigError, match="--max-batch auto .* is for --mode bsp"):
        TrainConfig(mode="asp", global_batch=128, max_batch="auto")


@given(st.lists(st.integers(1, 300), min_size=1, max_size=6), st.integers(1, 100))
def test_split_sizes_keep_the_sum_within_the_cap_in_fewest_parts(sizes, cap):
    parts = split_sizes(sizes, cap)
    assert sum(parts) == sum(sizes) and max(parts) <= cap and min(parts) >= 1
    assert len(parts) == sum(-(-m // cap) for m in sizes)
    assert split_sizes(sizes, None) == tuple(sizes) == split_sizes(sizes, max(sizes))


def test_split_batch_cuts_tensors_along_the_batch():
    x, y = torch.arange(10.0).reshape(5, 2), torch.arange(5)
    parts = split_batch({"x": x, "pair": (y, "tag"), "scale": torch.tensor(2.0)}, (3, 2))
    assert [p["x"].shape[0] for p in parts] == [3, 2] and parts[1]["pair"][0].tolist() == [3, 4]
    assert parts[0]["pair"][1] == "tag" and float(parts[1]["scale"]) == 2.0
    assert split_batch([x, y], (5,))[0][0] is x
    with pytest.raises(ValueError, match="holds no tensor of 5 rows"):
        split_batch(["a"] * 5, (3, 2))


def test_probe_arithmetic_and_cap_lowering():
    # 10 samples peaked 1000 bytes above 500; 10_000 bytes with a 10% margin: (9000 - 500) / 100 = 85 samples
    assert cap_from_memory(10, 500, 1500, 10_000, margin=0.1) == 85
    assert cap_from_memory(10, 500, 1500, 100, margin=0.1) == 1
    assert lowered_cap(33) == 16
    with pytest.raises(ValueError):
        lowered_cap(1)


def test_fault_spec():
    assert fault_oom_samples(1, "0:64, 1:20") == 20 and fault_oom_samples(2, "0:64,1:20") is None
    assert fault_oom_samples(0, "") is None
    with pytest.raises(ValueError, match="expected <rank>:<samples>"):
        fault_oom_samples(0, "zero")


class FakeAllocator:
    """Scripted allocator statistics, one (allocated at the start, peak) pair per step; 100_000 bytes of device."""

    def __init__(self, steps: list[tuple[int, int]]) -> None:
        self.steps = steps

    def start(self) -> int:
        return self.steps[0][0]

    def peak(self) -> int:
        return self.steps.pop(0)[1]

    def capacity(self) -> int:
        return 100_000


def test_the_cuda_probe_recovers_from_the_first_steps_one_off_allocations():
    # 1000 bytes of weights; the first step adds their gradients (1000) and the optimizer state (2000) once;
    # activations take 10 bytes a sample. 85% of 100_000 may be used.
    steps = [(1000, 1000 + 3000 + 320), (4000, 4000 + 320), (4000, 4000 + 400)]
    probe, memory = CudaProbe(torch.device("cpu"), source=FakeAllocator(steps)), MemoryCap(None, accumulation_steps=2)
    caps = []
    for _ in range(3):
        assert not probe.done
        probe.begin()
        caps.append(probe.end(32))
        memory.probe(caps[-1])
    assert probe.done and caps == [(85_000 - 1000) * 32 // 3320, (85_000 - 4000) // 10, (85_000 - 4000) * 32 // 400]
    assert memory.cap == 8100 and memory.reported() == 2 * 8100  # the best: the first step's 809 rose
    memory.learn(lowered_cap(6000))  # an out-of-memory error is a ceiling no probe lifts
    memory.probe(9000)
    assert memory.cap == 3000 and memory.reported() == 6000
    with pytest.raises(ValueError, match="probe at least 1 step"):
        CudaProbe(torch.device("cpu"), steps=0)


class StandInDDP(nn.Linear):
    """What :class:`ReducerResets` reads of DDP: ``reducer._reset_state``, ``require_backward_grad_sync``,
    ``_has_rebuilt_buckets`` (DDP's mirror of its reducer's flag)."""

    def __init__(self) -> None:
        super().__init__(2, 1)
        self.reducer = self
        self.require_backward_grad_sync, self._has_rebuilt_buckets, self.resets = True, True, 0

    def _reset_state(self) -> None:
        self.resets += 1


def test_a_reset_pending_after_the_meeting_started_waits_for_the_next_meeting():
    """A meeting is read a step after it starts: a lone reset of that step was not in its rows, so every rank
    cannot have reset with it; it stays pending and the next meeting carries it."""
    failed = Failure(8, "forward", True, "")
    ddp, resets = StandInDDP(), ReducerResets()
    resets.watch(ddp, follow=True)
    assert resets.report() is False  # the meeting starts: nothing pending
    ddp(torch.ones(1, 2))  # the next step's syncing forward, then an out-of-memory error
    resets.after(failed)
    assert resets.pending and ddp.resets == 1
    resets.met(False)  # the meeting is read: no rank had a reset when it started
    assert resets.pending and ddp.resets == 1
    assert resets.report() is True  # the next meeting carries it
    resets.met(True)
    assert not resets.pending and ddp.resets == 2


def test_reducer_resets_keep_ddps_bucket_rebuild_collective():
    failed = Failure(8, "forward", True, "")
    ddp, peer, resets, peers = StandInDDP(), StandInDDP(), ReducerResets(), ReducerResets()
    peers.watch(peer)  # a meeting's reader: knows the model, follows no forward (a hook costs every forward)
    assert not peer._forward_hooks
    resets.watch(ddp, follow=True), resets.watch(ddp, follow=True), peers.watch(peer, follow=True)
    assert len(ddp._forward_hooks) == len(peer._forward_hooks) == 1  # run_step's: the hook once per model
    resets.begin()
    resets.after(failed)  # nothing announced: the error came before (or inside) DDP's forward
    assert ddp.resets == 0 and not resets.pending and ddp._has_rebuilt_buckets
    ddp.require_backward_grad_sync = False
    ddp(torch.ones(1, 2))  # a micro-batch that does not sync announces nothing
    resets.after(failed)
    assert ddp.resets == 0
    ddp.require_backward_grad_sync = True
    ddp(torch.ones(1, 2))  # the syncing forward announced its backward; the loss fails after it
    resets.after(failed)
    assert ddp.resets == 1 and resets.pending and not ddp._has_rebuilt_buckets
    resets.step_done(), peers.step_done()  # after every step's backward until the meeting: this rank alone
    resets.step_done()
    assert (ddp.resets, peer.resets) == (3, 0)
    flags = [resets.report(), peers.report()]  # the meeting's rows (read a step later)
    resets.met(any(flags)), peers.met(any(flags))
    assert (ddp.resets, peer.resets) == (4, 1) and not resets.pending and not peer._has_rebuilt_buckets
    ddp(torch.ones(1, 2))  # between the collective reset and the rebuild: a reset, but every rank still rebuilds
    resets.after(failed)
    resets.step_done()
    assert ddp.resets == 5 and not resets.pending
    with torch.no_grad():
        ddp(torch.ones(1, 2))  # evaluation announces nothing
    resets.after(failed)
    assert ddp.resets == 5
    alone = ReducerResets()
    alone.watch(nn.Linear(2, 1))  # one process, no DDP: nothing to do
    alone.met(True)
    assert alone.model is None


def test_token_counts_all_zero_give_a_zero_gradient():
    ol = omnilearn.setup(global_batch=8, device="cpu", accumulation_steps=2)
    model = ol.wrap_model(nn.Linear(6, 3))
    for micro in next(iter(ol.data_loader(PairData(16)))):
        ol.backward(F.cross_entropy(model(micro[0]), micro[1]) * 0.0, count=0)  # finite loss over no token
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())  # was 0 x (c / 0) = NaN
    assert float(ol.micro.hook.weight) == 2.0  # c / max(N, 1) with c = k x max(n_0, 1) = 2


def train(accumulation_steps: int = 1) -> tuple[list[torch.Tensor], omnilearn.Session]:
    ol = omnilearn.setup(global_batch=32, control_interval=4, device="cpu", accumulation_steps=accumulation_steps)
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in ol.data_loader(PairData(192)):
        opt.zero_grad()
        ol.run_step(lambda b: F.cross_entropy(model(b[0]), b[1]), batch)
        opt.step()
        ol.step()
    ol.finish()
    return [p.detach().clone() for p in model.parameters()], ol


@pytest.mark.parametrize("k", [1, 2])
def test_emulated_out_of_memory_lowers_the_cap_and_learns_the_same(monkeypatch, capsys, k):
    expected, _ = train(k)
    monkeypatch.setenv(FAULT_OOM_ENV, "0:7")
    got, ol = train(k)
    assert max(float((a - b).abs().max()) for a, b in zip(got, expected)) < 1e-6
    assert ol.max_batch == 4 and ol.micro.sizes == (4,) * 8  # 32 -> 16 -> 8 -> 4 (<= 7)
    err = capsys.readouterr().err
    assert "rank 0, step 0: out of memory in the forward of a micro-batch of 8 samples; cap 8 -> 4" in err


def test_a_sample_that_does_not_fit_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(FAULT_OOM_ENV, "0:0")
    with pytest.raises(RuntimeError, match="out of memory on a micro-batch of 1 samples .*one sample does not fit"):
        train()


def test_micro_batches_follow_the_cap_and_need_a_fresh_step():
    ol = omnilearn.setup(global_batch=12, device="cpu", min_batch=4)
    model = ol.wrap_model(nn.Linear(6, 3))
    batch = next(iter(ol.data_loader(PairData(192))))
    assert ol.micro_batches(batch) == [batch] and ol.micro.sizes == (12,)
    ol.memory.learn(5)  # as after an out-of-memory error
    parts = ol.micro_batches(batch)
    assert [len(x) for x, _ in parts] == [4, 4, 4] and ol.micro.sizes == (4, 4, 4) and ol.max_batch == 5
    ol.backward(F.cross_entropy(model(parts[0][0]), parts[0][1]))
    with pytest.raises(RuntimeError, match="before its first backward"):
        ol.micro_batches(batch)
