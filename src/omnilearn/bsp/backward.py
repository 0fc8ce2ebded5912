"""The weighted backward on DDP's own C++ path: no Python per gradient bucket.

DDP averages the gradients of its ``n`` ranks (its C++ reducer divides
each gradient by ``n`` as it copies it into a bucket, and all-reduces with
its built-in hook). With unequal batches the exact global-batch gradient is
``g = sum_i (b_i / B) g_i``; so each rank's backward is scaled by
``n b_i / B`` (DESIGN.md, "the weighting") and DDP's own mean is the
weighted sum. Where the scale is applied:

- ``ol.backward(loss)`` (and ``run_step``, the doors): the loss itself, with
  the micro-batch's share (:mod:`omnilearn.bsp.micro`): every term of it,
  however it reaches the parameters;
- a plain ``loss.backward()``: the gradient flowing into the model's outputs
  (a hook on each output tensor that needs a gradient, installed by the
  step's syncing forward, :meth:`BackwardMarks.on_output`). Every loss term
  computed from the outputs is weighted; a term that reaches the parameters
  another way (a penalty on the weights, an auxiliary loss a module keeps as
  an attribute) is averaged as plain DDP averages it. A penalty on the
  weights is the same on every rank, so its average is itself, as in the
  exact sum; a rank's own auxiliary term is not weighted: use
  ``ol.backward(loss)`` for it (docs/guide.md).

A model whose output holds no tensor that needs a gradient (a type that is
not a pytree) cannot be weighted that way: ``ol.step()`` raises, naming
``ol.backward(loss)``.

The compute/wait split needs the moment this rank's last gradient is
ready, and the delay emulator must sleep there, before DDP launches the last
bucket's all-reduce. On the first syncing backward a hook on every parameter
learns which one's gradient comes last; from then on one hook on that
parameter calls ``on_ready``. Where the emulator may sleep (``HookState.delayed``)
it is ``register_post_accumulate_grad_hook``, which runs before DDP's own hook
on the same parameter; the output hook or that hook queues an engine callback
for the end of the backward graph (a step whose learned parameter got no
gradient marks ready there), and that callback queues another, which the
autograd engine runs after DDP's ``finalize_backward`` (queued in between,
when the last bucket was launched): the reductions are done, or on CUDA the
stream waits for them, and ``on_reduced`` marks it. Where nothing sleeps
(a real run) the hook is a post hook of the parameter's ``AccumulateGrad``
node, registered after DDP's: it runs once DDP has launched the last bucket
and queued ``finalize_backward``, marks ready (the launch is this rank's own
work) and queues the reduced mark itself: two calls from the engine, of which
only the reduced mark waits for the reductions, instead of three, two of them
on the way of the last bucket. That needs the last gradient to come from the
same parameter every step: a model with ``find_unused_parameters=True``
(a graph that changes) keeps the first way.
Per step: one call per output tensor, one parameter hook, one or two engine
callbacks, and one multiplication of the output's gradient (none after
``ol.backward``). At equal shares (scale 1, nothing to balance) the outputs
are not hooked at all once the last-ready parameter is learned (and should
its hook ever miss a step, a parameter the graph did not reach, the outputs
are hooked from then on).

Under ``torch.compile`` (docs/compile.md) the hooks are the same: the
output hook goes on the compiled forward's output (registered by dynamo's
replay of :meth:`BackwardMarks.on_output` when the wrapped model itself is
compiled); the parameter hook and the engine callbacks run outside any
graph (compiled autograd, which would trace them, is not supported).

``torch.autograd.Variable._execution_engine.queue_callback`` is private
(DDP and FSDP use it themselves); tests/unit/test_torch_private_names.py
holds it to that.

Run: ``python -m pytest -q tests/dist/test_hooks.py tests/dist/test_api.py tests/dist/test_compile.py``
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

import torch
from torch.autograd import Variable
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_leaves


class _Callback:
    """A callback attribute: a bound method is kept as a weak reference to its object and its function (None once
    the object is gone), so the model (which holds the marks and their state) never keeps the session that set it
    alive. The hooks call it through :func:`_call` (no descriptor, no ``WeakMethod`` per call: they run every step)."""

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
    """What the backward's hooks read each step; the session sets it when a step starts.

    ``process_group``: the group DDP reduces over (None: the default group). ``weight``: this worker's share of
    the step's gradient, ``b_i / B``, or ``count_i / sum(count)`` for token losses (then a 0-dim tensor on the
    device, so reading it never synchronises): FSDP2's weighted reduce-scatter applies it
    (:mod:`omnilearn.bsp.sharded`). ``output_scale``: ``n b_i / B`` for DDP's mean (None while ``ol.backward``
    runs: the loss is scaled already). ``weighted``: this step's gradient got its weight; ``unhooked``: the type
    of a syncing forward's output that held no tensor to hook. ``on_ready()`` / ``on_reduced(last)``: the
    marks (module docstring); ``on_mark()``: the ready mark alone, where nothing sleeps (default: ``on_ready``);
    bound methods are held weakly. ``delayed``: the delay emulator may sleep at the
    ready mark (it must come before DDP launches the last bucket).
    """

    on_ready = _Callback()
    on_mark = _Callback()
    on_reduced = _Callback()

    def __init__(self, process_group: Any = None, weight: Any = 1.0, on_ready: Callable[[], None] | None = None,
                 on_reduced: Callable[[bool], None] | None = None, on_mark: Callable[[], None] | None = None) -> None:
        self.process_group, self.weight = process_group, weight
        self.output_scale: float | None = None
        self.weighted = False
        self.unhooked: str | None = None
        self.delayed = False
        self.on_ready, self.on_reduced = on_ready, on_reduced
        self.on_mark = on_ready if on_mark is None else on_mark


def _grad_leaves(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.requires_grad else []
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


class BackwardMarks:
    """Per step of a :class:`~omnilearn.bsp.wrap.BalancedDDP` model: the output scale, ready and reduced marks."""

    def __init__(self, state: HookState, params: list[torch.nn.Parameter], static: bool = True) -> None:
        self.state = state
        self.params = [p for p in params if p.requires_grad]
        self.handles: list = []
        self.last: torch.nn.Parameter | None = None  # the parameter whose gradient is ready last (learned)
        self.static = static  # the last gradient comes from the same parameter every step (module docstring)
        self.early = True  # the learned parameter's hook runs before DDP's (else after, on its AccumulateGrad node)
        self.node = None  # that node (held: the hook lives on it)
        self.order: list[int] | None = None  # while learning: parameters in the order their gradients came
        self.armed = self.queued = False  # a syncing forward ran; its end-of-graph callback is queued
        self.always = False  # hook the outputs even at scale 1 (the learned parameter once missed a step)

    def on_output(self, out) -> None:
        """A syncing forward's output (grad enabled): hook the gradients flowing into it (not needed at equal
        shares once the last-ready parameter is learned: its hook queues the end-of-graph callback then)."""
        leaves = ([out] if out.requires_grad else []) if type(out) is torch.Tensor else _grad_leaves(out)
        state = self.state
        if not leaves:
            state.unhooked = type(out).__name__
            return
        if self.armed:  # the last syncing backward marked nothing: the learned parameter can miss a step
            self.always = True
        self.armed, self.queued = True, False
        if self.last is not None and self.early is not (state.delayed or not self.static):
            self._hook_last()  # the emulator started or stopped sleeping
        if state.output_scale == 1.0 and self.last is not None and not self.always:
            state.weighted = True  # equal shares: DDP's mean is the weighted sum as it is
            return
        for t in leaves:
            t.register_hook(self._output_grad)
        if self.last is None and self.order is None:
            self.order = []
            self.handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: self.order.append(i))
                            for i, p in enumerate(self.params)]

    def _output_grad(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self._end_of_graph)
        scale = self.state.output_scale
        if scale is None:  # ol.backward scaled the loss itself
            return grad
        self.state.weighted = True
        return grad if scale == 1.0 else grad * scale  # 1.0: equal shares, DDP's mean is the weighted sum

    def _last_grad(self, _param) -> None:
        if self.armed:
            self._ready()
            if not self.queued:  # no output hook this step: the end-of-graph callback from here (before DDP's)
                self.queued = True
                Variable._execution_engine.queue_callback(self._end_of_graph)

    def _last_grad_late(self, _grad_inputs, _grad_outputs) -> None:
        if self.armed:
            self._ready(self.state._on_mark)  # nothing sleeps here (the hook is after DDP's)
            if not self.queued:  # after DDP's hook: finalize_backward is queued, the reduced mark comes after it
                self.queued = True
                Variable._execution_engine.queue_callback(self._reduced)

    def _ready(self, mark: tuple | None = None) -> None:
        """The ready mark, once a step: ``on_ready`` (the emulator, then the timer), or ``mark`` (a slot)."""
        self.armed = False
        _call(self.state._on_ready if mark is None else mark)

    def _end_of_graph(self) -> None:
        if self.order is not None:
            self._learned()
        if self.armed:  # the learned parameter got no gradient this step (or this was the learning step)
            self._ready()
        Variable._execution_engine.queue_callback(self._reduced)  # runs after DDP's finalize_backward

    def _learned(self) -> None:
        order, self.order = self.order, None
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if order:
            self.last = self.params[order[-1]]
            self._hook_last()

    def _hook_last(self) -> None:
        """The learned parameter's hook: before DDP's where the emulator may sleep there (or the graph changes),
        else after it (module docstring)."""
        for handle in self.handles:
            handle.remove()
        self.early = self.state.delayed or not self.static
        if self.early:
            self.node, self.handles = None, [self.last.register_post_accumulate_grad_hook(self._last_grad)]
        else:
            self.node = get_gradient_edge(self.last).node  # DDP's reducer hooked this node at its construction
            self.handles = [self.node.register_hook(self._last_grad_late)]

    def _reduced(self) -> None:
        _call(self.state._on_reduced, True)

    def remove(self) -> None:
        """Take the parameter hooks off (the model lets go of its group: :func:`omnilearn.bsp.wrap.release`)."""
        for handle in self.handles:
            handle.remove()
        self.handles, self.order, self.armed, self.node = [], None, False, None
