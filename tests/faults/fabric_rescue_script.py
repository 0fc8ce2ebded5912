"""A Lightning Fabric loop for tests/faults/test_rescue_lightning.py: ``OmniLearnFabricStrategy`` resumed after a kill.

    torchrun --standalone --nproc-per-node 3 --max-restarts 1 tests/faults/fabric_rescue_script.py OUT [RANK:STEP]

The float64 MLP and data of tests/dist/test_lightning_exact.py, accumulation 2, the static split; the loop calls
``strategy.save_on_failure(OUT/ckpt.pt, state)`` and ``fabric.load(OUT/ckpt.pt, state)`` at its start when the file
is there, and never saves: a restart has only what a survivor wrote there. In the first attempt rank RANK SIGKILLs itself after step STEP. Rank 0 of each attempt
writes ``OUT/attempt-<k>.json`` (the step it started at, its world size); the last attempt ``OUT/final.pt``.

Run: ``python -m pytest -q tests/faults/test_rescue_lightning.py``
"""

from __future__ import annotations

import json
import os
import signal
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "dist")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.fabric import Fabric  # noqa: E402
from test_lightning_exact import GLOBAL_BATCH, K, LR, data, mlp  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from omnilearn.integrations.lightning_fabric import OmniLearnFabricStrategy  # noqa: E402

STEPS = 10


def main(out: Path, kill: str | None) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, step = map(int, kill.split(":")) if kill and attempt == 0 else (None, None)
    strategy = OmniLearnFabricStrategy(global_batch=GLOBAL_BATCH, controller="static", control_interval=3,
                                       min_batch=4, accumulation_steps=K, total_steps=STEPS)
    model = mlp()
    torch.set_default_dtype(torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric = Fabric(strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        precision="64-true")
        fabric.launch()
        model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        train = fabric.setup_dataloaders(DataLoader(data(), batch_size=16, shuffle=True))
        state = {"model": model, "optimizer": opt}
        strategy.save_on_failure(out / "ckpt.pt", state)  # a peer dies: a survivor writes the last step there
        if (out / "ckpt.pt").exists():
            fabric.load(out / "ckpt.pt", state)
        session = strategy.session
        start = session.next_step
        while session.steps_done < STEPS:
            for i, (x, y) in enumerate(train):
                accumulating = (i + 1) % K != 0
                with fabric.no_backward_sync(model, enabled=accumulating):
                    fabric.backward(F.cross_entropy(model(x), y))
                if not accumulating:
                    opt.step()
                    opt.zero_grad()
                    if fabric.global_rank == rank and session.next_step == step:
                        os.kill(os.getpid(), signal.SIGKILL)
    session.finish()
    if fabric.global_rank == 0:
        (out / f"attempt-{attempt}.json").write_text(json.dumps({"start": start, "world": fabric.world_size}))
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, out / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
