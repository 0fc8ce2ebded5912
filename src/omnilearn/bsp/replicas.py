"""Replicas that part are caught: a fingerprint of the parameters rides on every window's meeting.

Under DDP every rank holds a replica of the model, and every step must
leave all replicas equal: the same reduced gradient, the same optimizer
step. A rank that back-propagates without syncing (a forward run under
``no_sync`` or before the previous micro-batch's backward, a second
backward after the syncing one), steps its optimizer alone, or skips a step
(a ``continue`` before ``optimizer.step()``, a GradScaler skip on one rank)
leaves its replica apart, and nothing in DDP notices: training goes on,
each rank on its own model.

:func:`fingerprint` reduces the parameters to two float64 numbers: the sum
of their squares, and the same sum weighted by each tensor's position (so a
difference that moves between tensors shows too), computed in one fused
pass (``torch._foreach_norm``, the kernel ``clip_grad_norm_`` uses; private:
tests/unit/test_torch_private_names.py holds it). The window meetings carry
them (:class:`~omnilearn.bsp.interval.Meeting`: two more numbers in the
all-gather that already happens at every window's end and at
``sync_buffers()``/``finish()``; no collective of its own, nothing on a
quiet step), and :func:`parted` compares every rank's with rank 0's: a
relative difference above :data:`PARTED_REL` makes every rank raise the
same one-line error naming the ranks and the likely causes. DDP replicas are
equal to the bit after a synced step; the tolerance only allows the sum's
own rounding (a reduction order that differs between GPU generations),
some 1e-16. On CUDA reading the numbers waits for the device, once a
window, where the window's step times are read too.

A sharded model (FSDP2) holds no replica (each rank its own shards), and
one process has nothing to compare: neither is fingerprinted.

Run: ``python -m pytest -q tests/unit/test_replica_fingerprint.py tests/exactness``
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

PARTED_REL = 1e-9  # relative difference of the fingerprints that counts as parted replicas
WIDTH = 2  # numbers a fingerprint adds to a meeting's row
NONE = (0.0, 0.0)  # no fingerprint (a sharded model, one process, a check within the window)


def fingerprint(model: nn.Module) -> tuple[float, float]:
    """``(sum of squares, position-weighted sum of squares)`` of ``model``'s parameters, in float64."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in model.parameters():
        groups.setdefault((p.device, p.dtype), []).append(p.detach())
    total = weighted = 0.0
    position = 1
    for tensors in groups.values():
        squares = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).square()
        ranks = torch.arange(position, position + len(tensors), dtype=torch.float64, device=squares.device)
        position += len(tensors)
        pair = torch.stack([squares.sum(), (squares * ranks).sum()]).tolist()
        total, weighted = total + pair[0], weighted + pair[1]
    return total, weighted


def parted(prints: Sequence[Sequence[float]]) -> list[int]:
    """The ranks whose fingerprint differs from rank 0's (none where rank 0 sent none)."""
    ref = prints[0]
    if tuple(ref) == NONE:
        return []
    scale = [max(abs(v), 1e-300) for v in ref]
    return [r for r, fp in enumerate(prints)
            if any(abs(a - b) > PARTED_REL * s for a, b, s in zip(fp, ref, scale))]


def parted_error(ranks: list[int], where: str) -> RuntimeError:
    """The one line every rank raises when replicas parted."""
    return RuntimeError(
        f"the model on rank(s) {ranks} differs from rank 0's at {where}: the replicas parted (a backward that did "
        "not sync: a forward under no_sync() or before the previous micro-batch's backward, a second backward in "
        "one step; an optimizer stepped on some ranks only; a step skipped on some ranks, e.g. a GradScaler skip "
        "or a 'continue' before optimizer.step()); run every rank's step alike, its gradients synced by "
        "loss.backward() or ol.backward(loss) after a forward of the wrapped model")
