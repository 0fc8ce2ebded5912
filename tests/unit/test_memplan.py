"""The memory plan's policy (:mod:`omnilearn.balance.memplan`) and its byte counting (:mod:`omnilearn.bsp.membytes`).

- ``memory`` in every accepted form (bytes, units, per worker, auto) and each mistake as one line naming the value;
- a cap from counted needs, and the one line when the state alone does not fit;
- the caps checked against min_batch and (FSDP2) the global batch, each naming the fix;
- counting: parameters, gradients and AdamW state; activations as the most held at once (one micro-batch's, not
  the sum of the step's), linear in the batch;
- one process with ``memory=``: the plan's line and the cap; refusals (CPU auto, with max_batch auto, ASP,
  TensorFlow, a count that does not match the workers).

Run: ``python -m pytest -q tests/unit/test_memplan.py``
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import omnilearn
from omnilearn.balance import memplan
from omnilearn.bsp import membytes
from omnilearn.config import BalanceConfig, ConfigError


@pytest.mark.parametrize("given, parsed", [
    (None, None), ("auto", "auto"), (" AUTO ", "auto"), (4096, 4096), ("4KiB", 4096), ("1.5GiB", 3 * 2**29),
    ("16GB,80GB", (16 * 10**9, 80 * 10**9)), (["48MiB", 192 * 2**20], (48 * 2**20, 192 * 2**20)), ("12", 12),
])
def test_memory_in_every_form(given, parsed):
    assert memplan.parse_memory(given) == parsed
    assert BalanceConfig(memory=given).memory == parsed


@pytest.mark.parametrize("given", ["foo", "4 parsecs", "0", "-1GiB", [], [True], "4GiB,", 0])
def test_a_bad_memory_is_one_line_naming_it(given):
    with pytest.raises(ConfigError) as e:
        BalanceConfig(memory=given)
    message = str(e.value)
    assert "\n" not in message and message.startswith("--memory ") and "16GiB,80GiB" in message


def test_a_cap_from_counted_needs_and_the_state_that_does_not_fit():
    needs = memplan.Needs(state=10_000, block=2_000, per_sample=1_000.0)
    assert memplan.cap(100_000, needs, 0) == int((85_000 - 12_000) // 1_000)
    with pytest.raises(memplan.PlanError) as e:
        memplan.cap(14_000, needs, 1)
    message = str(e.value)
    assert "\n" not in message and message.startswith("rank 1: memory 13.67KiB (--memory) holds no sample")
    assert "9.766KiB" in message and "more workers" in message
    assert memplan.rank_memory((1, 2), 1, 2) == 2 and memplan.rank_memory(5, 3, 4) == 5
    with pytest.raises(memplan.PlanError, match="gives 2 sizes for 3 workers"):
        memplan.rank_memory((1, 2), 0, 3)


def test_caps_below_min_batch_or_short_of_the_global_batch_under_fsdp2_name_the_fix():
    assert memplan.caps_problem([10, 200], 60, 6, 1, sharded=True) is None
    assert memplan.caps_problem([0, 0], 60, 6, 1, sharded=True) is None  # no caps
    low = memplan.caps_problem([4, 200], 60, 6, 1, sharded=False)
    assert low.endswith("rank 0's memory holds 4 samples a step (counted), below min_batch=6: give min_batch=4, "
                        "or the rank more memory")
    short = memplan.caps_problem([14, 14], 32, 4, 1, sharded=True)
    assert "holds 28 samples a step" in short and short.endswith("give accumulation_steps=2, or a smaller global_batch")
    assert memplan.caps_problem([14, 14], 32, 4, 1, sharded=False) is None  # DDP splits a rank's share itself


def test_state_bytes_count_parameters_gradients_and_adamw_state_once():
    model = nn.Linear(10, 10)  # 110 numbers
    opt = torch.optim.AdamW(model.parameters())
    assert membytes.state_bytes(model, [opt]) == 110 * 4
    model(torch.ones(3, 10)).sum().backward()
    opt.step()
    assert membytes.state_bytes(model, [opt]) == 4 * 110 * 4  # parameters, gradients, two moments
    assert membytes.block_bytes(model) == 0  # not sharded


def test_activations_are_the_most_held_at_once_and_linear_in_the_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    peaks = {}
    for b in (4, 8):
        with membytes.SavedBytes() as saved:
            model(torch.randn(b, 8)).sum().backward()
        peaks[b] = saved.peak
    assert peaks[8] == 2 * peaks[4] > 0  # no parameter, no view of one: only what grows with the batch
    with membytes.SavedBytes() as saved:
        for _ in range(3):  # three micro-batches: each backward lets its activations go
            model(torch.randn(4, 8)).sum().backward()
    assert saved.peak == peaks[4] and saved.now == 0


def _train(ol, steps: int = 2) -> None:
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    torch.manual_seed(0)
    model = ol.wrap_model(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(ol.data_loader(data)):
        opt.zero_grad()
        ol.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        ol.step()
        if i + 1 == steps:
            break


def test_one_process_says_its_plan_in_one_line_and_caps_itself(capsys):
    ol = omnilearn.setup(global_batch=16, memory="8KiB", device="cpu", handle_signals=False)
    _train(ol)
    needs = ol.probe_needs
    assert needs.state == 2 * (8 * 32 + 32 + 32 * 4 + 4) * 4 and needs.block == 0
    assert ol.max_batch == memplan.cap(8192, needs, 0)
    ol.finish()
    lines = [line for line in capsys.readouterr().err.splitlines() if "memory plan" in line]
    assert lines == [f"omnilearn: memory plan, rank 0: 8KiB: a full replica ({memplan.human(needs.state)} of state), largest block 0B, "
                     f"{memplan.human(needs.per_sample)} a sample -> at most {ol.max_batch} samples a micro-batch"]


@pytest.mark.parametrize("settings, words", [
    ({"memory": "auto"}, 'memory="auto" measures a CUDA device, and rank 0 computes on cpu'),
    ({"memory": "1GiB", "max_batch": "auto"}, 'max_batch="auto" and memory= both set'),
    ({"memory": [2**30, 2**30]}, "gives 2 sizes for 1 workers"),
    ({"memory": "1KiB"}, "rank 0: memory 1KiB (--memory) holds no sample"),
])
def test_what_cannot_be_planned_is_refused_in_one_line(settings, words):
    ol = omnilearn.setup(global_batch=16, device="cpu", handle_signals=False, **settings)
    with pytest.raises(ConfigError) as e:
        _train(ol)
    ol.finish()
    assert words in str(e.value) and "\n" not in str(e.value)


def test_asp_and_tensorflow_refuse_memory_in_one_line():
    from omnilearn.experiments.config import TrainConfig

    with pytest.raises(ConfigError, match="--memory is for --mode bsp; give --max-batch <samples> in asp"):
        TrainConfig(workers=2, mode="asp", memory="1GiB")
    with pytest.raises(ConfigError, match="--framework tensorflow has no --memory yet"):
        TrainConfig(workers=2, framework="tensorflow", memory="1GiB")
