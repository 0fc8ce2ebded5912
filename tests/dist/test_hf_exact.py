"""``OmniLearnTrainer`` (a ``transformers.Trainer``) on 3 heterogeneous gloo ranks equals one process, float64.

Each rank is a real process started with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``...): accelerate makes the process group from
it, OmniLearn joins it. A 1-layer GPT-2 in float64, padded labels (-100),
Trainer's defaults (``average_tokens_across_devices=True``, AdamW, gradient
clipping at 1.0), ``gradient_accumulation_steps=2``, a global batch of 24.
The controller is fed scripted timings as speeds 4,2,1, so the split moves
at the first control interval (the test checks it did).

- 3 ranks, 7 steps (4 per epoch): the weights equal one process's (max abs diff < 1e-12;
  about 1e-16 measured) and so does the sharded evaluation's ``eval_loss``.
- Resume: the 3 ranks stop after step 3 (a callback), the ``save_steps=3``
  checkpoint holds the session; a new trainer resumes it and runs to 7:
  the weights equal the uninterrupted run's, and one process resuming the
  same checkpoint (another world size) equals it too.
- A custom ``accelerate`` loop with OmniLearn's lines (docs/huggingface.md):
  3 ranks equal one process, and equal the Trainer's run.
- Refusals: ``fp16``, ``ignore_data_skip`` and a checkpoint without session
  state each raise one line.

Run: ``python -m pytest -q tests/dist/test_hf_exact.py`` (about 30 s on 2 cores).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import pytest
from needs import needs
from ranks import free_port, scripted_rank_results
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import omnilearn
from omnilearn.config import ConfigError

if TYPE_CHECKING:
    from transformers import GPT2LMHeadModel

    from omnilearn.integrations.hf import OmniLearnTrainer

# transformers and accelerate are imported where they are used: every pytest-xdist worker collects this file
pytestmark = [pytest.mark.dist, needs("transformers", "hf"), needs("accelerate", "hf")]

STEPS, STOP, GLOBAL_BATCH = 7, 3, 24
EXACT_F64 = 1e-12
FLOAT32_LOSS = 1e-6  # transformers' ForCausalLMLoss computes in float32 (logits.float())


class Padded(torch.utils.data.Dataset):
    """``n`` sequences of 8 tokens over a vocabulary of 13, labels -100 after a random length (1 to 8)."""

    def __init__(self, n: int = 96, seed: int = 3) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(13, (n, 8), generator=g)
        self.y = self.x.clone()
        lengths = torch.randint(1, 9, (n, 1), generator=g)
        self.y[torch.arange(8).expand(n, 8) >= lengths] = -100

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.y[i]}


def stop_at():
    """A callback that stops training after step ``STOP``."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= STOP:
                control.should_training_stop = True
            return control

    return StopAt()


def model() -> GPT2LMHeadModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=13, n_positions=8, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).double()


def token_loss_f64(outputs, labels, num_items_in_batch):
    """Trainer's ``compute_loss_func``: the causal LM token loss summed in float64, over ``num_items_in_batch``."""
    logits, targets = outputs.logits[:, :-1], labels[:, 1:]
    total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def trainer(out: str, stop: bool = False, f64_loss: bool = True, **arguments) -> OmniLearnTrainer:
    from transformers import TrainingArguments

    from omnilearn.integrations.hf import OmniLearnTrainer

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                             gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-2,
                             lr_scheduler_type="constant", save_strategy="steps" if stop else "no", save_steps=STOP,
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0, **arguments)
    return OmniLearnTrainer(model=model(), args=args, train_dataset=Padded(), eval_dataset=Padded(40, seed=4),
                            callbacks=[stop_at()] if stop else None,
                            compute_loss_func=token_loss_f64 if f64_loss else None,
                            omnilearn=dict(global_batch=GLOBAL_BATCH, control_interval=3, min_batch=2))


