"""Gradient accumulation and loss weighting through the public API: exact, whatever the split.

The models are float64, so rounding (about 1e-16) cannot hide a weighting
error; the controller is fed scripted timings (``OMNILEARN_TEST_S_PER_SAMPLE``),
so the splits are the same in every run.

- 3 heterogeneous gloo workers, ``accumulation_steps=3`` (micro-batches of
  unequal size), a batch change that lands in the middle of a control
  window: the weights equal one process training on the global batches
  (relative < 1e-12, about 1e-16 measured; the weights ``b_i / B`` off by
  1% show at 6e-3). The delay emulator runs after every micro-batch's
  backward (3 times per step per rank). ``model.no_sync()`` is refused with
  a message naming the fix (in a real group, also without accumulation).
- A padded token loss (mean over the non-padding tokens): with
  ``ol.backward(loss, count=n_tokens)`` 3 workers (and 1 process with
  accumulation) give the gradient of the mean over every token of the
  global batch (relative < 1e-12 in float64); weighting
  by samples does not (above 1e-3).
- Misuse in one process: too few or too many ``backward`` calls, counts on
  some micro-batches only.

Run: ``python -m pytest -q tests/dist/test_accumulation.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import pytest
from ranks import max_relative, scripted_rank_results
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import omnilearn
from tokendata import PAD, PairData, TokenData, reference

pytestmark = pytest.mark.dist




def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3)).double()


def token_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 16), nn.Linear(16, 11)).double()


def pair_loss(model, x, y):
    return F.cross_entropy(model(x.double()), y)


def token_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=PAD)  # mean over real tokens


def run(ol, model, loader, loss_fn, steps: int, counted: bool, change_at: int | None = None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    while ol.steps_done < steps:
        for micro_batches in loader:
            opt.zero_grad()
            for x, y in micro_batches:
                ol.backward(loss_fn(model, x, y), count=(y != PAD).sum() if counted else None)
            opt.step()
            ol.step()
            if ol.steps_done == change_at:  # a change for the next-but-one step: mid control window
                ol.schedule.change(change_at + 1, (10, 20, 30))
            if ol.steps_done == steps:
                break


def _accumulation_worker(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    result = {}
    plain = omnilearn.setup(global_batch=60, device="cpu")
    try:
        plain.wrap_model(mlp()).no_sync()
    except RuntimeError as e:
        result["no_sync"] = str(e)
    ol = omnilearn.setup(global_batch=60, speeds="4,2,1", control_interval=4, min_batch=6, accumulation_steps=3,
                         device="cpu")
    model = ol.wrap_model(mlp())
    calls, before_sync = [0], ol.emulator.before_sync
    ol.emulator.before_sync = lambda: (calls.__setitem__(0, calls[0] + 1), before_sync())[1]
    run(ol, model, ol.data_loader(PairData()), pair_loss, 12, False, change_at=5)
    result.update(plans=[list(ol.schedule.peek(s)) for s in range(12)], before_sync=calls[0],
                  weights={k: v.detach() for k, v in ol.module.state_dict().items()})
    ol.finish()
    for counted in (True, False):
        tok = omnilearn.setup(global_batch=60, speeds="4,2,1", min_batch=6, accumulation_steps=2, device="cpu")
        model = tok.wrap_model(token_model())
        run(tok, model, tok.data_loader(TokenData()), token_loss, 6, counted, change_at=2)
        result["tokens" if counted else "tokens_by_samples"] = {k: v.detach() for k, v in
                                                                tok.module.state_dict().items()}
        tok.finish()
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("accumulation")
    return scripted_rank_results(_accumulation_worker, (str(out / "store"), str(out)), out)


def test_three_heterogeneous_workers_accumulating_equal_one_process(three_workers):
    plans = [tuple(p) for p in three_workers[0]["plans"]]
    assert plans[6] == (10, 20, 30) != plans[5]  # a change landed mid-window (steps 4..7)
    assert all(sum(p) == 60 for p in plans)
    expected = reference(mlp(), PairData(), pair_loss, 60, 12)
    for r, got in enumerate(three_workers):
        assert max_relative(got["weights"], expected) < 1e-12, f"rank {r}: {max_relative(got['weights'], expected):.2e}"
        assert got["before_sync"] == 12 * 3  # after both local backwards and in the hook (or its mark), every step


def test_no_sync_is_refused_with_the_fix(three_workers):
    message = three_workers[0]["no_sync"]
    assert "model.no_sync() is not supported" in message
    assert "accumulation_steps=K" in message and "ol.backward(loss)" in message


EXACT_F64 = 1e-12  # float64 throughout (the hook's count weight is float64 too)


def test_padded_token_loss_weighted_by_count_equals_one_process(three_workers):
    expected = reference(token_model(), TokenData(), token_loss, 60, 6)
    for r, got in enumerate(three_workers):
        rel = max_relative(got["tokens"], expected)
        assert rel < EXACT_F64, f"rank {r}: {rel:.2e}"
        assert max_relative(got["tokens_by_samples"], expected) > 1e-3  # weighting by samples is not the token mean
    ol = omnilearn.setup(global_batch=60, accumulation_steps=3, min_batch=6, device="cpu",
                         handle_signals=False)  # one process: no hook
    model = ol.wrap_model(token_model())
    run(ol, model, ol.data_loader(TokenData()), token_loss, 6, True)
    assert max_relative({k: v.detach() for k, v in model.state_dict().items()}, expected) < EXACT_F64


def test_micro_batch_misuse_is_an_error():
    ol = omnilearn.setup(global_batch=12, accumulation_steps=2, min_batch=2, device="cpu")
    model = ol.wrap_model(nn.Linear(6, 3))
    it = iter(ol.data_loader(PairData()))
    micro_batches = next(it)
    assert len(micro_batches) == 2 and [len(x) for x, _ in micro_batches] == [6, 6]
    ol.backward(F.cross_entropy(model(micro_batches[0][0]), micro_batches[0][1]))
    with pytest.raises(RuntimeError, match=r"ol.step\(\) after 1 of 2 ol.backward\(\) calls"):
        ol.step()
    ol.backward(F.cross_entropy(model(micro_batches[1][0]), micro_batches[1][1]))
    with pytest.raises(RuntimeError, match="called 3 times in one step, but accumulation_steps=2"):
        ol.backward(F.cross_entropy(model(micro_batches[1][0]), micro_batches[1][1]))
    ol.step()
    x, y = next(it)[0]
    ol.backward(F.cross_entropy(model(x), y))
    with pytest.raises(RuntimeError, match="give count for every micro-batch of a step or for none"):
        ol.backward(F.cross_entropy(model(x), y), count=6)
