"""Wrapping the user's model: DDP with the weighted gradient hook, and a guarded ``no_sync``.

:func:`wrap` moves the model to the rank's device and, in a process group,
wraps it in :class:`BalancedDDP` (DDP; buffers are not broadcast from rank 0
every forward: the session averages them by batch share) with
:func:`~omnilearn.distributed.hooks.weighted_allreduce_hook` on DDP's own
process group.

``model.no_sync()`` is refused: it accumulates several steps' gradients and
lets one step's weight ``b_i / B`` scale them all, which is wrong as soon as
the batches change inside the window. The session's gradient accumulation
(``accumulation_steps`` and ``ol.backward``) does it exactly; it sets DDP's
``require_backward_grad_sync`` itself, before each micro-batch's forward.

Run: ``python -m pytest -q tests/dist/test_accumulation.py``
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.distributed.hooks import HookState, weighted_allreduce_hook

# Buffers are averaged by the session, not copied from rank 0 every forward (the flag's name changed in torch 2.13).
NO_BUFFER_BROADCAST = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                       else {"broadcast_buffers": False})


class BalancedDDP(DDP):
    """DDP whose ``no_sync()`` explains what to use instead (see the module docstring)."""

    def no_sync(self):
        raise RuntimeError(
            "model.no_sync() is not supported on an OmniLearn model: the accumulated gradients would all be "
            "weighted by the last step's batch share. Set accumulation_steps=K in omnilearn.setup() (--accumulation-"
            "steps K), iterate the K micro-batches the loader hands out per step and call ol.backward(loss) for each")


def wrap(model: nn.Module, device: torch.device, grouped: bool, hook: HookState, **ddp_kwargs: Any) -> nn.Module:
    """``model`` on ``device``; in a process group a :class:`BalancedDDP` reducing through ``hook``."""
    model = model.to(device)
    if not grouped:
        return model
    ids = [device] if device.type == "cuda" else None
    model = BalancedDDP(model, device_ids=ids, **{**NO_BUFFER_BROADCAST, **ddp_kwargs})
    hook.process_group = model.process_group
    model.register_comm_hook(hook, weighted_allreduce_hook)
    return model
