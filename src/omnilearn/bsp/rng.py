"""Per-rank random streams: seeded from ``(seed, rank)``, captured and restored as plain state.

Every rank must start from the same weights (DDP broadcasts rank 0's at
wrapping) but must NOT draw the same random numbers while training: equal
dropout masks or augmentations on every rank would make N workers see one
noise sample N times. :func:`seed_rank` seeds torch (CPU and CUDA), numpy's
global generator and Python's ``random`` from ``(seed, rank)``; the session
calls it right after wrapping the model. :func:`rng_state` /
:func:`load_rng_state` capture and restore the three as tensors, ints and
lists (the ``Stateful`` shape of ``torch.distributed.checkpoint``).

Run: ``python -m pytest -q tests/unit/test_session_state.py``
"""

from __future__ import annotations

import random

import numpy as np
import torch

_SALT = 0x6F6D6E69  # keeps the rank streams apart from a user's own ``manual_seed(seed)``


def rank_seed(seed: int, rank: int) -> int:
    """A 63-bit seed for ``rank`` derived from ``seed`` (distinct per rank, reproducible)."""
    return int(np.random.SeedSequence([seed, rank, _SALT]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def seed_rank(seed: int, rank: int) -> None:
    """Seed torch (all devices), numpy's global generator and ``random`` for this rank."""
    s = rank_seed(seed, rank)
    torch.manual_seed(s)
    np.random.seed(s % 2**32)
    random.seed(s)


def rng_state(device: torch.device) -> dict:
    """This process's random state: torch CPU (and ``device``'s CUDA generator), numpy, ``random``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "gauss": float(gauss)},
        "random": {"version": int(version), "internal": torch.tensor(internal, dtype=torch.int64),
                   "gauss_next": [] if gauss_next is None else [float(gauss_next)]},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def load_rng_state(state: dict, device: torch.device) -> None:
    """Restore :func:`rng_state` (a CUDA state only onto a CUDA device)."""
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                         float(n["gauss"])))
    r = state["random"]
    gauss = r["gauss_next"][0] if r["gauss_next"] else None
    random.setstate((int(r["version"]), tuple(int(v) for v in r["internal"].tolist()), gauss))
