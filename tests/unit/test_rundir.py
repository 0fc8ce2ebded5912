"""The run directory leaves nothing half-written on a full disk, and reads a damaged or resumed metrics file.

A full disk is simulated: files whose ``write`` raises ``OSError(ENOSPC)`` past a byte budget (as a
filling device does, also under ``torch.save``, which wraps the error), an ``fsync`` / ``rename`` /
``os.write`` that raises it. Each time: one :class:`DiskFull` line naming the file, the size it needs and
the fix; the old file intact; no temp file; ``metrics.jsonl`` cut back to whole lines.

Run:  cd /work/main && python -m pytest -q tests/unit/test_rundir.py
"""

from __future__ import annotations

import errno
import io
import json
import os
import traceback
from pathlib import Path

import pytest
import torch

from omnilearn.observe import rundir
from omnilearn.observe.metrics import parse_jsonl, read_metrics
from omnilearn.observe.modelfile import save_model
from omnilearn.observe.rundir import (DiskFull, MetricsLog, RunDirError, disk_full, prepare, size_text,
                                      write_atomic, write_json)

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_after(monkeypatch, budget: int) -> None:
    """Files ``rundir`` opens for writing raise ENOSPC once ``budget`` bytes are in them."""
    real_open = open

    class Filling(io.FileIO):
        def write(self, b):
            if self.tell() + memoryview(b).nbytes > budget:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return super().write(b)

    def fake_open(file, mode="r", *args, **kwargs):
        return Filling(file, mode.replace("b", "")) if "w" in mode else real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(rundir, "open", fake_open, raising=False)


def raise_enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def assert_one_line_disk_full(e: DiskFull, path: Path, needs: str) -> None:
    text = str(e)
    assert "\n" not in text
    assert text.startswith(f"no space left on device writing {path}: it needs {needs}, ")
    assert " free on " in text and text.endswith("; free some space or choose another --out")


# ---------------------------------------------------------------- write_atomic, save_model, write_json
@pytest.mark.parametrize("where", ["writer", "fsync", "rename"])
def test_write_atomic_disk_full_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch, where):
    path = tmp_path / "summary.json"
    path.write_text('{"old": true}')
    payload = b"x" * 1_200_000
    if where == "writer":
        full_after(monkeypatch, 300_000)
    else:
        monkeypatch.setattr(rundir.os, "fsync" if where == "fsync" else "replace", raise_enospc)
    with pytest.raises(DiskFull) as e:
        write_atomic(path, lambda f: f.write(payload))
    assert_one_line_disk_full(e.value, path, "about 1.2 MB")
    assert path.read_text() == '{"old": true}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_save_model_disk_full_through_torch_save(tmp_path, monkeypatch):
    model = torch.nn.Linear(600, 500)
    buffer = io.BytesIO()
    torch.save({k: v.detach() for k, v in model.state_dict().items()}, buffer)
    (tmp_path / "model.pt").write_bytes(b"old weights")
    full_after(monkeypatch, 100_000)  # torch.save turns the ENOSPC into a RuntimeError; it is found anyway
    with pytest.raises(DiskFull) as e:
        save_model(tmp_path, model)
    assert_one_line_disk_full(e.value, tmp_path / "model.pt", f"about {size_text(len(buffer.getvalue()))}")
    assert (tmp_path / "model.pt").read_bytes() == b"old weights"
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_other_errors_pass_through_and_leave_no_temp(tmp_path):
    def broken(f):
        f.write(b"half")
        raise ValueError("not a disk problem")

    with pytest.raises(ValueError, match="not a disk problem"):
        write_atomic(tmp_path / "x.json", broken)
    assert list(tmp_path.iterdir()) == []
    write_json(tmp_path / "x.json", {"a": 1})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}


def test_quota_and_file_size_messages(tmp_path):
    quota = disk_full(tmp_path / "m.pt", OSError(errno.EDQUOT, "Disk quota exceeded"), 2_500_000)
    assert str(quota).startswith(f"disk quota exceeded writing {tmp_path / 'm.pt'}: it needs about 2.5 MB, ")
    assert "quota there is spent" in str(quota)
    big = disk_full(tmp_path / "m.pt", OSError(errno.EFBIG, "File too large"), 5_000_000_000, at_least=True)
    assert "file too large writing" in str(big) and "more than 5.0 GB" in str(big) and "ulimit -f" in str(big)
    assert isinstance(quota, RunDirError)  # the CLI prints it as one `omnilearn: error:` line, exit 2
    assert [size_text(n) for n in (512, 12_345, 300_000, 4.1e9)] == ["512 bytes", "12.3 kB", "0.3 MB", "4.1 GB"]


def test_prepare_disk_full_names_config_toml(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.os, "fsync", raise_enospc)
    with pytest.raises(DiskFull) as e:
        prepare(str(tmp_path / "run"), False, "workers = 2\n")
    assert_one_line_disk_full(e.value, tmp_path / "run" / "config.toml", "about 12 bytes")
    assert list((tmp_path / "run").iterdir()) == []


