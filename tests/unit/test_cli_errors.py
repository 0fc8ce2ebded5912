"""Bad input to ``omnilearn train``: one clear line, exit status 2, nothing written.

Run: ``python -m pytest -q tests/unit/test_cli_errors.py``. These fail before
any worker process starts, so they are fast.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from pathlib import Path

from omnilearn.experiments.cli import main


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--workers", "0"], "--workers 0"),
        (["--workers", "4", "--global-batch", "16", "--min-batch", "8"], "smaller than workers x min batch"),
        (["--workers", "2", "--global-batch", "512", "--max-batch", "100"], "larger than workers x max batch"),
        (["--min-batch", "64", "--max-batch", "32"], "min batch 64 is larger than max batch 32"),
        (["--workers", "3", "--speeds", "4,2"], "--speeds 4,2 gives 2 workers but --workers is 3"),
        (["--workers", "2", "--speeds", "1,-1"], "speed -1"),
        (["--workers", "2", "--speeds", "1,zero"], "cannot read speeds"),
        (["--speeds", "HL3"], "unknown heterogeneity level 'HL3'"),
        (["--workers", "3", "--speeds", "HL8"], "give 4 workers but --workers is 3"),
        (["--model", "resnet9000"], "unknown model 'resnet9000'"),
        (["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (["--config", "/nonexistent/x.toml"], "cannot read config file"),
        (["--global-batch", "0"], "--global-batch 0 must be positive"),
        (["--max-steps", "0"], "--max-steps 0"),
        (["--deadband", "1.5"], "--deadband 1.5"),
        (["--mode", "asp", "--min-window-s", "1"], "--min-window-s 1 is for --mode bsp"),
        (["--min-window-s", "-1"], "--min-window-s -1 must be in [0, 604800] seconds"),
        (["--speed-schedule", "/nonexistent/s.toml"], "cannot read speed schedule"),
        (["--workers", "2", "--speed-schedule", "paper"], "paper schedule is defined for 4 workers"),
        (["--global-batch", "100000"], "larger than the mnist1d training set"),
        (["--controller", "magic"], "invalid choice: 'magic'"),
        (["--global-batch", "lots"], "invalid int value: 'lots'"),
        (["--loader-workers", "4", "--control-interval", "5"], "--control-interval 5 is too short"),
    ],
)
def test_bad_flag_gives_one_line_and_exit_2(tmp_path, capsys, flags, needle):
    out = tmp_path / "out"
    assert main(["train", "--out", str(out), *flags]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("omnilearn: error: ")
    assert needle in err
    assert not out.exists()
    if "--speed-schedule" in flags:  # a file checked before the data and model start-up lines, not after them
        assert not captured.out.strip(), captured.out


def test_bad_config_file_contents(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[train]\nworkers = 2\nbogus_key = 1\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "unknown setting 'bogus_key'" in capsys.readouterr().err
    cfg.write_text("workers = 'two'\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "workers = 'two' must be a int" in capsys.readouterr().err
    cfg.write_text("workers = [\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "is not valid TOML" in capsys.readouterr().err


def test_existing_run_is_refused_without_overwrite_and_left_intact(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"keep": true}')
    assert main(["train", "--out", str(out)]) == 2
    assert "already holds a run (summary.json)" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == '{"keep": true}'


def test_console_script_prints_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "omnilearn", "train", "--workers", "-2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "omnilearn: error: --workers -2 must be positive"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is present here")
def test_cuda_without_cuda_is_refused_up_front(tmp_path, capsys):
    assert main(["train", "--device", "cuda", "--out", str(tmp_path / "o")]) == 2
    assert "CUDA is not available" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--speeds", "HL3"], "unknown bench setting 'HL3'"),
        (["--speeds", "HL2,HL8", "--workers", "3"], "give 4 workers but --workers is 3"),
        (["--speeds", "HL1", "--global-batch", "510"], "divisible by --workers 4"),
        (["--speeds", "HL1,hl1"], "names a setting twice"),
        (["--speeds", "HL1", "--emulator", "none", "--containers", "a"], "only used with --emulator docker"),
        (["--repeats", "0"], "--repeats 0 must be at least 1"),
        (["--target-accuracy", "2"], "--target-accuracy 2.0 must be a fraction"),
        (["--steps", "0"], "--steps 0 must be at least 1"),
        (["--global-batch", "16", "--min-batch", "8"], "smaller than workers x min batch"),
        (["--mode", "asp", "--speeds", "1:2:x:4"], "'x' is not a positive speed"),
        (["--mode", "asp", "--speeds", "1:2:0:4"], "'0' is not a positive speed"),
        (["--mode", "asp", "--speeds", "1:2:3"], "give 3 workers but --workers is 4"),
        (["--mode", "asp", "--speeds", "1:1:1:2,HL8,1:1:1:2"], "names a setting twice"),
        (["--speeds", "1:1:1:2"], "unknown bench setting '1:1:1:2'"),
    ],
)
def test_bad_bench_flag_gives_one_line_and_exit_2(tmp_path, capsys, flags, needle):
    out = tmp_path / "bench"
    assert main(["bench", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
    assert not out.exists()


def test_asp_bench_settings_keep_their_order_and_speeds_read_as_a_run_would():
    from omnilearn.experiments.bench.asp import parse_settings, speeds_of

    assert parse_settings("hl8, 1:2:3:4 ,HL1") == ("HL8", "1:2:3:4", "HL1")
    assert [speeds_of(s) for s in parse_settings("1:2.5:3:4,HL8")] == ["1,2.5,3,4", "HL8"]


def test_report_on_a_directory_without_a_run(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "holds neither metrics.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["train"], ["train", "--framework", "tensorflow"],
                                     ["launch", "--workers", "2", "examples/keras_fit.py"]],
                         ids=["pytorch", "tensorflow", "launch"])
def test_a_bad_worker_start_method_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch, command):
    if command[-1].endswith(".py") or "tensorflow" in command:
        if importlib.util.find_spec("tensorflow") is None:  # found, not imported: the refusal needs no TensorFlow
            pytest.skip("the [tensorflow] extra is not installed")
    monkeypatch.setenv("OMNILEARN_START_METHOD", "fork")
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    out = ["--out", str(tmp_path / "run")]
    argv = [*command[:-1], *out, command[-1]] if command[0] == "launch" else [*command, "--max-steps", "4", *out]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "OMNILEARN_START_METHOD='fork' is not a start method for the workers: use spawn or forkserver" in err
    assert "Traceback" not in err and err.count("omnilearn: error") == 1 and not (tmp_path / "run").exists()


def test_a_tmpdir_too_long_for_the_fork_servers_socket_starts_the_workers_with_spawn(tmp_path, monkeypatch):
    from omnilearn.experiments.launch import supervise
    monkeypatch.delenv("OMNILEARN_START_METHOD", raising=False)
    room = supervise.UNIX_SOCKET_PATH_MAX - len("/listener-XXXXXXXX")
    monkeypatch.setattr(supervise.util, "get_temp_dir", lambda: "/t" + "x" * (room - 2))
    assert supervise.start_context().get_start_method() == "forkserver"  # the longest that fits
    monkeypatch.setattr(supervise.util, "get_temp_dir", lambda: "/t" + "x" * (room - 1))
    assert supervise.start_context().get_start_method() == "spawn"  # "AF_UNIX path too long" otherwise
