"""A run record ``omnilearn.setup(out=..., overwrite=True)`` replaces is held until the run resumes it or trains
without it (:mod:`omnilearn.observe.heldrun`): the same command re-run after a preemption keeps its record.

- The script of a user (one process, the public API) stopped after step 6 and re-run as the same command
  (``overwrite=True``, ``ol.load_checkpoint``, whether before or after ``data_loader``): the record holds steps 0-11
  once each (the steps before the stop kept), the resume event in between, nothing held is left behind.
- Re-run without a checkpoint to resume: a fresh record (the old steps gone), nothing held left.
- The pieces: an earlier attempt's held record is kept over what a later attempt wrote; the held lines go back
  before the lines written since, a line cut by a kill dropped.

Run: ``python -m pytest -q tests/unit/test_heldrun.py``
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import omnilearn
from omnilearn.observe import heldrun
from omnilearn.observe.metrics import read_metrics


def script(tmp_path, stop_at: int | None, resume: bool, load_first: bool = False) -> None:
    """The user's script: 2 epochs of 6 steps; ``stop_at``: save there and stop (a preemption's stop path)."""
    ol = omnilearn.setup(global_batch=16, device="cpu", handle_signals=False, seed=0, control_interval=3,
                         out=str(tmp_path / "run"), overwrite=True)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 5, generator=g), torch.randn(96, 1, generator=g))
    model = ol.wrap_model(torch.nn.Linear(5, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if resume and load_first:
        assert ol.load_checkpoint(tmp_path / "ckpt", model=ol.module, optimizer=opt)
    loader = ol.data_loader(data)
    if resume and not load_first:
        assert ol.load_checkpoint(tmp_path / "ckpt", model=ol.module, optimizer=opt)
    for epoch in range(ol.epoch, 2):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            ol.step()
            if ol.next_step == stop_at:
                ol.save_checkpoint(tmp_path / "ckpt", model=ol.module, optimizer=opt)
                ol.close()
                return
    ol.finish()
    ol.close()


def steps(run) -> list[int]:
    return [r["step"] for r in read_metrics(run, "step")]


@pytest.mark.parametrize("load_first", [False, True], ids=["load-after-data_loader", "load-before-data_loader"])
def test_the_same_command_resuming_keeps_the_record_of_the_steps_before_the_stop(tmp_path, load_first):
    run = tmp_path / "run"
    script(tmp_path, 6, resume=False)
    assert steps(run) == list(range(6))
    script(tmp_path, None, resume=True, load_first=load_first)
    assert steps(run) == list(range(12))
    assert [r["step"] for r in read_metrics(run, "resume")] == [6]
    assert not (run / heldrun.HELD).exists() and (run / "summary.json").exists()
    raw = [json.loads(line)["step"] for line in (run / "steps" / "rank-0.jsonl").read_text().splitlines()]
    assert raw == [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 9, 10, 11]  # the held rows, the resume event, the new rows


def test_the_same_command_without_a_checkpoint_starts_a_fresh_record(tmp_path):
    run = tmp_path / "run"
    script(tmp_path, 6, resume=False)
    script(tmp_path, 3, resume=False)  # no resume: the first interval's rows drop the held record
    assert steps(run) == [0, 1, 2] and not (run / heldrun.HELD).exists()


def test_an_earlier_attempts_held_record_is_kept_over_what_a_later_attempt_wrote(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"event":"step","step":0}\n')
    heldrun.hold(tmp_path, ["metrics.jsonl"])
    (tmp_path / "metrics.jsonl").write_text('{"event":"speeds","step":0}\n')  # an attempt that never decided
    heldrun.hold(tmp_path, ["metrics.jsonl"])
    assert not (tmp_path / "metrics.jsonl").exists()
    assert (tmp_path / heldrun.HELD / "metrics.jsonl").read_text() == '{"event":"step","step":0}\n'


def test_the_held_lines_go_back_before_the_new_ones_and_a_cut_line_is_dropped(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"a":1}\n{"b":2}\n{"cut')
    heldrun.hold(tmp_path, ["metrics.jsonl"])
    with open(tmp_path / "metrics.jsonl", "ab") as f:  # a writer of this run, appending
        f.write(b'{"c":3}\n')
        heldrun.reclaim(tmp_path, "metrics.jsonl")
        f.write(b'{"d":4}\n')
    assert (tmp_path / "metrics.jsonl").read_text() == '{"a":1}\n{"b":2}\n{"c":3}\n{"d":4}\n'
    heldrun.drop(tmp_path)
    assert not (tmp_path / heldrun.HELD).exists()
