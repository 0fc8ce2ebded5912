"""What ``omnilearn train`` tells a person: start-up lines, warnings for a run that goes on, plot legends.

Run: ``python -m pytest -q tests/unit/test_human_output.py``. Nothing here starts a worker process
(tests/dist/test_startup.py watches a real start-up); the data is MNIST-1D from the session's cache.
"""

from __future__ import annotations

import io
import json
import warnings

import pytest

import omnilearn
from omnilearn.config import BalanceConfig
from omnilearn.emulation.speeds import speed_count
from omnilearn.experiments import cli
from omnilearn.experiments.args import config_from_args
from omnilearn.experiments.train import workload
from omnilearn.experiments.report import plots
from omnilearn.experiments.report.records import load_run
from omnilearn.observe.console import _batches, startup, took, warn
from omnilearn.runplan import SpeedScheduleWarning, plan_run


def config(*flags: str):
    return config_from_args(cli.parser().parse_args(["train", *flags]))


def schedule(tmp_path, *changes: tuple[str, int, str]) -> str:
    path = tmp_path / "speeds.toml"
    path.write_text("".join(f'[[change]]\n{key} = {at}\nspeeds = "{speeds}"\n\n' for key, at, speeds in changes))
    return str(path)


# ------------------------------------------------------------------ --speeds with n values: n workers
@pytest.mark.parametrize("flags, workers, speeds", [
    (["--speeds", "4,2,1"], 3, "4,2,1"),
    (["--speeds", "1,1"], 2, "1,1"),
    (["--speeds", "HL4"], 4, "HL4"),  # a level keeps the default of 4 workers
    ([], 4, "HL8"),
    (["--workers", "3", "--speeds", "4,2,1"], 3, "4,2,1"),
])
def test_a_list_of_n_speeds_starts_n_workers(flags, workers, speeds):
    cfg = config(*flags)
    assert (cfg.workers, cfg.speeds) == (workers, speeds)


