"""The token data of the language-model examples (nothing downloaded): sequences of a Markov chain.

Each token follows the previous one by a fixed rule 90% of the time, so a model's loss can fall far below
ln(vocab). Used by ``hf_transformers.py``, ``hf_trainer.py`` and ``fsdp_transformer.py`` (same folder).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class Sequences(Dataset):
    """Token sequences of a Markov chain with a clear next-token rule (the loss can fall far below ln(vocab))."""

    def __init__(self, samples: int, length: int = 32, vocab: int = 64, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        x = np.empty((samples, length), dtype=np.int64)
        x[:, 0] = rng.integers(0, vocab, samples)
        for t in range(1, length):
            follow = rng.random(samples) < 0.9
            x[:, t] = np.where(follow, (x[:, t - 1] * 5 + 3) % vocab, rng.integers(0, vocab, samples))
        self.x = torch.from_numpy(x)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i]
