"""What the exactness matrix combines: the data, the tiny model and the shapes of what it returns, the loss forms.

A shape (:data:`SHAPES`) packs the model's prediction ``y``, its hidden
activations ``[h1, h]`` and, for the shapes that compute their loss inside
(as Hugging Face models do from ``labels=``), that loss. A loss form
(:data:`LOSSES`) turns ``(model, the raw module, x, targets)`` into the
loss of a batch: the per-sample (or, for ``tokens``, per-token) mean over
that batch, so that one process's loss over the global batch is the loss
every cell must reproduce. One line per shape, one line per loss form.

"A loss computed inside the model" is the shapes ``loss_tuple`` and
``model_output``: with them, every loss form's criterion (``mean``, ``sum``,
``tokens``) runs in the model's forward from ``labels=`` and the terms
added outside (penalty, auxiliary, input gradient) come on top.

See :mod:`exactness.matrix` for the matrix itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.utils import ModelOutput

from tokendata import PAD, TokenData

FEATURES, HIDDEN, VOCAB = 6, 16, 11
SAMPLES = 64  # one epoch: 4 global batches of 16
AUX_WEIGHT = 0.01  # the auxiliary loss a module keeps as an attribute
PENALTY_WEIGHT = 1e-3  # the penalty on the parameters, added once per step
INPUT_GRAD_WEIGHT = 0.1  # the input-gradient penalty


@dataclass
class PlainOutput:
    """A plain dataclass output (not a pytree)."""

    y: torch.Tensor
    h: torch.Tensor


@dataclass
class HFOutput(ModelOutput):
    """A ``transformers`` output: a pytree node, with the loss computed inside the model."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class Shape(NamedTuple):
    """What the model returns: ``pack(y, hidden, loss)``; ``y(out)`` and ``loss(out)`` read it back (loss: None
    when the loss is not computed inside)."""

    pack: Callable[[torch.Tensor, list, Any], Any]
    y: Callable[[Any], torch.Tensor]
    loss: Callable[[Any], Any] | None = None


SHAPES: dict[str, Shape] = {
    "tensor": Shape(lambda y, hs, loss: y, lambda o: o),
    "loss_tuple": Shape(lambda y, hs, loss: (loss, y), lambda o: o[1], lambda o: o[0]),
    "dict_features": Shape(lambda y, hs, loss: {"y": y, "h": hs[-1]}, lambda o: o["y"]),
    "dataclass": Shape(lambda y, hs, loss: PlainOutput(y, hs[-1]), lambda o: o.y),
    "model_output": Shape(lambda y, hs, loss: HFOutput(loss, y, hs[-1]), lambda o: o.logits, lambda o: o.loss),
    "hidden_states": Shape(lambda y, hs, loss: (y, hs), lambda o: o[0]),
    "same_twice": Shape(lambda y, hs, loss: (y, y), lambda o: o[0]),
    "nested": Shape(lambda y, hs, loss: {"out": (y, [hs[-1]])}, lambda o: o["out"][0]),
    "non_tensor": Shape(lambda y, hs, loss: (y, "tag", 3), lambda o: o[0]),
}

CRITERIA: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "mean": F.mse_loss,
    "sum": lambda y, t: F.mse_loss(y, t, reduction="sum") / len(y),  # a sum over the batch, divided: a mean
    "tokens": lambda y, t: F.cross_entropy(y.flatten(0, 1), t.flatten(), ignore_index=PAD),  # over real tokens
}


