"""A Hugging Face Trainer script for tests/faults/test_rescue_hf.py: ``OmniLearnTrainer`` resumed after a kill.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 tests/faults/hf_rescue_script.py OUT [RANK:STEP]

The float64 1-layer GPT-2 and padded data of tests/dist/test_hf_exact.py, the static split, no periodic
checkpoint (``save_strategy="no"``): a restart has only what the survivors saved. ``train(resume_from_checkpoint=
True)`` when OUT holds a complete checkpoint folder. In the first attempt rank RANK SIGKILLs itself at the end of
step STEP (``global_step == STEP``). Each attempt's rank 0 writes ``OUT/attempt-<k>.json`` (the step it started
at, when the process started and its first step ended), the killed rank ``OUT/kill-0.json``; the last writes
``OUT/final.pt``.

Run: ``python -m pytest -q tests/faults/test_rescue_hf.py``
"""

from __future__ import annotations

import time

T0 = time.time()  # before the imports: a restarted attempt's start-up is measured from here

import json
import os
import signal
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "dist")]  # tests/ (needs, ranks) and the exact test's model

import torch  # noqa: E402
from test_hf_exact import Padded, model, token_loss_f64  # noqa: E402
from transformers import TrainerCallback, TrainingArguments  # noqa: E402

from omnilearn.integrations import hf_checkpoint  # noqa: E402
from omnilearn.integrations.hf import OmniLearnTrainer  # noqa: E402

STEPS = 8


class KillAt(TrainerCallback):
    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", "0")) == self.rank and state.global_step == self.step:
            (Path(args.output_dir) / "kill-0.json").write_text(json.dumps({"at": time.time(), "step": self.step}))
            os.kill(os.getpid(), signal.SIGKILL)
        return control


class FirstStep(TrainerCallback):
    """When this attempt's first step ended (rank 0 writes it with the attempt's record)."""

    at: float | None = None

    def on_step_end(self, args, state, control, **kwargs):
        self.at = self.at or time.time()
        return control


def main(out: Path, kill: str | None) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                             max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant", save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    first = FirstStep()
    callbacks = [first] + ([KillAt(*map(int, kill.split(":")))] if kill and attempt == 0 else [])
    trainer = OmniLearnTrainer(model=model(), args=args, train_dataset=Padded(), callbacks=callbacks,
                               compute_loss_func=token_loss_f64,
                               omnilearn=dict(global_batch=16, control_interval=3, controller="static"))
    found = [p for p in out.glob("checkpoint-*") if hf_checkpoint.complete(p)]
    trainer.train(resume_from_checkpoint=True if found else None)
    if trainer.session.is_main:
        start = trainer.session.resumed_from[0] if trainer.session.resumed_from else 0
        record = {"start": start, "world": trainer.session.world_size, "t0": T0, "first_step": first.at}
        (out / f"attempt-{attempt}.json").write_text(json.dumps(record))
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)
