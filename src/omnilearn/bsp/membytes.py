"""Counting what a training step holds, in bytes: the model state, the largest unsharded block, the activations.

The torch side of the memory plan (:mod:`omnilearn.balance.memplan` decides). Counted, not estimated:

- :func:`state_bytes`: this rank's parameters, gradients and optimizer state, as tensors it holds (an FSDP2
  parameter is a DTensor: its local shard, padding included; a tensor shared by two names counts once);
- :func:`block_bytes`: the largest FSDP2 unit's unsharded parameters (in its all-gather dtype) and their
  unsharded gradients, which exist while that unit computes its backward (0 for a model not sharded);
- :class:`SavedBytes`: the tensors autograd saves for backward during a step (``saved_tensors_hooks``), each
  storage once, parameters and their views left out (they are the state or the block): the activations. A saved
  view counts its whole storage (what it keeps alive).

:class:`CountingProbe` counts them in a run's first step and gives the rank's cap for its declared (CPU) or
measured (CUDA) memory; the session uses it like the CUDA probe of ``max_batch="auto"``
(:mod:`omnilearn.bsp.memory`): the cap travels in the next control interval's meeting and the controller plans
every rank's share within it from then on (until then, the even split runs: docs/memory.md's limits).

Run: ``python -m pytest -q tests/unit/test_memplan.py tests/dist/test_memory_plan.py``
"""

from __future__ import annotations

import sys
import weakref
from typing import Iterable

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from omnilearn.balance import memplan
from omnilearn.bsp import sharded
from omnilearn.config import AUTO, BalanceConfig, ConfigError


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes of ``tensors`` as this rank holds them (a DTensor: its local shard), each storage once."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        seen[(local.device.type, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def state_bytes(model: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = ()) -> int:
    """This rank's parameters, their gradients and the state ``optimizers`` keep for them."""
    params = list(model.parameters())
    mine = {id(p) for p in params}
    grads = [p.grad for p in params if p.grad is not None]
    kept = [v for opt in optimizers for p, state in opt.state.items() if id(p) in mine
            for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return tensor_bytes(params) + tensor_bytes(grads) + tensor_bytes(kept)


def block_bytes(model: nn.Module) -> int:
    """The largest FSDP2 unit's unsharded parameters and gradients (0 for a model that is not sharded)."""
    largest = 0
    for unit in model.modules():
        if not sharded.is_sharded(unit):
            continue
        size = 0
        for group in sharded.param_groups(unit):
            dtype = group.mp_policy.param_dtype
            for fsdp_param in group.fsdp_params:
                param = fsdp_param.sharded_param
                itemsize = torch.empty((), dtype=dtype or param.dtype).element_size()
                size += 2 * param.numel() * itemsize  # a DTensor's numel is the whole parameter's
        largest = max(largest, size)
    return largest


class SavedBytes:
    """The most bytes autograd held saved for backward at once while entered: each storage once, parameters left
    out. A saved tensor counts from its forward until autograd lets it go (its backward): the peak is one
    micro-batch's activations, however many micro-batches the step runs."""

    def __init__(self) -> None:
        self.live: dict[tuple, list[int]] = {}  # storage -> [bytes, saved tensors holding it]
        self.now = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base  # a view of a parameter (``weight.t()`` in a linear) is the parameter
        if not (base.is_leaf and base.requires_grad) and t.device.type != "meta":
            storage = t.untyped_storage()
            key = (t.device.type, storage.data_ptr())
            held = self.live.setdefault(key, [storage.nbytes(), 0])
            if held[1] == 0:
                self.now += held[0]
                self.peak = max(self.peak, self.now)
            held[1] += 1
            weakref.finalize(t, self._release, key)  # autograd holds t (returned below) until its backward
        return t

    def _release(self, key: tuple) -> None:
        held = self.live.get(key)
        if held is not None:
            held[1] -= 1
            if held[1] == 0:
                self.now -= held[0]
                del self.live[key]

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> "SavedBytes":
        self.peak = self.now
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class CountingProbe:
    """A run's first step counted: the rank's needs (:class:`~omnilearn.balance.memplan.Needs`) and its cap.

    ``begin()`` where the step starts (the activations are counted from there), ``end(samples)`` after
    ``ol.step()`` (the optimizer has stepped: its state exists). The optimizers are the ones that stepped
    meanwhile (torch's global step hook, removed at the end)."""

    def __init__(self, model: nn.Module, memory: int, rank: int) -> None:
        self.model, self.memory, self.rank = model, memory, rank
        self.saved = SavedBytes()
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self._hook = register_optimizer_step_post_hook(
            lambda opt, args, kwargs: self.optimizers.add(opt))
        self.done, self.needs, self.entered = False, None, False

    def begin(self) -> None:
        if not self.entered:  # a step fetched ahead starts before the last one ends: counted from the first
            self.saved.__enter__()
            self.entered = True

    def end(self, samples: int) -> int | None:
        """This rank's cap: the most samples one forward/backward may hold, from the step's largest micro-batch
        (``samples``) and the most activations held at once (prints the plan's line); None when the step began
        before the probe (the model wrapped mid-step): the next step is counted."""
        if not self.entered:
            return None
        self.saved.__exit__(None, None, None)
        self.entered = False
        self._hook.remove()
        self.done = True
        self.needs = memplan.Needs(state=state_bytes(self.model, self.optimizers), block=block_bytes(self.model),
                                   per_sample=self.saved.peak / max(samples, 1))
        try:
            cap = memplan.cap(self.memory, self.needs, self.rank)
        except memplan.PlanError as e:
            raise ConfigError(str(e)) from None
        print("omnilearn: " + memplan.state_line(torch.__version__, self.needs, self.memory, cap, self.rank,
                                                 sharded.is_sharded(self.model)), file=sys.stderr, flush=True)
        return cap


def probe_for(cfg: BalanceConfig, ctx, model: nn.Module) -> CountingProbe:
    """The probe of this rank's ``memory`` (declared, or ``"auto"``: its CUDA device's total memory)."""
    if cfg.max_batch == AUTO:
        raise ConfigError('max_batch="auto" and memory= both set this rank\'s cap: give memory=[...] (each rank\'s '
                          'memory; caps counted from it) or max_batch="auto" (a CUDA probe), not both')
    try:
        declared = memplan.rank_memory(cfg.memory, ctx.rank, ctx.world_size)
    except memplan.PlanError as e:
        raise ConfigError(str(e)) from None
    if declared == memplan.AUTO:
        if ctx.device.type != "cuda":
            raise ConfigError(f'memory="auto" measures a CUDA device, and rank {ctx.rank} computes on '
                              f'{ctx.device.type}: declare each rank\'s memory, e.g. memory=["4GiB", "16GiB"]')
        declared = torch.cuda.get_device_properties(ctx.device).total_memory
    return CountingProbe(model, declared, ctx.rank)
