"""A Hugging Face ``Trainer`` script (GPT-2 from a local config) trained with OmniLearn: ``OmniLearnTrainer``.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --speeds 3,1 --out runs/hf_trainer
    python examples/hf_trainer.py                                   # one process
    torchrun ... examples/hf_trainer.py --max-steps 40 --stop-at 15 --save-steps 15 --output-dir ckpt   # stop
    torchrun ... examples/hf_trainer.py --max-steps 40 --output-dir ckpt --resume                       # go on

Nothing is downloaded: the model is built from a ``GPT2Config`` and the data
is generated here (token sequences padded after a random length, labels
``-100`` there: Trainer's defaults count tokens, ``average_tokens_across_devices``).
OmniLearn lines: 3 (marked ``# OmniLearn``): the import, ``Trainer(`` ->
``OmniLearnTrainer(``, and its ``omnilearn=dict(...)`` settings (the line
may be left out: the defaults balance with Trainer's batch). ``--stop-at`` stops mid-epoch
(a callback) so that ``--resume`` can show the data continuing.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from sequences import Sequences  # the examples' token data (same folder)
from omnilearn.integrations.hf import OmniLearnTrainer  # OmniLearn


class PaddedSequences(Sequences):
    """hf_transformers.py's Markov-chain sequences, padded after a random length (labels -100 there)."""

    def __init__(self, samples: int, length: int = 32, vocab: int = 64, seed: int = 0) -> None:
        super().__init__(samples, length, vocab, seed)
        lengths = torch.from_numpy(np.random.default_rng(seed + 1).integers(length // 2, length + 1, (samples, 1)))
        self.labels = self.x.clone()
        self.labels[torch.arange(length).expand(samples, length) >= lengths] = -100

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.labels[i]}


class StopAt(TrainerCallback):
    """Stop training after ``step`` optimizer steps (an interrupted run, to resume later)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--speeds", help="emulated relative worker speeds, e.g. 3,1 (default: all equal)")
    p.add_argument("--batch", type=int, default=16, help="per_device_train_batch_size")
    p.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: none)")
    p.add_argument("--stop-at", type=int, default=0, help="stop after N steps (an interrupted run)")
    p.add_argument("--resume", action="store_true", help="resume from the last checkpoint in --output-dir")
    p.add_argument("--output-dir", default="runs/hf_trainer_ckpt")
    p.add_argument("--out", help="write an OmniLearn run directory here")
    args = p.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch, per_device_eval_batch_size=32,
        gradient_accumulation_steps=args.accumulation, max_steps=args.max_steps, learning_rate=3e-3,
        lr_scheduler_type="constant", eval_strategy="steps", eval_steps=max(args.max_steps // 2, 1),
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        logging_steps=10, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )
    trainer = OmniLearnTrainer(  # OmniLearn: was Trainer(
        model=GPT2LMHeadModel(config), args=training, train_dataset=PaddedSequences(2048),
        eval_dataset=PaddedSequences(256, seed=1), callbacks=[StopAt(args.stop_at)] if args.stop_at else None,
        omnilearn=dict(speeds=args.speeds, control_interval=5, out=args.out, overwrite=True),  # OmniLearn
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        batches = [log for log in trainer.state.log_history if "omnilearn/batch_rank0" in log]
        print("batches", json.dumps([[v for k, v in b.items() if k.startswith("omnilearn/")] for b in batches]))
        print(f"eval_loss {metrics['eval_loss']:.4f} at step {trainer.state.global_step}")
        if trainer.omnilearn_summary is not None:
            print(f"balance efficiency {trainer.omnilearn_summary['balance_efficiency']:.2f}")


if __name__ == "__main__":
    main()
