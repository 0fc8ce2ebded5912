"""A Lightning script for tests/faults/test_rescue_lightning.py: ``OmniLearnStrategy`` resumed after a kill.

    torchrun --standalone --nproc-per-node 3 --max-restarts 1 tests/faults/lightning_rescue_script.py OUT [RANK:STEP]

The float64 MLP, data and SGD with momentum of tests/dist/test_lightning_exact.py, ``accumulate_grad_batches=2``
(a peer's death fails the second micro-batch's backward, one micro-batch into the next step), the static split,
an ``OnExceptionCheckpoint`` and no periodic checkpoint: a restart has only what the survivors saved, and
``fit(ckpt_path="last")`` takes it. In the first attempt rank RANK SIGKILLs itself at the end of step STEP. Each
attempt's rank 0 writes ``OUT/attempt-<k>.json`` (the step it started at, its world size, when the process started
and its first step ended), the killed rank ``OUT/kill-0.json``; the last attempt ``OUT/final.pt``.

Run: ``python -m pytest -q tests/faults/test_rescue_lightning.py``
"""

from __future__ import annotations

import time

T0 = time.time()  # before the imports: a restarted attempt's start-up is measured from here

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "dist")]  # tests/ (needs, ranks) and the exact test's model

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import OnExceptionCheckpoint  # noqa: E402
from test_lightning_exact import GLOBAL_BATCH, K, Net, loaders  # noqa: E402

from omnilearn.integrations.lightning import OmniLearnStrategy  # noqa: E402

STEPS = 10


class KillAt(pl.Callback):
    def __init__(self, rank: int, step: int, out: Path) -> None:
        self.rank, self.step, self.out = rank, step, out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            (self.out / "kill-0.json").write_text(json.dumps({"at": time.time(), "step": self.step}))
            os.kill(os.getpid(), signal.SIGKILL)


class FirstStep(pl.Callback):
    """Where this attempt started and when its first step ended."""

    start: int | None = None
    at: float | None = None

    def on_train_start(self, trainer, pl_module):
        self.start = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.at is None and trainer.global_step > self.start:
            self.at = time.time()


def main(out: Path, kill: str | None) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    world = int(os.environ["WORLD_SIZE"])
    first = FirstStep()
    callbacks = [first, OnExceptionCheckpoint(dirpath=out / "ck")]
    if kill and attempt == 0:
        rank, step = map(int, kill.split(":"))
        callbacks.append(KillAt(rank, step, out))
    strategy = OmniLearnStrategy(global_batch=GLOBAL_BATCH, controller="static", control_interval=3, min_batch=4,
                                 process_group_backend="gloo")
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                         max_steps=STEPS, precision="64-true", accumulate_grad_batches=K, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
                         num_sanity_val_steps=0)
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loaders()[0], ckpt_path="last")
    if trainer.global_rank == 0:
        record = {"start": first.start, "world": world, "t0": T0, "first_step": first.at}
        (out / f"attempt-{attempt}.json").write_text(json.dumps(record))
        torch.save({k: v.detach().clone() for k, v in model.net.state_dict().items()}, out / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