def accelerate_loop() -> dict[str, torch.Tensor]:
    """A custom ``accelerate`` loop with OmniLearn's lines, as docs/huggingface.md shows them (same run as above)."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # makes (or finds) the process group, as before
    ol = omnilearn.setup(global_batch=GLOBAL_BATCH, accumulation_steps=2, control_interval=3, min_batch=2)
    net = ol.wrap_model(model())  # instead of accelerator.prepare(model)
    loader = ol.data_loader(Padded())  # instead of accelerator.prepare(DataLoader(...))
    optimizer = accelerator.prepare(torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0))
    while ol.steps_done < STEPS:
        for micro_batches in loader:
            for batch in micro_batches:
                labels = batch["labels"].to(ol.device)
                count = labels[:, 1:].ne(-100).sum()
                loss = token_loss_f64(net(input_ids=batch["input_ids"].to(ol.device)), labels, count.clamp(min=1))
                ol.backward(loss, count=count)  # instead of accelerator.backward(loss)
            accelerator.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            ol.step()
            if ol.steps_done == STEPS:
                break
    ol.finish()
    return {k: v.detach().clone() for k, v in ol.module.state_dict().items()}


def weights(t: OmniLearnTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.session.module.state_dict().items()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result = {}
    full = trainer(f"{out}/full")
    full.train()
    result.update(weights=weights(full), eval=full.evaluate()["eval_loss"],
                  plans=[list(full.session.schedule.peek(s)) for s in range(STEPS)])
    model_loss = trainer(f"{out}/model_loss", f64_loss=False)
    model_loss.train()
    result.update(model_loss=weights(model_loss))
    trainer(f"{out}/ckpt", stop=True).train()
    resumed = trainer(f"{out}/ckpt")
    resumed.train(resume_from_checkpoint=True)
    result.update(resumed=weights(resumed), resumed_step=resumed.state.global_step, accelerate=accelerate_loop())
    torch.save(result, f"{out}/rank{rank}.pt")
    from omnilearn.distributed import group
    group.destroy()


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_exact")
    return out, scripted_rank_results(_worker, (3, free_port(), str(out)), out)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    t = trainer(str(tmp_path_factory.mktemp("hf_one")))
    t.train()
    model_loss = trainer(str(tmp_path_factory.mktemp("hf_one_model_loss")), f64_loss=False)
    model_loss.train()
    return weights(t), t.evaluate()["eval_loss"], weights(model_loss), accelerate_loop()


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


def test_three_heterogeneous_ranks_accumulating_equal_one_process(three_ranks, one_process):
    _, ranks = three_ranks
    plans = [tuple(p) for p in ranks[0]["plans"]]
    assert len(set(plans)) > 1 and plans[0] == (8, 8, 8), f"the split never moved: {plans}"
    assert all(sum(p) == GLOBAL_BATCH for p in plans)
    expected, eval_loss, model_loss, accelerate_one = one_process
    assert next(iter(expected.values())).dtype == torch.float64
    for r, got in enumerate(ranks):
        print(f"rank {r}: max abs diff {max_diff(got['weights'], expected):.1e} (float64 loss), "
              f"{max_diff(got['model_loss'], model_loss):.1e} (the model's float32 loss)")
        assert max_diff(got["weights"], expected) < EXACT_F64, f"rank {r}: {max_diff(got['weights'], expected):.2e}"
        assert got["eval"] == pytest.approx(eval_loss, rel=1e-9, abs=0)  # sharded, gathered: the same mean
        assert max_diff(got["accelerate"], accelerate_one) < EXACT_F64, f"rank {r}: the accelerate loop"
        assert max_diff(accelerate_one, expected) < EXACT_F64  # the same run as the Trainer's
        # the model's own loss (no compute_loss_func) upcasts the logits to float32: equal to float32 rounding
        assert max_diff(got["model_loss"], model_loss) < FLOAT32_LOSS, f"rank {r}: {max_diff(got['model_loss'], model_loss):.2e}"


def test_resume_mid_epoch_continues_as_an_uninterrupted_run(three_ranks, one_process):
    from omnilearn.integrations.hf import SESSION_FILE

    out, ranks = three_ranks
    assert (out / "ckpt" / f"checkpoint-{STOP}" / SESSION_FILE).is_file()
    for r, got in enumerate(ranks):
        assert got["resumed_step"] == STEPS
        print(f"rank {r}: resumed vs uninterrupted max abs diff {max_diff(got['resumed'], got['weights']):.1e}")
        assert max_diff(got["resumed"], got["weights"]) < EXACT_F64, f"rank {r}"
    elastic = trainer(str(out / "ckpt"))  # one process resumes the 3 ranks' checkpoint
    elastic.train(resume_from_checkpoint=str(out / "ckpt" / f"checkpoint-{STOP}"))
    assert elastic.session.resumed_from == (STOP, 3)
    print(f"3 ranks -> 1 process: max abs diff {max_diff(weights(elastic), one_process[0]):.1e}")
    assert max_diff(weights(elastic), one_process[0]) < EXACT_F64


def test_wrong_settings_are_refused_in_one_line(tmp_path):
    from transformers import TrainingArguments

    from omnilearn.integrations.hf import SESSION_FILE, OmniLearnTrainer

    with pytest.raises(ConfigError, match="fp16=True"):
        OmniLearnTrainer(model=model().float(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                                       fp16=True, report_to=[]))
    with pytest.raises(ConfigError, match="ignore_data_skip=True"):
        trainer(str(tmp_path), ignore_data_skip=True)
    (tmp_path / "checkpoint-1").mkdir()
    plain = trainer(str(tmp_path))
    with pytest.raises(ConfigError, match=f"has no {SESSION_FILE}"):
        plain._load_from_checkpoint(str(tmp_path / "checkpoint-1"))