def test_disk_full_in_a_worker_is_one_line_for_the_launcher(tmp_path, monkeypatch):
    """launch.py reports ``traceback.format_exception_only(...)[-1]`` of a worker's exception."""
    monkeypatch.setattr(rundir.os, "replace", raise_enospc)
    try:
        write_json(tmp_path / "summary.json", {"a": 1})
    except DiskFull as e:
        lines = traceback.format_exception_only(type(e), e)
    assert len(lines) == 1 and "DiskFull: no space left on device writing" in lines[0]


# ---------------------------------------------------------------- metrics.jsonl
def test_metrics_log_disk_full_cuts_back_to_whole_lines(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path)
    log.write({"event": "step", "step": 0})
    log.flush()
    before = (tmp_path / "metrics.jsonl").read_bytes()
    real_write, calls = os.write, []

    def half_then_full(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))  # a short write leaves half a line
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    for step in (1, 2):
        log.write({"event": "step", "step": step})
    need = sum(len(json.dumps({"event": "step", "step": s}, separators=(",", ":"))) + 1 for s in (1, 2))
    monkeypatch.setattr(rundir.os, "write", half_then_full)
    with pytest.raises(DiskFull) as e:
        log.flush()
    assert_one_line_disk_full(e.value, tmp_path / "metrics.jsonl", f"about {need} bytes")
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    log.close()  # the lost lines are not tried again
    assert read_metrics(tmp_path) == [{"event": "step", "step": 0}]


def test_metrics_log_flushes_by_itself_past_flush_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "FLUSH_BYTES", 100)
    log = MetricsLog(tmp_path)
    for step in range(10):
        log.write({"event": "step", "step": step})
    assert len(read_metrics(tmp_path)) >= 8  # written without a flush()
    log.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(10))


def test_metrics_log_removes_a_cut_last_line_before_appending(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event":"step","step":0}\n{"event":"step","st')
    log = MetricsLog(tmp_path)
    log.write({"event": "resume", "step": 1})
    log.close()
    assert path.read_text() == '{"event":"step","step":0}\n{"event":"resume","step":1}\n'
    assert capsys.readouterr().err.count("omnilearn: warning:") == 1
    path.write_text('{"event":"step","step":0}')  # whole, only its newline missing: kept
    MetricsLog(tmp_path).close()
    assert path.read_text() == '{"event":"step","step":0}\n'


def test_read_metrics_skips_a_cut_last_line_and_replays_resumes(tmp_path, capsys):
    lines = [{"event": "step", "step": s, "rank": 0, "try": 1} for s in range(5)]
    lines += [{"event": "resume", "step": 3}] + [{"event": "step", "step": s, "rank": 0, "try": 2} for s in (3, 4, 5)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"event": "step", "st')
    steps = read_metrics(tmp_path, "step")
    assert [(r["step"], r["try"]) for r in steps] == [(0, 1), (1, 1), (2, 1), (3, 2), (4, 2), (5, 2)]
    err = capsys.readouterr().err.strip()
    assert err == f"omnilearn: warning: {path} line 10 is cut; using the 9 lines before it"
    path.write_text('{"event": "step"}\n{"event": "st\n{"event": "step"}\n')
    with pytest.raises(RunDirError, match=r"metrics.jsonl: line 2 is not JSON .*repair or delete that line"):
        parse_jsonl(path)


def test_overwrite_removes_the_old_runs_step_rows_too(tmp_path):
    run = prepare(str(tmp_path / "run"), False, "workers = 2\n")
    (run / "steps").mkdir()
    (run / "steps" / "rank-1.jsonl").write_text('{"event":"step","step":0,"rank":1}\n')
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(RunDirError, match="--overwrite"):
        prepare(str(run), False, "workers = 2\n")
    prepare(str(run), True, "workers = 2\n")
    assert not (run / "steps").exists() and not (run / "metrics.jsonl").exists()


def test_a_torchrun_restart_keeps_its_own_record_whatever_overwrite_says(tmp_path, monkeypatch):
    """``omnilearn.setup(out=DIR, overwrite=True)`` replaces an earlier run in DIR; a torchrun restart of the same
    job (``TORCHELASTIC_RESTART_COUNT`` > 0) goes on writing it (examples/own_model.py's steps 0-24 were wiped by
    its own restart: issue 50), and a restart of a job without ``overwrite`` is not refused for its own record."""
    import omnilearn

    out = tmp_path / "run"
    for attempt, overwrite in (("0", True), ("1", True), ("2", False)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        omnilearn.setup(global_batch=8, device="cpu", handle_signals=False, out=str(out), overwrite=overwrite).release()
        with open(out / "metrics.jsonl", "a") as f:  # what the attempt recorded
            f.write(json.dumps({"event": "eval", "epoch": int(attempt)}) + "\n")
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in evals] == [0, 1, 2]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new job: overwrite replaces the record
    omnilearn.setup(global_batch=8, device="cpu", handle_signals=False, out=str(out), overwrite=True).release()
    assert not (out / "metrics.jsonl").exists()
