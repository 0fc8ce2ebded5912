"""A worker's memory: its batch cap, micro-batches within it, out-of-memory recovery, the CUDA probe.

Each rank has a *cap*: the most samples it runs in one forward/backward.
It starts at the configured ``max_batch`` (one number, or this rank's entry
of a per-worker list). An out-of-memory error lowers it for good (half the
micro-batch that failed); on CUDA with ``max_batch="auto"``
:class:`CudaProbe` measures the first :data:`PROBE_STEPS` steps and the cap
is the best of their estimates (the first step's one-off allocations make
its estimate low, so a later probe may raise it). The session reports the
learned cap (times ``accumulation_steps``: a share of ``K x cap`` still fits
in ``K`` micro-batches) at every control-interval end; the
:class:`~omnilearn.balance.loop.ControlLoop` then plans within it, effective
a few steps later. Until then a planned share above the cap runs as more
micro-batches: :func:`split_sizes` cuts each of the loader's micro-batches
into as few nearly equal parts of at most ``cap`` as it takes, and
:func:`split_batch` cuts the collated tensors along their first dimension;
:class:`~omnilearn.bsp.micro.MicroSteps` weights part ``j`` by ``m_j / b_i``
as always, so the update is the same whatever the split.

:func:`attempt` runs a step's micro-batches through the user's function and
``ol.backward`` and turns ``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError``
is the same class) into a :class:`Failure`, after which the frames holding
the failed attempt's activations are gone; the session then clears the
gradients, resets DDP's reducer where needed (below), empties the CUDA
cache, lowers the cap and redoes the step
(:meth:`~omnilearn.bsp.session.Session.run_step`). An error in a forward, or
in a backward that does not sync (not the step's last micro-batch), is
recoverable: no gradient left the rank. One in the *syncing* backward under
DDP is not (some gradient buckets may be in flight while the peers wait in
their all-reduce): the session raises a clear error naming the cap to set.
Nor is any under FSDP2 (every forward and backward meets the peers). Such
an error is this rank's alone: the session announces it, and every peer
ends at once naming this rank (:mod:`omnilearn.distributed.failures`).

Resetting DDP's reducer (:class:`ReducerResets`). When the error came after
DDP's forward had announced a syncing backward (the loss failed after
``model(x)``), the reducer expects that backward's gradients, and the
redo's non-syncing backwards would all-reduce: this rank calls
``reducer._reset_state()`` (what DDP's own ``_update_process_group`` calls).
That also re-arms DDP's one-off bucket rebuild on this rank alone: its next
syncing backward would queue the gradients' order and its next forward
would broadcast new bucket indices from rank 0, a collective no peer joins
(gloo errors or hangs, NCCL hangs). So the rank keeps a *reset pending*
flag and, after each step's backward until the next window meeting,
resets again (dropping what that backward queued); the meeting's row
carries the flag (:func:`~omnilearn.decisions.table_row`), and if any
rank's is set every rank resets after that same step: from then on all
rebuild their buckets together, at the same forward. No collective is added
per step. An error before DDP's forward ran (the emulated one below), or
inside it, needs no reset and leaves the reducer alone; a reset before the
first rebuild, or between a collective reset and its rebuild, sets no flag
(every rank is still to rebuild).

Tests emulate a cap on CPU: ``OMNILEARN_FAULT_OOM=<rank>:<samples>[,<rank>:<samples>...]``
makes every training forward (gradients on) of that rank's wrapped model
with more than ``samples`` samples raise ``torch.OutOfMemoryError`` before it
starts (:func:`emulate_oom`, a forward pre-hook), so it is always recoverable.

Why one file over 300 lines: the caps, the out-of-memory redo and the CUDA probe share one state (each rank's
learned cap) and one protocol with the other ranks; this keeps it in one reading.

Run: ``python -m pytest -q tests/unit/test_memory.py tests/dist/test_oom.py``
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from omnilearn.bsp.micro import MicroSteps
from omnilearn.data.plan import micro_sizes

FAULT_OOM_ENV = "OMNILEARN_FAULT_OOM"
PROBE_MARGIN = 0.15  # of the device memory the CUDA probe leaves free (allocator fragmentation, other tenants)
PROBE_STEPS = 3  # steps the CUDA probe measures: the first has one-off allocations, the best estimate counts


def rank_cap(max_batch: int | tuple[int, ...] | str | None, rank: int) -> int | None:
    """This rank's configured cap: one for all, its entry of a per-worker tuple, or None (none, or "auto")."""
    if isinstance(max_batch, tuple):
        return max_batch[rank]
    return max_batch if isinstance(max_batch, int) else None


