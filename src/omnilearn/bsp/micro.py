"""``ol.backward(loss, count=None)``: gradient accumulation and loss weighting, exact.

The global batch ``B`` is per optimizer step. Worker ``i`` trains its share
``b_i`` as ``k = accumulation_steps`` micro-batches of ``m_ij`` samples
(:func:`~omnilearn.data.plan.micro_sizes`); the loader hands out the ``k``
micro-batches of a step together, and the user calls ``ol.backward(loss)``
once per micro-batch, then ``optimizer.step()`` and ``ol.step()``.

Sample weighting (default): micro-batch ``j``'s mean loss is scaled by
``m_ij / b_i`` and the worker's sum is weighted by ``b_i / B``, so the
update is ``sum_ij (m_ij / B) g_ij``, the gradient of the mean loss over the
global batch, whatever the split, the plan or ``k``. The first factor
scales the loss here; the second is the rank's weight, applied once to the
accumulated gradients at the reduction (DDP's comm hook,
:mod:`omnilearn.bsp.backward`; FSDP2's weighted reduce-scatter,
:mod:`omnilearn.bsp.sharded`).

Count weighting (``count=``, e.g. the non-padding tokens a token loss
averages over): the mean over a micro-batch's terms is scaled by
``n_ij / c_i`` (``c_i = k * max(n_i0, 1)``, any positive constant works; this
one keeps the scale near ``1 / k``); at the last micro-batch one all-reduce
sums ``N = sum_ij n_ij`` over DDP's group and the worker's weight becomes
``c_i / N`` (applied at the reduction, as above): the update is the mean
over every term of the global batch.
The counts stay on the device (no host sync). Use it on every rank at the
same steps (the all-reduce is a collective); a micro-batch with count 0
must still have a finite loss (it is scaled by 0). A step whose counts are
0 on every rank (``N = 0``: nothing to average) gets a zero gradient, not a
division by zero: the weight divides by ``max(N, 1)``, and ``optimizer.step()``
then moves only by what the optimizer adds itself (momentum, weight decay);
the step's logged loss is NaN (a mean over no term).

A worker whose share is above its memory cap (:mod:`omnilearn.bsp.memory`)
runs the step as more micro-batches than ``k``: :meth:`MicroSteps.split`
sets this step's sizes (also to redo a step after an out-of-memory error).
The weighting above holds for any sizes, and ranks may run different
numbers of micro-batches in one step: each syncs once, on its last.

DDP decides at *forward* time whether the next backward syncs, so the
session sets ``require_backward_grad_sync`` before each micro-batch's
forward: off after a step starts (k > 1), on once ``k - 1`` backwards are
done. A loop that runs every micro-batch's forward first and then the
backwards would never run a syncing forward (each forward ran before the
backwards that turn the sync on): the replicas would part silently. The
last ``ol.backward`` of a step checks that a syncing forward ran in it
(``HookState.synced``) and refuses, before back-propagating, in one line
naming the supported order. A sharded model (FSDP2, :mod:`omnilearn.bsp.sharded`) is told the
same through ``set_requires_gradient_sync``; its weighted reduce-scatter
applies the hook's weight. After each non-syncing backward the delay emulator may sleep (a slow
worker is slow on every micro-batch); the syncing one sleeps in the hook.

Run: ``python -m pytest -q tests/dist/test_accumulation.py``
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.bsp import sharded
from omnilearn.data.plan import micro_sizes
from omnilearn.bsp.backward import HookState


class MicroSteps:
    """The micro-batches of the open step: how many were back-propagated and with which scale."""

    def __init__(self, steps: int, global_batch: int, hook: HookState,
                 sum_counts: Callable[[torch.Tensor], torch.Tensor],
                 after_local_backward: Callable[[], object]) -> None:
        self.steps, self.global_batch, self.hook = steps, global_batch, hook
        self.sum_counts = sum_counts  # all-reduce over DDP's group (identity for one process)
        self.after_local_backward = after_local_backward  # the delay emulator
        self.model: nn.Module | None = None
        self.set_sharded_sync: Callable[[bool], None] | None = None  # FSDP2's gradient sync, set on a change
        self.reduced = False  # whether the model's reduction applies hook.weight (DDP, or FSDP2 on several ranks)
        self.ddp = False  # the model is DDP (its forward decides whether the backward syncs)
        self.batch = 0  # the open step's share (none yet)
        self.begin(global_batch)

    def use_model(self, model: nn.Module, grouped: bool, world_size: int) -> None:
        """The wrapped model: how its gradients are reduced (see the module docstring)."""
        self.model = model
        self.set_sharded_sync = sharded.gradient_sync(model) if sharded.is_sharded(model) else None
        # FSDP2 on one rank copies instead of reduce-scattering: the weight is applied to the gradients then
        self.reduced = grouped and (world_size > 1 or self.set_sharded_sync is None)
        self.ddp = isinstance(model, DDP)
        self.split(self.planned)

    def begin(self, batch: int) -> None:
        """A step with this worker's share ``batch`` starts (as the loader's ``accumulation_steps`` micro-batches)."""
        if batch != self.batch or self.steps != 1:  # else the plan is (batch,) already
            self.batch, self.planned = batch, micro_sizes(batch, self.steps)
        self.split(self.planned)

    def split(self, sizes: tuple[int, ...]) -> None:
        """Run the open step as micro-batches of ``sizes`` (summing to the share); resets what was done of it."""
        if sizes is not self.planned and (sum(sizes) != self.batch or min(sizes) < 1):
            raise ValueError(f"micro-batches of {list(sizes)} samples do not make this step's share of {self.batch}")
        self.sizes, self.done = tuple(sizes), 0
        self.counts: list[torch.Tensor] | None = None
        self.base: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None
        hook = self.hook
        hook.weight = self.batch / self.global_batch
        hook.synced = False
        sync = len(sizes) == 1
        if not self.ddp or self.model.require_backward_grad_sync is not sync:  # DDP in sync: nothing to set
            self._sync_next_forward(sync)

    def syncing(self) -> bool:
        """Whether the next (or current) backward reduces the gradients (DDP or FSDP2, the step's last micro-batch)."""
        if sharded.is_sharded(self.model):
            return self.done == len(self.sizes) - 1
        return isinstance(self.model, DDP) and bool(self.model.require_backward_grad_sync)

    def _calls(self) -> str:
        k = len(self.sizes)
        return (f"accumulation_steps={k}" if self.sizes == self.planned else
                f"this step runs as {k} micro-batches (its share is above this worker's memory cap)")

    def _sync_next_forward(self, sync: bool) -> None:
        if self.ddp:  # (nn.Module's __setattr__ costs every step: set only a change)
            if self.model.require_backward_grad_sync is not sync:
                self.model.require_backward_grad_sync = sync
        elif self.set_sharded_sync is not None:
            self.set_sharded_sync(sync)

    def backward(self, loss: torch.Tensor, count: int | float | torch.Tensor | None = None) -> None:
        """Back-propagate micro-batch ``done``'s mean ``loss`` with its weight (see the module docstring)."""
        j, k = self.done, len(self.sizes)
        if j >= k:
            raise RuntimeError(f"ol.backward() called {j + 1} times in one step, but {self._calls()}: one "
                               f"call per micro-batch, then optimizer.step() and ol.step()")
        last = j == k - 1
        if last and self.ddp and not self.hook.synced and self.model.require_backward_grad_sync:
            raise RuntimeError(f"ol.backward(): the last micro-batch's forward ran before the syncing point (all "
                               f"forwards first, then the backwards?), so DDP would not combine this step's gradients "
                               f"across workers and the replicas would part: with {self._calls()} run each micro-batch's "
                               "forward and then its ol.backward(loss), in turn")
        if count is None and self.counts is None:
            share: float | torch.Tensor = self.sizes[j] / self.batch
        else:
            share = self._count_scale(j, count, loss, last)
        (loss if isinstance(share, float) and share == 1.0 else loss * share).backward()
        if self.counts is not None and last and not self.reduced:
            self._rescale_local_grads()
        self.done += 1
        part = loss.detach() * (share if self.counts is None else self.counts[-1])
        self.loss = part if self.loss is None else self.loss + part
        if not last:
            self.after_local_backward()
            if j + 1 == k - 1:
                self._sync_next_forward(True)

    def _count_scale(self, j: int, count, loss: torch.Tensor, last: bool) -> torch.Tensor:
        if count is None or (self.counts is None and j > 0):
            raise RuntimeError("ol.backward(loss, count=...): give count for every micro-batch of a step or for none")
        n = torch.as_tensor(count, dtype=torch.float64, device=loss.device).detach().reshape(())
        if self.counts is None:
            self.counts, self.base = [], len(self.sizes) * torch.clamp(n, min=1.0)
        self.counts.append(n)
        if last:
            total = self.sum_counts(torch.stack(self.counts).sum().reshape(1)).reshape(())
            # N = 0 (no term in the whole global batch): every scale above was 0, so the step's gradient is zero
            self.hook.weight = self.base / torch.clamp(total, min=1.0)  # 0-dim float64: no host sync, exact in float64
        return (n / self.base).to(loss.dtype)

    def _rescale_local_grads(self) -> None:
        """One process, no hook: apply the hook's factor ``c / N`` to the gradients directly."""
        if self.model is None:
            raise RuntimeError("ol.backward(loss, count=...) needs the model: call ol.wrap_model() first")
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.mul_(self.hook.weight.to(p.grad.device, p.grad.dtype).item() if sharded.is_sharded(self.model)
                            else self.hook.weight.to(p.grad.device, p.grad.dtype))

    def finish(self) -> torch.Tensor | None:
        """The step ends: check every micro-batch was back-propagated; the step's weighted loss (or None)."""
        k = len(self.sizes)
        if self.done != k and (k > 1 or self.counts is not None):
            raise RuntimeError(f"ol.step() after {self.done} of {k} ol.backward() calls: {self._calls()}; call "
                               f"ol.backward(loss) once for each micro-batch (this step's gradients were not "
                               f"combined across workers as they should be)")
        if self.done == 0:
            return None
        return self.loss / torch.stack(self.counts).sum().to(self.loss.dtype) if self.counts is not None else self.loss
