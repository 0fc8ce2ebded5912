"""Every call order around ``ol.wrap_model`` works or is refused in one line (2 real gloo ranks).

- accelerate: ``model, opt = accelerator.prepare(model, opt)`` AFTER ``ol.wrap_model`` wraps OmniLearn's DDP in
  a second DDP, which would average the weighted gradients again: the first forward raises ``ConfigError`` on
  every rank, naming the order and the fix (prepare only the optimizer). The reverse order (prepare, then
  ``ol.wrap_model``) is refused at ``wrap_model``, naming accelerate.
- FSDP2: ``fully_shard`` AFTER ``ol.wrap_model`` (the model inside OmniLearn's DDP now sharded: FSDP's own
  unweighted average, its waits unmeasured): refused at the first forward, and at a later forward when only the
  root is sharded after a first forward, and when only a block is; the supported order (``fully_shard`` first) is adopted.

Run: ``python -m pytest -q tests/dist/test_call_orders.py``
"""

from __future__ import annotations

import os

import pytest
from ranks import free_port, start_ranks
import torch
import torch.distributed as dist
from torch import nn

import omnilearn
from omnilearn.config import ConfigError

pytestmark = pytest.mark.dist


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer)
    return fully_shard(model)


def first_forward(ol, model, no_grad: bool = False) -> str:
    """The outcome of one training step's forward: the refusal's text, or "accepted"."""
    loader = ol.data_loader(torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(2, (32,))))
    x, _ = next(iter(loader))
    try:
        with torch.no_grad() if no_grad else torch.enable_grad():
            model(x)
    except ConfigError as e:
        return str(e)
    return "accepted"


def session():
    return omnilearn.setup(global_batch=8, device="cpu", handle_signals=False)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # makes the process group (gloo)
    result = {}
    ol = session()
    model = ol.wrap_model(mlp())
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    result["prepare_after"] = first_forward(ol, model)
    ol.release()
    accelerator.free_memory()
    del model

    ol = session()
    try:
        ol.wrap_model(accelerator.prepare(mlp()))
        result["prepare_before"] = "accepted"
    except TypeError as e:
        result["prepare_before"] = str(e)
    accelerator.free_memory()

    for case in ("shard_after", "blocks_sharded_after", "root_sharded_later", "shard_first"):
        ol = session()
        plain = mlp()
        if case == "shard_first":
            model = ol.wrap_model(shard(plain))
        else:
            model = ol.wrap_model(plain)
            if case == "root_sharded_later":
                assert first_forward(ol, model, no_grad=True) == "accepted"
                from torch.distributed.fsdp import fully_shard

                fully_shard(plain)
            elif case == "blocks_sharded_after":
                from torch.distributed.fsdp import fully_shard

                fully_shard(plain[2])  # a block, not the root: found by the first forward's look at every module
            else:
                shard(plain)
        result[case] = first_forward(ol, model) if case != "root_sharded_later" else _forward_again(ol, model)
        ol.release()
        del model
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    from omnilearn.distributed import group
    group.destroy()


def _forward_again(ol, model) -> str:
    x, _ = next(iter(ol.loader))
    try:
        model(x)
    except ConfigError as e:
        return str(e)
    return "accepted"


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    out = tmp_path_factory.mktemp("orders")
    start_ranks(_worker, (2, free_port(), str(out)), 2)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_accelerate_prepare_after_wrap_model_is_refused_at_the_first_forward(outcomes):
    for got in outcomes:
        message = got["prepare_after"]
        assert "wrapped again in DistributedDataParallel" in message
        assert "accelerator.prepare(model) or ray.train.torch.prepare_model after" in message
        assert "optimizer = accelerator.prepare(optimizer)" in message and "\n" not in message
        assert ("already wrapped in DistributedDataParallel (by accelerator.prepare(model) or "
                "ray.train.torch.prepare_model?)") in got["prepare_before"]


def test_fully_shard_after_wrap_model_is_refused_and_before_is_adopted(outcomes):
    for got in outcomes:
        for case in ("shard_after", "blocks_sharded_after", "root_sharded_later"):
            message = got[case]
            assert message.startswith("fully_shard after ol.wrap_model(): ") and "\n" not in message, (case, message)
            assert "call fully_shard first" in message, message
        assert "the root module was sharded" in got["shard_after"] and "module '2' was sharded" in \
            got["blocks_sharded_after"]
        assert got["shard_first"] == "accepted"
