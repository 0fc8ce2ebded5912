"""CUDA checks, skipped without a GPU (NCCL across ranks needs two).

- :class:`~omnilearn.clocks.step.StepTimer` on CUDA: events give positive compute
  and wait times, and nothing synchronises the device per step (only
  ``collect()`` waits, on one event).
- A session on a 1-GPU NCCL group (the user's own group) trains with the
  weighting hook, gradient accumulation and token counts kept on the device;
  GPU memory and the session's rows stay bounded over the run; the result
  equals one process without OmniLearn.
- Two GPUs (NCCL, heterogeneous emulated speeds, accumulation): every rank
  ends with the same weights, equal to one process training alone.
- Memory (:mod:`omnilearn.bsp.memory`): ``max_batch="auto"`` measures the
  first steps and caps the rank at the best estimate (more than a step's
  batch on a big GPU);
  ``memory="auto"`` counts the first step's CUDA tensors against the device's total memory;
  a real CUDA out-of-memory error in the forward (an impossible allocation
  above 16 samples) halves the cap and redoes the step: the weights equal a
  run without it, and the allocator's memory is given back.
- FSDP2 (``fully_shard``) on one GPU: trained without a host sync per step
  (its stalls are compute-stream events), equal to one process; on two
  GPUs, heterogeneous: equal to one process, batches moved to the fast one.
- A crash costs one step on NCCL (two GPUs): rank 1 SIGKILLed after step 6
  under ``torchrun --max-restarts 1`` (tests/faults/rescue_script.py on
  CUDA): rank 0 sees NCCL's remote error (not the timeout, 120 s here),
  saves step 7, and the restart ends with the uninterrupted run's weights.

Run: ``python -m pytest -q tests/gpu`` (on a CUDA machine).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.data.plan import GlobalPlan
from tokendata import PAD, TokenData
from omnilearn.clocks.step import StepTimer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 1,
                                reason="needs a CUDA GPU")


def token_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(32, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 32))


def token_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=PAD)


def reference(device: torch.device, steps: int, global_batch: int) -> dict[str, torch.Tensor]:
    data, model = TokenData(512, 16, 32), token_model().to(device)
    plan, opt = GlobalPlan(len(data), global_batch, seed=0), torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        idx = plan.step_indices(step)
        opt.zero_grad()
        token_loss(model, data.x[idx].to(device), data.y[idx].to(device)).backward()
        opt.step()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def train(ol, model, loader, steps: int, memory: list[int] | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    while ol.steps_done < steps:
        for micro_batches in loader:
            opt.zero_grad()
            for x, y in micro_batches:
                x, y = x.to(ol.device, non_blocking=True), y.to(ol.device, non_blocking=True)
                ol.backward(token_loss(model, x, y), count=(y != PAD).sum())  # a device tensor: no host sync
            opt.step()
            ol.step()
            assert ol.ledger.window_size() < ol.cfg.control_interval  # rows kept: this interval's only
            if memory is not None:
                memory.append(torch.cuda.memory_allocated(ol.device))
            if ol.steps_done == steps:
                break


def close(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).norm() / b[k].float().norm()) for k in b)


def test_step_timer_uses_events_and_never_syncs_per_step(monkeypatch):
    device = torch.device("cuda", 0)
    a = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize(device)
    syncs: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kw: syncs.append("device"))
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: syncs.append("stream"))
    timer = StepTimer(device)
    for _ in range(5):
        timer.begin()
        b = a @ a  # the step's compute
        timer.mark_ready()
        b = b @ a  # stands for the reduction the compute stream waits for
        timer.mark_reduced(last=True)
        timer.end()
    assert syncs == []  # nothing waited for the device during the steps
    times = timer.collect()  # one wait, on the last step's end event
    assert len(times) == 5
    for t in times:
        assert t.compute_s > 0 and t.wait_s > 0 and t.step_s >= t.compute_s
        assert t.step_s == pytest.approx(t.compute_s + t.wait_s)


def test_session_on_a_one_gpu_nccl_group_trains_exactly_in_bounded_memory(tmp_path):
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ol = omnilearn.setup(global_batch=64, control_interval=4, accumulation_steps=2, device="cuda")
        assert ol.device.type == "cuda" and ol.ctx.backend == "nccl"
        model = ol.wrap_model(token_model())
        loader = ol.data_loader(TokenData(512, 16, 32))
        memory: list[int] = []
        train(ol, model, loader, 40, memory)
        assert max(memory[8:]) <= memory[8] + (1 << 20)  # no growth after warm-up (1 MiB slack)
        summary = ol.finish()
        assert summary["steps"] == 40
        got = {k: v.detach().cpu() for k, v in ol.module.state_dict().items()}
        assert close(got, reference(ol.device, 40, 64)) < 1e-4
    finally:
        dist.destroy_process_group()


def _two_gpu_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    ol = omnilearn.setup(global_batch=64, speeds="3,1", control_interval=4, accumulation_steps=2, min_batch=8,
                         device="cuda")
    model = ol.wrap_model(token_model())
    train(ol, model, ol.data_loader(TokenData(512, 16, 32)), 24)
    ol.finish()
    torch.save({k: v.detach().cpu() for k, v in ol.module.state_dict().items()}, f"{out}/rank{rank}.pt")
    ol.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across ranks needs 2 GPUs")
def test_two_gpus_heterogeneous_accumulating_equal_one_process(tmp_path):
    mp.start_processes(_two_gpu_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="spawn")
    a, b = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert close(a, b) == 0.0
    assert close(a, reference(torch.device("cuda", 0), 24, 64)) < 1e-4


def test_checkpoint_on_nccl_resumes_the_same_weights(tmp_path):
    """Save on a one-GPU NCCL group (rank parts gathered and the file broadcast as CUDA byte tensors), resume."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ol = omnilearn.setup(global_batch=64, control_interval=4, accumulation_steps=2, device="cuda")
        model = ol.wrap_model(token_model())
        loader = ol.data_loader(TokenData(512, 16, 32))
        train(ol, model, loader, 8)
        path = ol.save_checkpoint(tmp_path / "ckpt", model=model)
        assert path is not None and path.exists()
        saved = {k: v.detach().cpu().clone() for k, v in ol.module.state_dict().items()}
        train(ol, model, loader, 12)  # move on, then come back
        assert ol.load_checkpoint(tmp_path / "ckpt", model=model)
        assert ol.next_step == 8 and ol.module.state_dict()["0.weight"].device.type == "cuda"
        assert close({k: v.detach().cpu() for k, v in ol.module.state_dict().items()}, saved) == 0
    finally:
        dist.destroy_process_group()


