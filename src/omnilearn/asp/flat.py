"""A model's parameters and floating buffers as one float32 vector: the wire format of ASP.

The server sends ``state()`` (weights, then BatchNorm statistics); a worker
loads it, computes, and sends ``gradients_and_buffers()``; the server loads
that with ``load(flat, grads=True)`` (the gradients into ``.grad``, the
worker's buffers over its own) and takes an optimizer step.

Run its tests: ``python -m pytest -q tests/dist/test_asp_server.py``
"""

from __future__ import annotations

import torch
from torch import nn


class Flat:
    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.n_params = sum(p.numel() for p in self.params)
        self.size = self.n_params + sum(b.numel() for b in self.buffers)

    def state(self) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in self.params + self.buffers])

    def gradients_and_buffers(self) -> torch.Tensor:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in grads + self.buffers])

    @torch.no_grad()
    def load(self, flat: torch.Tensor, grads: bool = False) -> None:
        """Copy ``flat`` into the parameters (or, ``grads``, into their ``.grad``) and the buffers."""
        if flat.numel() != self.size:
            raise ValueError(f"a flat state of {flat.numel()} values for a model of {self.size}")
        offset = 0
        for t in self.params + self.buffers:
            part = flat[offset : offset + t.numel()].view_as(t).to(t.device, t.dtype)
            offset += t.numel()
            if grads and offset <= self.n_params:
                t.grad = part.clone()
            else:
                t.copy_(part)
