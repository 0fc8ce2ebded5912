"""The one weighting of a DDP step, at DDP's reduction: exact whatever the model returns or the loss is made of.

The exact global-batch gradient is ``g = sum_i (b_i / B) g_i`` (DESIGN.md,
"the weighting"): worker ``i``'s mean gradient weighted by its share and
summed, never averaged over the ranks. OmniLearn applies that weight at one
point only: DDP's communication hook (:func:`weighted_sum`), which receives
each gradient bucket as this rank's accumulated parameter gradients (DDP
does no division of its own when a hook is registered), multiplies it by
``HookState.weight`` (``b_i / B``; ``count_i / sum(count)`` for token losses,
then a 0-dim tensor on the device, so reading it never synchronises) and
all-reduces it with a sum. So every parameter's gradient gets its rank's
weight exactly once per step, however it was produced: one output or many,
a loss computed inside the model, hidden states, the same tensor returned
twice, ``model(model(x))``, penalties on the weights or on an input
gradient, auxiliary losses a module keeps. Gradients a user asks for with
``torch.autograd.grad`` never reach DDP's buckets and are never touched.
``ol.backward(loss)`` scales a micro-batch's loss only by its share of this
rank's batch (``m_ij / b_i``, :mod:`omnilearn.bsp.micro`); the rank's
weight stays here. (Until issue 49 the weight rode on the gradients
flowing into the model's outputs: wrong, silently, for most models with
more than one output tensor; tests/exactness is the evidence now.)

The same hook gives the step's timing marks without any other hook: DDP
launches its buckets in order, so the last bucket's hook runs once this
rank's last gradient is ready. There ``on_ready`` runs (the delay emulator
sleeps, then the timer marks the local compute done: before the last
bucket's all-reduce starts, so the straggling is real for the peers) and an
engine callback is queued; that callback queues another, which the autograd
engine runs after DDP's ``finalize_backward`` (DDP queues it when the last
bucket is launched, i.e. after this hook returns): the reductions are done,
or on CUDA the stream waits for them, and ``on_reduced`` marks it.

Cost over DDP's built-in C++ mean: one Python call per bucket (DDP's
default bucket is 25 MB: one or a few for most models) and a future's
callback; the multiplication replaces DDP's own division (docs/results.md,
"exact by construction", measured with ``tools/hl1_breakdown.py``).

``torch.autograd.Variable._execution_engine.queue_callback`` is private
(DDP and FSDP use it themselves); tests/unit/test_torch_private_names.py
holds it to that.

Run: ``python -m pytest -q tests/exactness tests/dist/test_hooks.py tests/dist/test_compile.py``
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

import torch
from torch.autograd import Variable


class _Callback:
    """A callback attribute: a bound method is kept as a weak reference to its object and its function (None once
    the object is gone), so the model (which holds the hook and its state) never keeps the session that set it
    alive. The hook calls it through :func:`_call` (no descriptor, no ``WeakMethod`` per call: it runs every step)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, state: "HookState | None", owner: type | None = None):
        if state is None:
            return self
        ref, fn = getattr(state, self.slot)
        if ref is None:
            return fn
        obj = ref()
        return None if obj is None else fn.__get__(obj)

    def __set__(self, state: "HookState", fn: Callable | None) -> None:
        setattr(state, self.slot, (weakref.ref(fn.__self__), fn.__func__) if inspect.ismethod(fn) else (None, fn))


def _call(slot: tuple, *args: Any) -> None:
    """Call a :class:`_Callback`'s stored ``(object reference or None, function)``, if it is set and alive."""
    ref, fn = slot
    if ref is None:
        if fn is not None:
            fn(*args)
        return
    obj = ref()
    if obj is not None:
        fn(obj, *args)


class HookState:
    """What the hook reads each step; the session sets it when a step starts.

    ``process_group``: the group DDP reduces over (None: the default group). ``weight``: this worker's share of
    the step's gradient, ``b_i / B``, or ``count_i / sum(count)`` for token losses (a 0-dim tensor on the device);
    FSDP2's weighted reduce-scatter applies it too (:mod:`omnilearn.bsp.sharded`). ``synced``: a forward that
    prepares a syncing backward ran in this step (the model's forward sets it; :mod:`omnilearn.bsp.micro` checks it
    before the step's syncing backward). ``on_ready()`` / ``on_reduced(last)``: the marks (module docstring);
    bound methods are held weakly.
    """

    on_ready = _Callback()
    on_reduced = _Callback()

    def __init__(self, process_group: Any = None, weight: Any = 1.0, on_ready: Callable[[], None] | None = None,
                 on_reduced: Callable[[bool], None] | None = None) -> None:
        self.process_group, self.weight = process_group, weight
        self.synced = False
        self.on_ready, self.on_reduced = on_ready, on_reduced


def _value(fut: torch.futures.Future) -> torch.Tensor:
    return fut.value()[0]


def weighted_sum(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """DDP's communication hook: this rank's bucket (a ``dist.GradBucket``) times its weight, summed over the group
    (module docstring); returns the future of the reduced bucket."""
    if bucket.is_last():  # this rank's last gradient is ready: the marks, before the last all-reduce starts
        _call(state._on_ready)
        Variable._execution_engine.queue_callback(lambda: Variable._execution_engine.queue_callback(
            lambda: _call(state._on_reduced, True)))  # the second runs after DDP's finalize_backward
    buffer = bucket.buffer()
    buffer.mul_(state.weight)
    return state.process_group.allreduce([buffer]).get_future().then(_value)
