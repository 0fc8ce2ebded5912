"""Up-front checks (``omnilearn.experiments.train.preflight``): each one refusing with one line, and passing.

Fast and in ``tmp_path``: the machine's cores, free space and write permission are monkeypatched where
the real ones would decide (tests may run as root, for whom every directory is writable); docker is a
fake ``docker`` script on ``PATH``; cgroups are fake trees under ``OMNILEARN_CGROUP_ROOT``; images are
tiny PNGs made with Pillow. A config that passes leaves ``tmp_path`` as it was: the checks write nothing.

Run:  cd /work/main && python -m pytest -q tests/unit/test_preflight.py
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from collections import namedtuple

import pytest

from omnilearn.config import ConfigError
from omnilearn.distributed import group
from omnilearn.experiments.train import preflight
from omnilearn.experiments.config import TrainConfig

Usage = namedtuple("Usage", "total used free")


@pytest.fixture(autouse=True)
def two_cores_no_torchrun(monkeypatch, tmp_path):
    monkeypatch.setattr(group, "usable_cpus", lambda: 2)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMNILEARN_CACHE", str(tmp_path / "cache"))


def cfg(tmp_path, **kw) -> TrainConfig:
    return TrainConfig(**{"workers": 2, "out": str(tmp_path / "run"), **kw})


def refused(config: TrainConfig, check=preflight.check) -> str:
    with pytest.raises(ConfigError) as e:
        check(config)
    assert "\n" not in str(e.value)
    return str(e.value)


def tree(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_a_good_config_passes_and_writes_nothing(tmp_path):
    before = tree(tmp_path)
    preflight.check(cfg(tmp_path))
    assert tree(tmp_path) == before


# ---------------------------------------------------------------- processes
def test_oversubscription_refused_unless_asked(tmp_path):
    assert refused(cfg(tmp_path, workers=17)) == (
        "--workers 17 is 8.5 processes per core on this 2-core machine (limit 8 per core); "
        "use --workers 16 or fewer, or pass --oversubscribe")
    preflight.check_processes(cfg(tmp_path, workers=16))
    preflight.check_processes(cfg(tmp_path, workers=17, oversubscribe=True))


def test_oversubscription_counts_the_asp_server_and_torchrun_local_size(tmp_path, monkeypatch):
    msg = refused(cfg(tmp_path, workers=16, mode="asp"), preflight.check_processes)
    assert msg.startswith("--workers 16 plus the parameter server is 8.5 processes per core")
    assert "use --workers 15 or fewer" in msg
    preflight.check_processes(cfg(tmp_path, workers=15, mode="asp"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "40")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "20")
    assert refused(cfg(tmp_path), preflight.check_processes).startswith(
        "LOCAL_WORLD_SIZE 20 (torchrun --nproc-per-node) is 10 processes per core")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    preflight.check_processes(cfg(tmp_path))


# ---------------------------------------------------------------- --out
def test_out_that_is_a_file_or_under_one(tmp_path):
    (tmp_path / "file").write_text("x")
    assert "is a file, not a directory" in refused(cfg(tmp_path, out=str(tmp_path / "file")))
    msg = refused(cfg(tmp_path, out=str(tmp_path / "file" / "run")))
    assert msg == f"--out {str(tmp_path / 'file' / 'run')!r} cannot be created: {tmp_path / 'file'} is a file; " \
                  "choose another --out"


def test_out_holding_a_run_needs_overwrite_and_names_resume(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    assert refused(cfg(tmp_path)) == (f"--out {str(run)!r} already holds a run (metrics.jsonl); it has no checkpoint "
                                      "to --resume from; choose another --out or pass --overwrite")
    preflight.check_out_dir(cfg(tmp_path, overwrite=True))
    (run / "config.toml").write_text("workers = 2\n")
    (run / "checkpoints").mkdir()  # a relaunch into a run that can be continued: --resume is the way on
    assert refused(cfg(tmp_path)) == (f"--out {str(run)!r} already holds a run (config.toml, metrics.jsonl); continue "
                                      "it with --resume (from its newest checkpoint), choose another --out, or pass "
                                      "--overwrite")


def test_omnilearn_launch_into_a_run_names_resume(tmp_path, capsys):
    from omnilearn.experiments.cli import main

    if importlib.util.find_spec("tensorflow") is None:  # found, not imported: the refusal needs no TensorFlow
        pytest.skip("the [tensorflow] extra is not installed")
    run, script = tmp_path / "run", tmp_path / "s.py"
    script.write_text("")
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    assert main(["launch", "--out", str(run), str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a run (config.toml); continue it with --resume" in err, err


def test_out_not_writable(tmp_path, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    msg = refused(cfg(tmp_path, out=str(tmp_path / "new" / "run")), preflight.check_out_dir)
    assert msg == f"--out {str(tmp_path / 'new' / 'run')!r} is not writable: no write permission on {tmp_path}; " \
                  "choose another --out or fix its permissions"


def test_out_needs_free_space(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 10**9 - 3 * 10**6, 3 * 10**6))
    msg = refused(cfg(tmp_path), preflight.check_out_dir)
    assert "only 3.0 MB free on " in msg and msg.endswith(
        "a run needs at least 10.0 MB; free some space or choose another --out")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**9, 0, 10**9))
    preflight.check_out_dir(cfg(tmp_path))


def test_resume_needs_a_run_with_checkpoints(tmp_path):
    assert refused(cfg(tmp_path, out=None, resume=True)) == (
        "--resume needs --out: the directory of the run to continue")
    assert "is not a directory" in refused(cfg(tmp_path, resume=True))
    run = tmp_path / "run"
    run.mkdir()
    assert "holds no run (no config.toml)" in refused(cfg(tmp_path, resume=True))
    (run / "config.toml").write_text("workers = 2\n")
    (run / "metrics.jsonl").write_text("")
    assert "has no checkpoints/ directory" in refused(cfg(tmp_path, resume=True))
    (run / "checkpoints").mkdir()
    preflight.check_out_dir(cfg(tmp_path, resume=True))  # holding a run is the point: no --overwrite needed


def test_out_is_rank_0s_under_torchrun(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.toml").write_text("")  # rank 0 may have prepared it already
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    preflight.check(cfg(tmp_path))
    monkeypatch.setenv("RANK", "0")
    assert "already holds a run" in refused(cfg(tmp_path))


# ---------------------------------------------------------------- emulators
@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """``docker container inspect`` of containers: $MISSING do not exist, $STOPPED do not run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "docker"
    script.write_text(
        f"#!{sys.executable}\nimport os, sys\n"
        "assert sys.argv[1:5] == ['container', 'inspect', '--format', '{{.State.Running}}'], sys.argv\n"
        "missing, stopped = os.environ.get('MISSING', '').split(), os.environ.get('STOPPED', '').split()\n"
        "for name in sys.argv[5:]:\n"
        "    if name in missing:\n"
        "        sys.stderr.write(f'Error: No such container: {name}\\n')\n"
        "    else:\n"
        "        print('false' if name in stopped else 'true')\n"
        "sys.exit(1 if missing else 0)\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def docker_cfg(tmp_path):
    return cfg(tmp_path, emulator="docker", containers="w1,w10", speeds="1,2")


def test_docker_containers_must_exist_and_run(tmp_path, fake_docker, monkeypatch):
    preflight.check_emulator(docker_cfg(tmp_path))
    monkeypatch.setenv("MISSING", "w10")
    assert refused(docker_cfg(tmp_path), preflight.check_emulator) == (
        "docker backend: no container 'w10' (--containers w1,w10); start it or name existing containers")
    monkeypatch.setenv("MISSING", "")
    monkeypatch.setenv("STOPPED", "w1")
    assert refused(docker_cfg(tmp_path), preflight.check_emulator) == (
        "docker backend: container 'w1' is not running; `docker start w1` or name running containers in "
        "--containers")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert "no `docker` command on PATH" in refused(docker_cfg(tmp_path), preflight.check_emulator)


def fake_v2(root, procs="", subtree=""):
    root.mkdir()
    for name, text in (("cgroup.controllers", "cpuset cpu io memory pids"), ("cgroup.procs", procs),
                       ("cgroup.subtree_control", subtree), ("cgroup.type", "domain")):
        (root / name).write_text(text)
    return root


def test_cgroup_v2_needs_the_cpu_controller_delegable(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(fake_v2(tmp_path / "busy", procs="123\n456\n")))
    msg = refused(cfg(tmp_path, emulator="cgroup"), preflight.check_emulator)
    assert msg.startswith(f"cgroup backend: {tmp_path / 'busy'} holds processes (pid 123 and more), so cgroup v2 "
                          "cannot enable the cpu controller below it")
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(fake_v2(tmp_path / "delegated", "123\n", "cpu memory")))
    preflight.check_emulator(cfg(tmp_path, emulator="cgroup"))
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(fake_v2(tmp_path / "empty")))
    preflight.check_emulator(cfg(tmp_path, emulator="cgroup"))
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(tmp_path / "nothing"))
    assert "no cpu controller under" in refused(cfg(tmp_path, emulator="cgroup"), preflight.check_emulator)