def _memory_run(fn_cap: int | None, **settings) -> tuple[dict, omnilearn.Session]:
    ol = omnilearn.setup(global_batch=64, control_interval=4, device="cuda", **settings)
    model = ol.wrap_model(token_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss(batch):
        x, y = (t.to(ol.device, non_blocking=True) for t in batch)
        if fn_cap is not None and len(x) > fn_cap:
            torch.empty(1 << 50, dtype=torch.uint8, device=ol.device)  # a real CUDA out-of-memory error
        return token_loss(model, x, y), (y != PAD).sum()  # a token mean: micro-batches weigh by their tokens

    for batch in ol.data_loader(TokenData(512, 16, 32)):
        opt.zero_grad()
        ol.run_step(loss, batch)
        opt.step()
        ol.step()
    ol.finish()
    return {k: v.detach().cpu() for k, v in ol.module.state_dict().items()}, ol


def test_auto_cap_probes_the_first_steps():
    _, ol = _memory_run(None, max_batch="auto")  # 8 steps: the probe measured the first PROBE_STEPS, then left
    assert ol.max_batch is not None and ol.max_batch > 64  # a tiny model on a big GPU
    assert ol.memory.reported() == ol.max_batch == ol.memory.probed and ol.probe is None
    assert ol.memory.limit is None  # a probe's cap, which a later probe may raise; no out-of-memory limit


def test_memory_auto_counts_cuda_tensors_against_the_devices_total(capsys):
    """``memory="auto"``: the device's total memory, the first step's counted bytes (CUDA tensors), one line."""
    from omnilearn.balance import memplan

    _, ol = _memory_run(None, memory="auto")
    total = torch.cuda.get_device_properties(ol.device).total_memory
    needs = ol.probe_needs
    assert needs.state > 0 and needs.per_sample > 0 and ol.max_batch == memplan.cap(total, needs, 0) > 64
    assert f"memory plan, rank 0: {memplan.human(total)}: a full replica" in capsys.readouterr().err


def test_a_real_cuda_out_of_memory_error_is_recovered(capsys):
    expected, _ = _memory_run(None)
    got, ol = _memory_run(16)
    assert ol.max_batch == 16 and ol.micro.sizes == (16,) * 4
    assert close(got, expected) < 1e-5
    assert "out of memory in the forward of a micro-batch of 32 samples; cap 32 -> 16" in capsys.readouterr().err
    assert torch.cuda.memory_reserved() < 1 << 30


# ------------------------------------------------------------ FSDP2 on CUDA (omnilearn.bsp.sharded)
def _fsdp_shard(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = model.to(device)
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    return fully_shard(model)


def test_fsdp_on_one_gpu_trains_exactly_and_times_with_events_only(tmp_path, monkeypatch):
    """FSDP2 on a one-GPU NCCL group: the stalls are CUDA events (no host sync per step), the weights exact."""
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        ol = omnilearn.setup(global_batch=64, control_interval=4, accumulation_steps=2, device="cuda")
        model = ol.wrap_model(_fsdp_shard(token_model(), ol.device))
        syncs = []
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: syncs.append(1))
        train(ol, model, ol.data_loader(TokenData(512, 16, 32)), 12)
        assert not syncs  # the stalls are events on the compute stream, resolved at the interval ends
        summary = ol.finish()
        assert summary["steps"] == 12
        from omnilearn.bsp.sharded import full_state
        got = {k: v.detach().cpu() for k, v in full_state(model).items()}
        assert close(got, reference(ol.device, 12, 64)) < 1e-4
    finally:
        dist.destroy_process_group()


def _fsdp_two_gpu_worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.cuda.set_device(rank)
    ol = omnilearn.setup(global_batch=64, speeds="3,1", control_interval=4, accumulation_steps=2, min_batch=8,
                         device="cuda")
    model = ol.wrap_model(_fsdp_shard(token_model(), ol.device))
    train(ol, model, ol.data_loader(TokenData(512, 16, 32)), 24)
    from omnilearn.bsp.sharded import full_state
    state = full_state(model)
    summary = ol.finish()
    if rank == 0:
        torch.save({"weights": {k: v.detach().cpu() for k, v in state.items()}, "summary": summary},
                   f"{out}/rank0.pt")
    ol.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across ranks needs 2 GPUs")
def test_fsdp_on_two_gpus_heterogeneous_equals_one_process_and_moves_batches(tmp_path):
    mp.start_processes(_fsdp_two_gpu_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    got = torch.load(tmp_path / "rank0.pt", weights_only=True)
    assert close(got["weights"], reference(torch.device("cuda", 0), 24, 64)) < 1e-4
    fast, slow = got["summary"]["workers"]
    assert fast["mean_batch"] > slow["mean_batch"]  # measured with compute-stream events: moved to rank 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL across ranks needs 2 GPUs")
def test_a_killed_nccl_rank_costs_one_step(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "faults" / "rescue_script.py"
    env = {**os.environ, "RESCUE_DEVICE": "cuda", "RESCUE_TIMEOUT_S": "120", "OMP_NUM_THREADS": "1"}
    outs = []
    for name, extra in (("whole", []), ("killed", ["1:7"])):
        out = tmp_path / name
        out.mkdir()
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               "--max-restarts", "1", str(script), str(out), *extra], env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(out)
    assert "omnilearn: rank 0 lost a peer at step 7" in done.stderr, done.stderr[-3000:]
    assert json.loads((outs[1] / "attempt-1.json").read_text())["start"] == 7
    a, b = (torch.load(o / "final.pt", weights_only=True) for o in outs)
    assert all(torch.allclose(a[k], b[k], rtol=1e-12, atol=0) for k in a)
