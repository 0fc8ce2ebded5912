"""Wrapping the user's model: DDP with the weighted sum as its communication hook, and a guarded ``no_sync``.

:func:`wrap` moves the model to the rank's device and, in a process group,
wraps it in :class:`BalancedDDP`: DDP whose communication hook is
:func:`~omnilearn.bsp.backward.weighted_sum` (each bucket times this rank's
weight, summed: the one weighting, and the step's ready and reduced marks;
buffers are not broadcast from rank 0 every forward: the session averages
them by batch share). Its syncing forward tells the session it ran
(``HookState.synced``), so a syncing backward without one is refused before
it runs (:mod:`omnilearn.bsp.micro`). Another comm hook is refused: it would
replace the weighting (``register_comm_hook``).

The model holds the process group (DDP's C++ reducer and logger, its
``process_group``, the hook's state): while it does, destroying the group
leaves its gloo threads and sockets running on into interpreter
finalisation, where a gloo thread that must take the GIL aborts the process
(docs/failures.md, "The abort at exit"). :func:`release` makes a
wrapped model let go; :func:`omnilearn.distributed.group.destroy` (the one
teardown: ``Session.close()``, the launcher, the exit) calls it for every
wrapped model first. A released model still computes (its forward is the
module's) but syncs nothing.

``model.no_sync()`` is refused: it accumulates several steps' gradients and
lets one step's weight ``b_i / B`` scale them all, which is wrong as soon as
the batches change inside the window. The session's gradient accumulation
(``accumulation_steps`` and ``ol.backward``) does it exactly; it sets DDP's
``require_backward_grad_sync`` itself, before each micro-batch's forward.

``torch.compile`` works around it (``torch.compile(ol.wrap_model(model))``:
dynamo traces :meth:`BalancedDDP.forward`, DDP's reducer calls break its
graph, the marks run in frames that hold no graph, and the module's forward
is compiled as a frame of its own, under DDP's marker for dynamo's DDP
optimizer) and inside it (``ol.wrap_model(torch.compile(model))``); either
way exact and compiled twice at most while the batches move (docs/compile.md).

Every call order: a wrapped model wrapped again in another DDP (``model =
accelerator.prepare(model)`` after ``ol.wrap_model``, in a process group) would
have its weighted gradients averaged a second time by the outer DDP: its first
forward raises :class:`~omnilearn.config.ConfigError` (:meth:`BalancedDDP.forward`). So
does one sharded after ``ol.wrap_model`` (``fully_shard(model)`` after it: FSDP
would reduce by its own unweighted average, its waits unmeasured); every
forward looks for an outer DDP and at the two types (``fully_shard`` changes a
module's class in place), the first forward at every module (0.2 us a
forward, 1.4 us when every forward asked FSDP2 twice). The reverse
orders (a DDP model, or an FSDP2 one, given to ``ol.wrap_model``) are refused,
or adopted, by :func:`omnilearn.bsp.sharded.refuse_unbalanced`.

Run: ``python -m pytest -q tests/dist/test_accumulation.py tests/dist/test_teardown.py tests/dist/test_call_orders.py
tests/dist/test_compile.py``
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.bsp.sharded import is_sharded, sharded_inside
from omnilearn.config import ConfigError
from omnilearn.distributed import group
from omnilearn.bsp.backward import HookState, weighted_sum

# Buffers are averaged by the session, not copied from rank 0 every forward (the flag's name changed in torch 2.13).
NO_BUFFER_BROADCAST = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                       else {"broadcast_buffers": False})


_HOLDS_GROUP = ("reducer", "logger", "process_group")  # what a DDP model holds its process group by
_WRAPPED: "weakref.WeakSet[BalancedDDP]" = weakref.WeakSet()  # wrapped models that still hold their group


class BalancedDDP(DDP):
    """DDP whose ``no_sync()`` explains what to use instead, and whose forward after :func:`release` is the module's."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        own = self.__dict__
        if "reducer" not in own:  # released: no group left to sync with
            return self.module(*inputs, **kwargs)
        # What was done to the model after ``ol.wrap_model`` (module docstring), looked at every forward: an outer
        # DDP (DDP marks itself active during its module's forward: ``_get_active_ddp_module``, private, for
        # torch.compile; tests/unit/test_torch_private_names.py holds it to that), and whether this model's or its
        # module's type changed since the last full look (``fully_shard`` changes a class in place).
        active, seen = DDP._get_active_ddp_module(), own.get("types_checked")  # seen: (its type, module, module's type)
        if active is not None and active is not self:
            raise ConfigError(f"the model ol.wrap_model() returned was wrapped again in {type(active).__name__} "
                              "(accelerator.prepare(model) or ray.train.torch.prepare_model after ol.wrap_model?), "
                              "which would average its weighted "
                              "gradients a second time: keep ol.wrap_model's model and prepare only the optimizer "
                              "(optimizer = accelerator.prepare(optimizer))")
        if seen is None or type(self) is not seen[0] or type(seen[1]) is not seen[2]:
            self._check_sharding(seen is None)
        if self.require_backward_grad_sync and torch.is_grad_enabled():
            hook = own.get("hook")
            if hook is not None:
                hook.synced = True  # the next backward of this graph syncs (micro.py checks the syncing backward)
        return super().forward(*inputs, **kwargs)

    def _check_sharding(self, first: bool) -> None:
        """Refuse a model sharded after ``ol.wrap_model``: the root (any forward), or any module or parameter inside
        (the first forward); then remember the types looked at."""
        module = self.module
        root = is_sharded(self) or is_sharded(module)
        sharded = "the root module was sharded" if root else sharded_inside(module) if first else None
        if sharded is not None:
            raise ConfigError(f"fully_shard after ol.wrap_model(): {sharded} inside OmniLearn's DDP, so FSDP would "
                              "average the gradients unweighted and its waits go unmeasured: call fully_shard first "
                              "(each block, then the root), then model = ol.wrap_model(model)")
        self.__dict__["types_checked"] = (type(self), module, type(module))

    def register_comm_hook(self, state: object, hook: Any) -> None:
        raise ConfigError(f"model.register_comm_hook({getattr(hook, '__name__', hook)}): OmniLearn's model already "
                          "reduces with its own hook (each worker's gradient weighted by its batch share, summed), "
                          "which another hook would replace; drop the comm hook (gradient compression is not "
                          "supported) and use torch.autocast for reduced precision")

    def no_sync(self):
        raise RuntimeError(
            "model.no_sync() is not supported on an OmniLearn model: the accumulated gradients would all be "
            "weighted by the last step's batch share. Set accumulation_steps=K in omnilearn.setup() (--accumulation-"
            "steps K), iterate the K micro-batches the loader hands out per step and call ol.backward(loss) for each")


