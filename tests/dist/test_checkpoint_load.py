"""Loading a checkpoint on two gloo ranks: the file's bytes in bounded CPU pieces, one copy per rank, one outcome.

- Rank 0 reads the file; the bytes reach rank 1 in pieces of at most
  ``CHUNK_BYTES`` (made small here: a multi-piece checkpoint), as CPU
  tensors, and round-trip exactly (weights, optimizer, a tensor in
  ``extra``). Rank 1 passes a directory that does not exist on its side:
  only rank 0 reads the disk.
- No Python-side copy of the file beyond the one buffer (tracemalloc's peak
  during the load stays under the file's size plus a piece plus slack).
- Under a default group that cannot carry CPU tensors (reported as NCCL
  here) the pieces go over a gloo side group, destroyed after the load.
- A failure on rank 0 (every checkpoint damaged) is the same one-line error
  on both ranks, not a hang or a fresh start.

Run: ``python -m pytest -q tests/dist/test_checkpoint_load.py``
"""

from __future__ import annotations

import math
import tracemalloc

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from omnilearn.checkpoint import CheckpointError, CheckpointStore
from omnilearn.distributed import collect

pytestmark = pytest.mark.dist
CHUNK = 32 * 1024


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return torch.full((128,), float(i) / 64), torch.tensor(i % 3)


def session(seed: int):
    ol = omnilearn.setup(global_batch=16, control_interval=5, device="cpu")
    torch.manual_seed(seed)
    model = ol.wrap_model(nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 3)))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return ol, model, ol.data_loader(Data()), opt


def load_measured(rank: int, ckpt: str) -> dict:
    """Load into a fresh session, recording (bytes, device, side group?) of each broadcast and the traced peak."""
    ol, model, _, opt = session(seed=7)  # other weights than the saved ones
    calls, original = [], dist.broadcast

    def broadcast(tensor, src=None, group=None, **kw):
        calls.append((tensor.numel() * tensor.element_size(), tensor.device.type, group is not None))
        return original(tensor, src=src, group=group, **kw)

    dist.broadcast = broadcast
    tracemalloc.start()
    try:
        ok = ol.load_checkpoint(ckpt if rank == 0 else f"{ckpt}-not-on-this-node", model=model, optimizer=opt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        dist.broadcast = original
    return {"ok": ok, "calls": calls, "peak": peak, "extra": ol.checkpoint_extra["blob"],
            "weights": {k: v.clone() for k, v in ol.module.state_dict().items()},
            "adam": opt.state_dict()["state"][0]["exp_avg"].clone(), "next_step": ol.next_step}


def _worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    ckpt = f"{out}/ckpt"
    ol, model, loader, opt = session(seed=0)
    for x, y in loader:
        opt.zero_grad()
        ol.backward(F.cross_entropy(model(x), y))
        opt.step()
        ol.step()
    blob = torch.randn(40_000, generator=torch.Generator().manual_seed(1))
    ol.save_checkpoint(ckpt, model=model, optimizer=opt, extra={"blob": blob})
    result = {"weights": {k: v.clone() for k, v in ol.module.state_dict().items()}, "blob": blob,
              "adam": opt.state_dict()["state"][0]["exp_avg"].clone()}
    collect.CHUNK_BYTES = CHUNK
    result["gloo"] = load_measured(rank, ckpt)
    real_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl" if group is None else real_backend(group)
    result["side"] = load_measured(rank, ckpt)
    dist.get_backend = real_backend
    if rank == 0:
        path = CheckpointStore(ckpt).path(4)
        path.write_bytes(path.read_bytes()[:-1])
    dist.barrier()
    try:
        session(seed=0)[0].load_checkpoint(ckpt)
    except CheckpointError as e:
        result["error"] = str(e)
    result["file_bytes"] = CheckpointStore(ckpt).path(4).stat().st_size + 1 if rank == 0 else 0
    torch.save(result, f"{out}/rank{rank}.pt")
    ol.close()  # a barrier, then every rank waits for the others' teardown


def test_a_multi_piece_checkpoint_round_trips_in_bounded_cpu_pieces(tmp_path):
    start_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    size = ranks[0]["file_bytes"]
    assert size > 6 * CHUNK, size
    for result in ranks:
        for key in ("gloo", "side"):
            load = result[key]
            assert load["ok"] and load["next_step"] == 4 and torch.equal(load["extra"], ranks[0]["blob"])
            assert torch.equal(load["adam"], result["adam"])
            assert all(torch.equal(load["weights"][k], result["weights"][k]) for k in result["weights"])
            pieces = [n for n, _, _ in load["calls"][1:] if n > 8]  # after the header's size, its text, the file's size
            assert max(n for n, _, _ in load["calls"]) <= CHUNK and {d for _, d, _ in load["calls"]} == {"cpu"}
            assert sum(pieces) - pieces[0] == size and len(pieces) - 1 == math.ceil(size / CHUNK)
            assert {side for _, _, side in load["calls"]} == {key == "side"}
            assert load["peak"] < size + CHUNK + 256 * 1024, (key, load["peak"], size)  # one buffer, no copy
        assert "no usable checkpoint in" in result["error"] and "step-000000004.pt is damaged" in result["error"]
    assert ranks[0]["error"] == ranks[1]["error"]
