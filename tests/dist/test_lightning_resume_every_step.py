"""Lightning (``OmniLearnStrategy``) resumed at every step lands on the uninterrupted path, float64.

tests/dist/lightning_resume_every_step_script.py: an MLP, 3 epochs of 5 optimizer steps (120 samples, global batch
24, a seeded shuffle per epoch), an LR schedule stepped every step (``"interval": "step"``); Adam with
``accumulate_grad_batches=2`` at one and two workers, SGD with momentum and no accumulation at one. The
uninterrupted fit writes a checkpoint at the end of every step (``ModelCheckpoint(every_n_train_steps=1,
save_top_k=-1)``); for every step k of 1..14 (inside an epoch, each epoch's last step 5 and 10, one before and after
them, the last epoch) a fresh Trainer's ``fit(ckpt_path=step=k.ckpt)`` trains to step 15 and ends with:

- at the same worker count, the uninterrupted run's weights bitwise: one worker in this process (both variants),
  two workers (2 gloo ranks, the split moved from 12/12 at step 3 by the controller fed scripted timings);
- at another worker count, relative <= 1e-12: the two workers' checkpoints resumed at one worker in this process,
  and one worker's resumed at two workers, every k both ways.

The uninterrupted runs are one plain process's optimizer and schedule on the same global batches (relative
1e-12), and saving every step changes nothing (one worker, bitwise against a fit that saves none).

Run: ``python -m pytest -q tests/dist/test_lightning_resume_every_step.py``
"""

from __future__ import annotations

import importlib

import pytest
from needs import needs
from ranks import max_relative, scripted_rank_results
import torch

# Lightning is imported where it is used (the script module): every pytest-xdist worker collects this file
pytestmark = [pytest.mark.dist, needs("lightning", "lightning")]

STEPS = 15  # the script's: 3 epochs of 5
EXACT_F64 = 1e-12


@pytest.fixture(scope="module")
def lit():
    return importlib.import_module("lightning_resume_every_step_script")


@pytest.fixture(scope="module")
def one(lit, tmp_path_factory) -> dict:
    """One worker, uninterrupted, each variant: ``{variant: (run, checkpoint directory)}``."""
    runs = {}
    for variant in lit.VARIANTS:
        saved = tmp_path_factory.mktemp(f"one-{variant}")
        runs[variant] = (lit.fit(variant, save_to=saved), saved)
    return runs


@pytest.fixture(scope="module")
def two(lit, one, tmp_path_factory) -> dict:
    """Two ranks: rank 0's uninterrupted run, its resumes (from its own and one worker's checkpoints), its
    checkpoint directory under ``"saved"``."""
    out = tmp_path_factory.mktemp("two")
    results = scripted_rank_results(lit.two_workers, (str(out / "store"), str(out), str(one["adam-k2"][1])), out,
                                    nprocs=2, times=lit.SPEEDS_3_1)
    for name, run in results[1].items():  # the ranks hold the same weights
        assert all(torch.equal(run["weights"][p], results[0][name]["weights"][p]) for p in run["weights"]), name
    return {**results[0], "saved": out / "two"}


def same(resumed: dict, whole: dict, k: int) -> None:
    assert resumed["steps"][:2] == (STEPS, STEPS), resumed["steps"]
    for name, tensor in whole["weights"].items():
        got = resumed["weights"][name]
        assert torch.equal(got, tensor), (k, name, float((got - tensor).abs().max()))


def close(resumed: dict, whole: dict, k: int) -> None:
    assert resumed["steps"][:2] == (STEPS, STEPS), resumed["steps"]
    relative = max_relative(resumed["weights"], whole["weights"])
    assert relative <= EXACT_F64, (k, relative)


def test_the_uninterrupted_runs_are_plain_sgd_and_adam_and_saving_changes_nothing(lit, one, two):
    for variant, (run, saved) in one.items():
        assert run["steps"] == (STEPS, STEPS, 3), run["steps"]
        assert sorted(p.name for p in saved.glob("*.ckpt")) == sorted(f"step={k}.ckpt" for k in range(1, STEPS + 1))
        assert max_relative(run["weights"], lit.reference(variant)) <= EXACT_F64, variant
    same(lit.fit("adam-k2"), one["adam-k2"][0], 0)  # the same fit, saving no checkpoint
    assert two["whole"]["steps"] == (STEPS, STEPS, 3), two["whole"]["steps"]
    plans = two["whole"]["plans"]
    assert plans[0] == (12, 12) and plans[-1][0] > plans[-1][1] and all(sum(p) == 24 for p in plans), plans
    assert max_relative(two["whole"]["weights"], lit.reference("adam-k2")) <= EXACT_F64


@pytest.mark.parametrize("variant", ["adam-k2", "sgd-k1"])
@pytest.mark.parametrize("k", range(1, STEPS))
def test_one_worker_resumed_at_step_k_on_one_worker_is_bitwise_uninterrupted(lit, one, variant, k):
    whole, saved = one[variant]
    same(lit.fit(variant, ckpt=saved / f"step={k}.ckpt"), whole, k)


@pytest.mark.parametrize("k", range(1, STEPS))
def test_two_workers_resumed_at_step_k_on_two_workers_is_bitwise_uninterrupted(two, k):
    same(two[("two", k)], two["whole"], k)


@pytest.mark.parametrize("k", range(1, STEPS))
def test_two_workers_resumed_at_step_k_on_one_worker_is_uninterrupted(lit, two, k):
    close(lit.fit("adam-k2", ckpt=two["saved"] / f"step={k}.ckpt"), two["whole"], k)


@pytest.mark.parametrize("k", range(1, STEPS))
def test_one_worker_resumed_at_step_k_on_two_workers_is_uninterrupted(one, two, k):
    close(two[("one", k)], one["adam-k2"][0], k)