# DDP keywords that change how gradients are reduced, outside what the weighting and the step's marks assume.
UNWEIGHTED_DDP_KWARGS = {
    "mixed_precision": "DDP's own mixed precision casts the gradients in a comm hook of its own, beside OmniLearn's; "
                       "use torch.autocast instead",
    "delay_all_reduce_named_params": "those parameters are all-reduced after the backward, outside the step's "
                                     "weighted timing; drop it",
    "param_to_hook_all_reduce": "it all-reduces outside the step's weighted timing; drop it",
}


def refuse_unweighted(ddp_kwargs: dict[str, Any]) -> None:
    """One line for a DDP keyword that would bypass the weighting (:data:`UNWEIGHTED_DDP_KWARGS`)."""
    for name, why in UNWEIGHTED_DDP_KWARGS.items():
        if ddp_kwargs.get(name) is not None:
            raise ConfigError(f"ol.wrap_model(model, {name}=...): {why}")


def wrap(model: nn.Module, device: torch.device, grouped: bool, hook: HookState, **ddp_kwargs: Any) -> nn.Module:
    """``model`` on ``device``; in a process group a :class:`BalancedDDP` weighted and marked through ``hook``."""
    refuse_unweighted(ddp_kwargs)
    model = model.to(device)
    if not grouped:
        return model
    ids = [device] if device.type == "cuda" else None
    model = BalancedDDP(model, device_ids=ids, **{**NO_BUFFER_BROADCAST, **ddp_kwargs})
    hook.process_group = model.process_group
    DDP.register_comm_hook(model, hook, weighted_sum)  # the one weighting (backward.py); refused to anyone else
    model.__dict__["hook"] = hook
    _WRAPPED.add(model)
    group.before_destroy(release_wrapped)
    return model


def release(model: nn.Module | None) -> None:
    """Make a :class:`BalancedDDP` let go of its process group (idempotent; anything else is left alone).

    Drops DDP's reducer and logger (C++: the reducer holds the group and
    the comm hook), its ``process_group`` and the hook state's group, so that destroying the
    group ends its threads there and then. Call it once no rank syncs any more.
    """
    if not isinstance(model, BalancedDDP):
        return
    hook = model.__dict__.pop("hook", None)
    if hook is not None:
        hook.process_group = None
    for name in _HOLDS_GROUP:
        model.__dict__.pop(name, None)
    _WRAPPED.discard(model)


def release_wrapped() -> None:
    """:func:`release` every wrapped model still alive (before the group is destroyed)."""
    for model in list(_WRAPPED):
        release(model)
