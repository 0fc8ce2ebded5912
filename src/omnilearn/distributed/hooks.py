"""DDP communication hook: the weighted gradient sum, and nothing else.

DDP averages gradients over ``n`` workers; with unequal batches the exact
global-batch gradient is ``g = sum_i (b_i / B) * g_i`` (``g_i`` is worker i's
mean gradient). The hook scales each bucket by this step's ``b_i / B`` and
all-reduces with SUM on the process group DDP was given, keeping DDP's
bucketed, overlapped all-reduce.

Timing and speed emulation are not the hook's business: it only calls the
``on_ready`` callback once per step when the last bucket is ready (before
its reduction starts: the session marks the end of local compute there and
lets the delay emulator sleep), and ``on_reduced(last)`` when a bucket's
reduction finished (from a communication thread).

The state is held by DDP's C++ reducer, where Python's garbage collector
cannot see it: a callback that is a bound method is therefore held weakly
(:class:`HookState`), else session -> model -> reducer -> state -> method ->
session would be a cycle no collection ever frees, keeping the model and its
process group (threads, sockets) alive until the process ends.

Register with ``ddp.register_comm_hook(HookState(ddp.process_group), weighted_allreduce_hook)``.
Tests: ``python -m pytest -q tests/dist/test_hooks.py tests/dist/test_teardown.py``.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

import torch.distributed as dist


class _Callback:
    """A callback attribute: a bound method is kept as a weak reference (None once its object is gone)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, state: "HookState | None", owner: type | None = None):
        if state is None:
            return self
        ref = getattr(state, self.slot)
        return None if ref is None else ref()

    def __set__(self, state: "HookState", fn: Callable | None) -> None:
        ref = None if fn is None else weakref.WeakMethod(fn) if inspect.ismethod(fn) else (lambda: fn)
        setattr(state, self.slot, ref)


class HookState:
    """What the hook reads each step; the session sets ``weight`` before every backward.

    ``process_group``: the group DDP reduces over (None: the default group). ``weight``: this worker's share of
    the step's gradient, ``b_i / B``, or ``count_i / sum(count)`` for token losses (then a 0-dim tensor on the
    device, so reading it never synchronises). ``on_ready()`` / ``on_reduced(last)``: see the module docstring;
    bound methods are held weakly.
    """

    on_ready = _Callback()
    on_reduced = _Callback()

    def __init__(self, process_group: Any = None, weight: Any = 1.0, on_ready: Callable[[], None] | None = None,
                 on_reduced: Callable[[bool], None] | None = None) -> None:
        self.process_group, self.weight = process_group, weight
        self.on_ready, self.on_reduced = on_ready, on_reduced


def weighted_allreduce_hook(state, bucket):  # DDP rejects string annotations here
    """Scale the bucket by ``state.weight`` and SUM-reduce it on ``state.process_group``; returns a Future."""
    buffer = bucket.buffer()
    buffer.mul_(state.weight)
    last = bucket.is_last()
    if last and state.on_ready is not None:
        state.on_ready()
    work = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=state.process_group, async_op=True)
    on_reduced = state.on_reduced

    def done(fut):
        if on_reduced is not None:
            on_reduced(last)
        return fut.value()[0]

    return work.get_future().then(done)