class Net(nn.Module):
    """Three blocks (``enc``, ``mid``, ``head``: FSDP2 shards each); ``mid`` checkpointed when ``reentrant`` is set
    (True or False: ``use_reentrant``). Built from seed 0: every cell and its reference start alike."""

    def __init__(self, shape: str, criterion: str, dtype: torch.dtype = torch.float64,
                 reentrant: bool | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        tokens = criterion == "tokens"
        self.enc = nn.Embedding(VOCAB, HIDDEN) if tokens else nn.Linear(FEATURES, HIDDEN)
        self.mid = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
        self.head = nn.Linear(HIDDEN, VOCAB if tokens else FEATURES)
        self.to(dtype)
        self.shape, self.criterion, self.reentrant = SHAPES[shape], CRITERIA[criterion], reentrant
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        h1 = torch.tanh(self.enc(x))
        h = self.mid(h1) if self.reentrant is None else checkpoint(self.mid, h1, use_reentrant=self.reentrant)
        y = self.head(h)
        self.aux = AUX_WEIGHT * h.square().flatten(1).mean(1).mean()  # a per-sample mean, kept for the loss
        return self.shape.pack(y, [h1, h], None if labels is None else self.criterion(y, labels))


class Data(torch.utils.data.Dataset):
    """Items ``(x, target, index)``: regression pairs (float64), or padded token sequences (``tokens``)."""

    def __init__(self, tokens: bool) -> None:
        if tokens:
            base = TokenData(n=SAMPLES, vocab=VOCAB)
            self.x, self.t = base.x, base.y
        else:
            g = torch.Generator().manual_seed(1)
            self.x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
            self.t = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int):
        return self.x[i], self.t[i], i


def base_loss(model: nn.Module, net: Net, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's criterion (computed inside the model for the shapes that do) and the prediction ``y``."""
    shape = net.shape
    out = model(x, labels=t) if shape.loss is not None else model(x)
    y = shape.y(out)
    return (shape.loss(out) if shape.loss is not None else net.criterion(y, t)), y


def with_penalty(model, net, x, t):
    """The criterion plus a penalty on the parameters (the same on every rank: once per step)."""
    return base_loss(model, net, x, t)[0] + PENALTY_WEIGHT * sum(p.square().sum() for p in net.parameters())


def with_aux(model, net, x, t):
    """The criterion plus the auxiliary loss the module kept as an attribute during its forward."""
    loss = base_loss(model, net, x, t)[0]
    return loss + net.aux


def with_input_grad(model, net, x, t):
    """The criterion plus the mean squared norm of the prediction's gradient with respect to each input."""
    x = x.detach().requires_grad_(True)
    loss, y = base_loss(model, net, x, t)
    (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    return loss + INPUT_GRAD_WEIGHT * g.square().sum(1).mean()


def applied_twice(model, net, x, t):
    """``model(model(x))`` (the model is square): the second call gets the labels."""
    y1 = net.shape.y(model(x))
    return base_loss(model, net, y1, t)[0]


def two_forwards(model, net, x, t):
    """Two forwards summed, ``model(x)`` and ``model(x')``, before one backward."""
    other = (x + 1) % VOCAB if x.dtype == torch.long else 0.5 * x
    return base_loss(model, net, x, t)[0] + base_loss(model, net, other, t)[0]


class Loss(NamedTuple):
    """A loss form: its criterion (what :class:`Net` computes inside) and ``loss(model, net, x, t)``."""

    criterion: str
    fn: Callable[..., torch.Tensor]


LOSSES: dict[str, Loss] = {
    "mean": Loss("mean", lambda model, net, x, t: base_loss(model, net, x, t)[0]),
    "sum": Loss("sum", lambda model, net, x, t: base_loss(model, net, x, t)[0]),
    "tokens": Loss("tokens", lambda model, net, x, t: base_loss(model, net, x, t)[0]),  # with count=
    "penalty": Loss("mean", with_penalty),
    "aux": Loss("mean", with_aux),
    "input_grad": Loss("mean", with_input_grad),
    "applied_twice": Loss("mean", applied_twice),
    "two_forwards": Loss("mean", two_forwards),
}


def token_count(t: torch.Tensor) -> torch.Tensor:
    """The loss terms of a token batch: its non-padding targets."""
    return (t != PAD).sum()