def test_affinity_needs_a_core_per_local_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert "affinity backend needs at least 3 cores for 3 workers" in refused(
        cfg(tmp_path, workers=3, emulator="affinity"), preflight.check_emulator)
    preflight.check_emulator(cfg(tmp_path, workers=2, emulator="affinity"))


# ---------------------------------------------------------------- data
def test_cifar_layout_without_reading_it(tmp_path):
    assert "cifar10 needs --data-dir" in refused(cfg(tmp_path, dataset="cifar10", model="resnet18"),
                                                 preflight.check_data)
    folder = tmp_path / "data" / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    config = cfg(tmp_path, dataset="cifar10", model="resnet18", data_dir=str(tmp_path / "data"))
    assert "has no data_batch_1..5 and test_batch" in refused(config, preflight.check_data)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / name).write_bytes(b"")  # not read here: workload.check loads them once, after
    preflight.check_data(config)


def images(root, classes=("cat", "dog"), n=3):
    from PIL import Image

    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n):
            Image.new("RGB", (12, 10), (40 * i, 80, 120)).save(root / c / f"{i}.png")
    return root


def test_imagefolder_layout_and_a_decoded_sample(tmp_path):
    root = images(tmp_path / "imgs")
    config = cfg(tmp_path, dataset="imagefolder", model="resnet18", data_dir=str(root), image_size=8)
    preflight.check_data(config)
    (root / "dog" / "9.png").write_bytes(b"<html>rate limited</html>")  # the last of its class: decoded
    assert refused(config, preflight.check_data) == (
        f"imagefolder: cannot decode image {root / 'dog' / '9.png'} (UnidentifiedImageError); "
        "remove or replace the file")
    (root / "dog" / "9.png").write_bytes(b"version https://git-lfs.github.com/spec/v1\noid sha256:ab\n")
    assert "is a Git LFS pointer, not an image; run `git lfs pull`" in refused(config, preflight.check_data)
    one = images(tmp_path / "one", classes=("cat",))
    msg = refused(cfg(tmp_path, dataset="imagefolder", model="resnet18", data_dir=str(one)), preflight.check_data)
    assert f"imagefolder: {one} has 1 classes" in msg


