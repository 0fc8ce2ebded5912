"""Small datasets shared by the accumulation, memory, FSDP and GPU tests, and the one-process reference run that
the exactness tests compare with (importable: tests/ is on sys.path)."""

from __future__ import annotations

import torch

PAD = -100  # cross_entropy's default ignore_index


class TokenData(torch.utils.data.Dataset):
    """Sequences of ``length`` tokens, padded after a random length; the target is the next token id."""

    def __init__(self, n: int = 240, length: int = 8, vocab: int = 11) -> None:
        g = torch.Generator().manual_seed(2)
        self.x = torch.randint(vocab, (n, length), generator=g)
        self.y = (self.x + 1) % vocab
        lengths = torch.randint(1, length + 1, (n, 1), generator=g)
        self.y[torch.arange(length).expand(n, length) >= lengths] = PAD

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class PairData(torch.utils.data.Dataset):
    """``n`` random (6 features, one of 3 classes) samples, the same for every seed of the test process."""

    def __init__(self, n: int = 240) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randint(3, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def reference(model: torch.nn.Module, data, loss_fn, global_batch: int, steps: int,
              momentum: float = 0.0) -> dict[str, torch.Tensor]:
    """One process, no OmniLearn: SGD (lr 0.1) on the global batches of the loader's plan (seed 0); the weights."""
    from omnilearn.data.plan import GlobalPlan

    plan = GlobalPlan(len(data), global_batch, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    for step in range(steps):
        idx = plan.step_indices(step)
        opt.zero_grad()
        loss_fn(model, data.x[idx], data.y[idx]).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