def split_sizes(sizes: Sequence[int], cap: int | None) -> tuple[int, ...]:
    """Each micro-batch size cut into as few nearly equal parts of at most ``cap`` as it takes, in order."""
    out: list[int] = []
    for m in sizes:
        out.extend(micro_sizes(m, 1 if cap is None or m <= cap else -(-m // cap)))
    return tuple(out)


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Cut a collated batch of ``sum(sizes)`` samples into consecutive parts of ``sizes`` along dimension 0.

    Tensors whose first dimension is the batch are sliced (views, no copy);
    tuples, lists and dicts are cut element-wise; anything else is shared by
    every part. A batch with no such tensor cannot be cut: ``ValueError``.
    """
    if len(sizes) == 1:
        return [batch]
    total, found = sum(sizes), [False]

    def cut(obj: Any, start: int, stop: int) -> Any:
        if torch.is_tensor(obj) and obj.dim() > 0 and obj.shape[0] == total:
            found[0] = True
            return obj[start:stop]
        if isinstance(obj, dict):
            return type(obj)((k, cut(v, start, stop)) for k, v in obj.items())
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*(cut(v, start, stop) for v in obj))
        if isinstance(obj, (list, tuple)):
            return type(obj)(cut(v, start, stop) for v in obj)
        return obj

    parts, start = [], 0
    for size in sizes:
        parts.append(cut(batch, start, start + size))
        start += size
    if not found[0]:
        raise ValueError(f"cannot cut this batch into micro-batches of {list(sizes)} samples: it holds no tensor of "
                         f"{total} rows (a worker above its memory cap runs its share as micro-batches)")
    return parts


def lowered_cap(failed: int) -> int:
    """The cap after a micro-batch of ``failed`` samples ran out of memory: half of it."""
    if failed <= 1:
        raise ValueError("a single sample does not fit in memory")
    return failed // 2


@dataclass(frozen=True)
class Failure:
    """An out-of-memory error in a step: the micro-batch's size, where, and whether that backward syncs."""

    size: int
    phase: str  # "forward" (the user's function) or "backward"
    syncing: bool  # DDP was to all-reduce in this backward
    message: str


def attempt(micro: MicroSteps, fn: Callable[[Any], Any], parts: Sequence[Any]) -> Failure | None:
    """Forward (``fn(part)`` returns the mean loss, or ``(loss, count)``) and weighted backward of each part.

    None when the step's every part went through; a :class:`Failure` (and no
    reference to the failed attempt's tensors) on ``torch.OutOfMemoryError``.
    """
    for size, part in zip(micro.sizes, parts):
        phase = "forward"
        try:
            out = fn(part)
            loss, count = out if isinstance(out, tuple) else (out, None)
            phase = "backward"
            micro.backward(loss, count)
        except torch.OutOfMemoryError as e:
            return Failure(size, phase, micro.syncing(), str(e).strip().splitlines()[0][:300] if str(e) else "")
        del out, loss
    return None


class MemoryCap:
    """This rank's cap on the samples of one forward/backward: configured, then learned (see the module docstring)."""

    def __init__(self, configured: int | None, accumulation_steps: int = 1) -> None:
        self.configured, self.accumulation_steps = configured, accumulation_steps
        self.limit: int | None = None  # learned from out-of-memory errors (and a checkpoint): only goes down
        self.probed: int | None = None  # the CUDA probe's best estimate so far: a later probe may raise it

    @property
    def cap(self) -> int | None:
        """The most samples one micro-batch may have (None: no cap)."""
        caps = [c for c in (self.configured, self.limit, self.probed) if c is not None]
        return min(caps) if caps else None

    @property
    def fixed(self) -> int | None:
        """The cap without the probe's: configured or learned from an error (FSDP2 splits a share only at these;
        a probed cap reaches its shares through the planner at the next interval end)."""
        caps = [c for c in (self.configured, self.limit) if c is not None]
        return min(caps) if caps else None

    def reported(self) -> int | None:
        """The largest share the planner should give this rank beyond the configured caps (None: no more cap)."""
        caps = [c for c in (self.limit, self.probed) if c is not None]
        return min(caps) * self.accumulation_steps if caps else None

    def learn(self, cap: int) -> None:
        self.limit = cap if self.limit is None else min(self.limit, cap)

    def probe(self, cap: int) -> None:
        """A CUDA probe's cap: the best of the probes so far (the first step's one-off allocations make it low)."""
        self.probed = cap if self.probed is None else max(self.probed, cap)

    def lower(self, failed: int) -> tuple[int | None, int]:
        """A micro-batch of ``failed`` samples ran out of memory: (the cap before, the cap now)."""
        old = self.cap
        self.learn(lowered_cap(failed))
        return old, self.cap

    def after(self, failure: Failure, where: str) -> str:
        """Lower the cap after ``failure`` and say so (one line), or raise when the step cannot be redone."""
        size = failure.size
        if size <= 1 or (failure.syncing and failure.phase == "backward"):
            why = ("one sample does not fit" if size <= 1 else "it ran out of memory in the backward that "
                   "all-reduces the gradients, so the peers may hold part of them and the step cannot be redone")
            raise RuntimeError(f"{where}: out of memory on a micro-batch of {size} samples ({failure.message}); {why}. "
                               f"Cap this worker below {size} (max_batch, one number or one per worker), or use "
                               f"accumulation_steps")
        old, new = self.lower(size)
        return (f"{where}: out of memory in the {failure.phase} of a micro-batch of {size} samples; cap "
                f"{'none' if old is None else old} -> {new}, redoing the step as micro-batches of at most {new}")

    def restore(self, planned_cap: int) -> None:
        """A checkpoint's cap of this rank as the planner held it (a share: divided by the micro-batches)."""
        self.learn(max(1, planned_cap // self.accumulation_steps))


def clear_grads(params: Sequence[nn.Parameter], had_grad: Sequence[bool]) -> None:
    """Undo a failed attempt's gradients: zero those that existed before the step, drop the others."""
    for p, had in zip(params, had_grad):
        if p.grad is not None:
            if had:
                p.grad.detach_().zero_()
            else:
                p.grad = None


def cap_from_memory(samples: int, base_bytes: int, peak_bytes: int, capacity_bytes: int,
                    margin: float = PROBE_MARGIN) -> int:
    """Samples that fit: a step of ``samples`` peaked at ``peak_bytes`` above ``base_bytes`` held before it.

    Memory is taken as linear in the batch (``base + per_sample x b``) and
    may grow to ``(1 - margin) x capacity_bytes`` (what the allocator holds
    plus what the device has free). At least 1.
    """
    per_sample = max(peak_bytes - base_bytes, 1) / max(samples, 1)
    return max(1, int(((1.0 - margin) * capacity_bytes - base_bytes) // per_sample))


class CudaMemory:
    """What :class:`CudaProbe` reads: the CUDA allocator's statistics for one device (tests pass a fake)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start(self) -> int:
        """Reset the peak; the bytes allocated now."""
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def capacity(self) -> int:
        """What the device could give: its free memory plus what the allocator holds."""
        free, _ = torch.cuda.mem_get_info(self.device)
        return free + torch.cuda.memory_reserved(self.device)


class CudaProbe:
    """``max_batch="auto"``: measure the peak memory of the first ``steps`` steps and extrapolate a cap from each.

    The first step also allocates the gradients and the optimizer state, once,
    and counts them as per-sample memory: its cap is low. The later steps see
    only what grows with the batch, so :meth:`MemoryCap.probe` keeps the best.
    """

    def __init__(self, device: torch.device, margin: float = PROBE_MARGIN, steps: int = PROBE_STEPS,
                 source: CudaMemory | None = None) -> None:
        if steps < 1:
            raise ValueError(f"CudaProbe(steps={steps}): probe at least 1 step")
        self.source = CudaMemory(device) if source is None else source
        self.margin, self.steps_left, self.base = margin, steps, 0

    @property
    def done(self) -> bool:
        """Whether every step to probe was probed (the session then drops the probe)."""
        return self.steps_left == 0

    def begin(self) -> None:
        self.base = self.source.start()

    def end(self, samples: int) -> int:
        """The cap for micro-batches like the largest one (``samples``) of the step since :meth:`begin`."""
        self.steps_left = max(self.steps_left - 1, 0)
        return cap_from_memory(samples, self.base, self.source.peak(), self.source.capacity(), self.margin)


class ReducerResets:
    """DDP's reducer after an out-of-memory redo, reset so that its bucket rebuild stays collective.

    See "Resetting DDP's reducer" in the module docstring. ``announced``: the
    current micro-batch's DDP forward returned and announced a syncing
    backward (a forward hook); ``pending``: this rank reset alone and resets
    again after each step's backward until the ranks meet (:meth:`met`).
    Without DDP (one process) every method does nothing.
    """

    def __init__(self) -> None:
        self.model: nn.Module | None = None
        self.followed: nn.Module | None = None  # the model whose forwards the hook follows
        self.announced = self.pending = False
        self.fresh = False  # pending since the last meeting's report: left for the next meeting

    def watch(self, model: nn.Module | None, follow: bool = False) -> None:
        """Know ``model``, which a reset acts on (nothing for a model without DDP's reducer); ``follow``: also follow
        its forwards, once per model (``run_step``'s attempts only: a forward hook costs every forward)."""
        if model is None or getattr(model, "reducer", None) is None:
            return
        self.model = model
        if follow and self.followed is not model:
            self.followed = model
            model.register_forward_hook(self._forwarded)

    def _forwarded(self, module: nn.Module, args: Any, output: Any) -> None:
        self.announced = torch.is_grad_enabled() and bool(module.require_backward_grad_sync)

    def begin(self) -> None:
        """An attempt at the step starts: no forward announced yet."""
        self.announced = False

    def after(self, failure: Failure) -> None:
        """A failed attempt: forget its announced backward (its rank alone: pending when buckets were rebuilt)."""
        if failure.phase == "forward" and self.announced:
            lone = bool(getattr(self.model, "_has_rebuilt_buckets", False))
            self.pending |= lone
            self.fresh |= lone
            self._reset()
        self.announced = False

    def step_done(self) -> None:
        """The step's backwards are done (the syncing one finalised): drop what it queued for a lone rebuild."""
        if self.pending:
            self._reset()

    def report(self) -> bool:
        """What this rank tells a window meeting it starts: whether it has a reset pending."""
        self.fresh = False
        return self.pending

    def met(self, any_pending: bool) -> None:
        """The meeting was read: if any rank had a reset pending, every rank resets now. A reset that became
        pending after the meeting started stays pending for the next one."""
        if any_pending and self.model is not None:
            self._reset()
        self.pending = self.fresh

    def _reset(self) -> None:
        self.model.reducer._reset_state()  # no public equivalent
        self.model._has_rebuilt_buckets = False  # DDP's own mirror, kept as its _update_process_group does


def free_memory(device: torch.device) -> None:
    """Give the allocator's unused blocks back after an out-of-memory error (CUDA; nothing elsewhere)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fault_oom_samples(rank: int, spec: str | None = None) -> int | None:
    """The emulated cap ``OMNILEARN_FAULT_OOM`` sets for ``rank`` (None: none)."""
    spec = os.environ.get(FAULT_OOM_ENV, "") if spec is None else spec
    for item in filter(None, (s.strip() for s in spec.split(","))):
        target, _, samples = item.partition(":")
        try:
            target_rank, cap = int(target), int(samples)
        except ValueError:
            raise ValueError(f"{FAULT_OOM_ENV}={spec!r}: expected <rank>:<samples>[,<rank>:<samples>...]") from None
        if target_rank == rank:
            return cap
    return None


def emulate_oom(model: nn.Module, samples: int) -> RemovableHandle:
    """Make a training forward of ``model`` with more than ``samples`` samples raise ``torch.OutOfMemoryError``."""

    def check(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return
        n = next((t.shape[0] for t in _tensors((args, kwargs)) if t.dim() > 0), None)
        if n is not None and n > samples:
            raise torch.OutOfMemoryError(f"emulated out of memory: {n} samples in one forward, above the emulated "
                                         f"cap of {samples} ({FAULT_OOM_ENV})")

    return model.register_forward_pre_hook(check, with_kwargs=True)


def _tensors(obj: Any):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