def test_text_corpus_from_file_sizes(tmp_path):
    def text_cfg(path):
        return cfg(tmp_path, dataset="text", model="gpt2-tiny", data_dir=str(path), seq_len=64)

    (tmp_path / "corpus").mkdir()
    assert "has no .txt, .md or .py files" in refused(text_cfg(tmp_path / "corpus"), preflight.check_data)
    (tmp_path / "corpus" / "a.txt").write_text("x" * 100)
    assert "has 100 bytes; seq_len 64 needs at least" in refused(text_cfg(tmp_path / "corpus"), preflight.check_data)
    (tmp_path / "corpus" / "b.md").write_text("y" * 2000)
    preflight.check_data(text_cfg(tmp_path / "corpus"))
    assert "does not exist" in refused(text_cfg(tmp_path / "nope"), preflight.check_data)


def test_mnist1d_cache_must_be_writable_until_made(tmp_path, monkeypatch):
    preflight.check_data(cfg(tmp_path))  # $OMNILEARN_CACHE does not exist yet: its writable parent decides
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path) else real(p, mode))
    msg = refused(cfg(tmp_path), preflight.check_data)
    assert msg.startswith(f"mnist1d: cannot write its cache {tmp_path / 'cache'} (no write permission on {tmp_path})")
    assert msg.endswith("set OMNILEARN_CACHE to a writable folder")