def test_speeds_on_the_command_line_set_the_workers_over_a_config_file(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('workers = 4\nspeeds = "HL8"\n')
    assert config("--config", str(toml), "--speeds", "2,1").workers == 2
    toml.write_text('speeds = "3,2,1"\n')  # a file's list with no workers in it: the same rule
    assert config("--config", str(toml)).workers == 3


def test_speeds_and_workers_that_disagree_are_named_as_typed(tmp_path, capsys):
    assert cli.main(["train", "--out", str(tmp_path / "o"), "--workers", "4", "--speeds", "4,2,1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("omnilearn: error: --speeds 4,2,1 gives 3 workers but --workers is 4") and "\n" not in err
    assert not (tmp_path / "o").exists()


def test_speed_count_reads_lists_not_levels():
    assert [speed_count(t) for t in ("4,2,1", "2", "HL8", "hl2", None, "")] == [3, 1, None, None, None, None]


# ------------------------------------------------------------------ start-up lines and warnings (launcher side)
def test_the_launcher_says_what_it_checks_at_once(tmp_path, capsys):
    steps = workload.look(config("--speeds", "2,1", "--max-steps", "7", "--out", str(tmp_path / "o")))
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert steps == 7 and err == ""
    assert lines[0].startswith("omnilearn: checking the data (mnist1d")  # ", generating it once" on a first run
    assert lines[0].endswith(" and the model (cnn1d) ...")
    assert lines[1].startswith("omnilearn: data: mnist1d: 10,000 training + 2,500 test samples (")
    assert " ready in " in lines[1] and lines[1].endswith(" s")
    assert lines[2] == "omnilearn: model: cnn1d, 31,498 parameters"


def test_quiet_and_other_torchrun_ranks_say_nothing(tmp_path, capsys, monkeypatch):
    toml = tmp_path / "q.toml"
    toml.write_text("quiet = true\n")
    workload.look(config("--config", str(toml), "--speeds", "2,1"))
    assert capsys.readouterr().out == ""
    cfg = config("--speeds", "2,1")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    workload.look(cfg)
    assert capsys.readouterr() == ("", "")
    startup("hidden", quiet=True)
    assert capsys.readouterr().out == ""


def test_a_schedule_cut_short_by_max_steps_is_one_warning(tmp_path, capsys):
    path = schedule(tmp_path, ("at_step", 0, "HL1"), ("at_step", 20, "HL8"), ("at_step", 100, "HL2"),
                    ("at_epoch", 30, "HL4"))
    workload.look(config("--speed-schedule", path, "--max-steps", "40"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("omnilearn: warning: speed schedule ")
    assert "its change at step 100 (and 1 after it) comes after the run's end at step 40" in err
    assert "--max-steps 40 cuts the 760 steps of --epochs 40 short" in err and "raise --max-steps" in err


def test_a_schedule_change_past_the_last_epoch_is_a_warning(tmp_path, capsys):
    path = schedule(tmp_path, ("at_step", 0, "HL1"), ("at_epoch", 3, "HL8"))
    workload.look(config("--speed-schedule", path, "--epochs", "2"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "its change at step 57 (epoch 3) comes after the run's end at step 38 (--epochs 2 of 19 steps)" in err
    assert "raise --epochs" in err


def test_a_schedule_inside_the_run_warns_nothing(tmp_path, capsys):
    path = schedule(tmp_path, ("at_step", 0, "HL1"), ("at_step", 39, "HL8"))
    workload.look(config("--speed-schedule", path, "--max-steps", "40"))
    assert capsys.readouterr().err == ""


def test_a_very_large_model_on_the_cpu_is_a_warning(tmp_path, capsys):
    workload.look(config("--preset", "gpt2-shakespeare", "--device", "cpu", "--out", str(tmp_path / "o")))
    out, err = capsys.readouterr()
    assert "omnilearn: model: gpt2, 86,039,040 parameters" in out
    assert err.count("\n") == 1 and err.startswith("omnilearn: warning: model gpt2 (from --preset gpt2-shakespeare) "
                                                   "has 86.0M parameters and would train on the CPU (--device cpu)")
    assert "--model gpt2-tiny" in err


def test_a_small_model_on_the_cpu_warns_nothing(capsys):
    cfg = config("--model", "mlp", "--device", "cpu")
    splits = workload.load_data(cfg)
    plan = workload.resolve(cfg, len(splits.train))
    assert workload.run_warnings(cfg, plan, workload.parameters(cfg, splits), "cpu") == []


def test_console_helpers():
    err = io.StringIO()
    warn("two\n  lines", err)
    assert err.getvalue() == "omnilearn: warning: two lines\n"
    assert [took(s) for s in (0.031, 2.34, 41.2)] == ["0.03 s", "2.3 s", "41 s"]
    assert _batches([171, 85]) == "171/85"
    assert _batches([64 + r % 5 for r in range(4096)]) == "64..66..68 (min..median..max of 4096)"  # not 4,096 numbers


# ------------------------------------------------------------------ the API warns with warnings.warn
def test_the_api_warns_about_a_schedule_past_the_run(tmp_path):
    path = schedule(tmp_path, ("at_step", 0, "HL1"), ("at_step", 50, "HL8"))
    cfg = BalanceConfig(workers=4, global_batch=64, speed_schedule=path)
    with pytest.warns(SpeedScheduleWarning, match=r"step 50 comes after the run's end at step 40 \(total_steps=40\)"):
        plan_run(cfg, 6400, 40, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_run(cfg, 6400, 60, 0)  # inside the run: silent
        plan_run(cfg, 6400, None, 0)  # open-ended: nothing to say
        plan_run(cfg, 6400, 40, 0, warn=False)


def test_setup_and_data_loader_warn(tmp_path):
    import torch

    path = schedule(tmp_path, ("at_step", 0, "1"), ("at_step", 50, "1"))
    ol = omnilearn.setup(global_batch=8, speed_schedule=path, total_steps=10, device="cpu")
    try:
        with pytest.warns(SpeedScheduleWarning, match="total_steps=10"):
            ol.data_loader(torch.utils.data.TensorDataset(torch.zeros(64, 2)))
    finally:
        ol.release()


# ------------------------------------------------------------------ plot legends
def _run_dir(tmp_path, speeds: list[float], changes: list[tuple[int, list[float]]] = ()):
    rows = [{"event": "speeds", "step": 0, "speeds": speeds}]
    rows += [{"event": "speeds", "step": s, "speeds": v} for s, v in changes]
    rows += [{"event": "step", "step": s, "epoch": 0, "rank": r, "batch": 16, "compute_s": 0.01, "wait_s": 0.001,
              "step_s": 0.011, "loss": 1.0} for s in range(6) for r in range(len(speeds))]
    rows += [{"event": "decision", "step": 2, "effective_step": 3, "changed": True}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"speed_changes": [{"step": 0, "speeds": speeds}], "declared_speeds": None if changes else speeds}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    return load_run(tmp_path)


def test_legends_show_each_ranks_declared_speed(tmp_path):
    data = _run_dir(tmp_path, [3.0, 1.0, 1.5])
    assert plots.rank_labels(data) == {0: "rank 0 (speed 1)", 1: "rank 1 (speed 1/3)", 2: "rank 2 (speed 1/2)"}
    assert plots.relative_speed(4, 32) == "1/8" and plots.relative_speed(1, 2.7) == "0.37"


def test_legends_say_at_start_when_speeds_change(tmp_path):
    data = _run_dir(tmp_path, [1.0, 1.0], [(3, [2.0, 1.0])])
    assert plots.rank_labels(data)[1] == "rank 1 (speed 1 at start)"


def test_event_marks_use_no_worker_colour(tmp_path):
    from matplotlib.colors import same_color

    data = _run_dir(tmp_path, [6.0, 6.0, 4.0, 32.0], [(4, [12.0, 12.0, 8.0, 16.0])])
    fig, ax = plots.plt.subplots()
    plots.mark_events(ax, data)
    marks = {line.get_label(): line.get_color() for line in ax.get_lines()}
    plots.plt.close(fig)
    assert set(marks) >= {"speed change", "controller change applied"}
    workers = [f"C{k}" for k in range(10)]
    assert not any(same_color(colour, w) for colour in marks.values() for w in workers)
    path = plots.batches(tmp_path / "batches.png", data)
    assert path.stat().st_size > 0
