"""Unit tests for the real-resource throttles (``omnilearn.emulation.throttle``, ``.cgroups``, ``.shares``).

Pure parts: the core allocation (property-tested: disjoint, >= 1 core each,
all cores used, monotone in speed), the cgroup quota, the docker argv lists,
mount-type parsing. OS parts: cgroup v1 and v2 layouts on fake trees in
``tmp_path`` (via ``OMNILEARN_CGROUP_ROOT``); a real cgroup around a sleeping
child process when ``/sys/fs/cgroup`` is writable (skipped otherwise); real
affinity pinning of a child process and of this one; docker through a fake
``docker`` script first on ``PATH``. Fixtures kill children, restore affinity
and remove every cgroup a test created; nothing measures time.

Run:  cd /work/main && python -m pytest -q tests/unit/test_throttle.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.emulation.cgroups import CgroupThrottle, cgroup_quota_us, cleanup_run, detect_layout, mount_fstype
from omnilearn.emulation.shares import ThrottleError, allocate_cores, core_sets, docker_argvs
from omnilearn.emulation.throttle import THROTTLES, AffinityThrottle, make_throttle

HL8 = (6.0, 6.0, 4.0, 32.0)
CORES = sorted(os.sched_getaffinity(0))


@pytest.fixture
def child():
    """A short-lived sleeping child process, killed after the test."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def restore_affinity():
    yield
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), CORES)
        except ProcessLookupError:
            pass


@pytest.fixture
def v1_root(tmp_path, monkeypatch):
    cpu = tmp_path / "cpu"
    cpu.mkdir()
    for name, text in (("cpu.cfs_quota_us", "-1"), ("cpu.cfs_period_us", "100000"), ("cgroup.procs", "")):
        (cpu / name).write_text(text)
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(tmp_path))
    return tmp_path


@pytest.fixture
def v2_root(tmp_path, monkeypatch):
    for name, text in (("cgroup.controllers", "cpuset cpu io memory pids"), ("cgroup.procs", "")):
        (tmp_path / name).write_text(text)
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(tmp_path))
    return tmp_path


# ------------------------------------------------------------------ pure
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.floats(0.01, 100.0), min_size=1, max_size=8),
    st.integers(0, 64),
)
def test_allocate_cores_properties(speeds, extra):
    n_cores = len(speeds) + extra
    counts = allocate_cores(speeds, n_cores)
    assert sum(counts) == n_cores and min(counts) >= 1
    for i, si in enumerate(speeds):
        for j, sj in enumerate(speeds):
            if si > sj:
                assert counts[i] >= counts[j], (speeds, counts)
    sets = core_sets(speeds, list(range(100, 100 + n_cores)))
    flat = [c for s in sets for c in s]
    assert len(flat) == len(set(flat)) == n_cores and [len(s) for s in sets] == counts


def test_allocate_cores_exact_for_paper_cpusets():
    assert allocate_cores(HL8, 48) == [6, 6, 4, 32]
    assert allocate_cores((12, 12, 8, 16), 48) == [12, 12, 8, 16]
    assert allocate_cores(HL8, 4) == [1, 1, 1, 1]
    assert core_sets((1, 3), [7, 3, 5, 1]) == [(1,), (3, 5, 7)]


def test_allocate_cores_too_few_cores():
    with pytest.raises(ThrottleError, match="needs at least 4 cores for 4 workers; this machine has 3"):
        allocate_cores(HL8, 3)


def test_quota_and_docker_argvs():
    assert cgroup_quota_us(6 / 32, 2.0) == 37500
    assert cgroup_quota_us(1e-6, 1.0) == 1000
    assert docker_argvs((1, 2), ["a", "b"], 3.0) == [
        ["docker", "update", "--cpus", "1.500", "a"],
        ["docker", "update", "--cpus", "3.000", "b"],
    ]
    with pytest.raises(ThrottleError, match="3 containers for 2 workers"):
        docker_argvs((1, 2), ["a", "b", "c"], 3.0)


def test_mount_fstype_takes_longest_mount_point():
    info = (
        "22 1 0:20 / / rw - overlay overlay rw\n"
        "30 22 0:25 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
        "31 30 0:26 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
    )
    assert mount_fstype(info, "/sys/fs/cgroup/cpu/omnilearn/r/rank0") == "cgroup"
    assert mount_fstype(info, "/sys/fs/cgroup/cpuacct") == "tmpfs"
    assert mount_fstype(info, "/tmp/x") == "overlay"


def test_unknown_backend_and_bad_run_id():
    assert THROTTLES == ("cgroup", "affinity", "docker")
    with pytest.raises(ThrottleError, match="unknown throttle 'gpu'"):
        make_throttle("gpu", 0, 0, 1, "r")
    with pytest.raises(ThrottleError, match="run id"):
        cleanup_run("../etc")


# ---------------------------------------------------------- cgroup, fake
def test_cgroup_v1_fake_tree(v1_root):
    cpu = v1_root / "cpu"
    group = cpu / "omnilearn" / "run1" / "rank1"
    t = make_throttle("cgroup", rank=1, local_rank=1, local_world_size=2, run_id="run1", cpus=2.0)
    t.apply(HL8)
    assert (group / "cpu.cfs_quota_us").read_text() == "37500"
    assert (group / "cpu.cfs_period_us").read_text() == "100000"
    assert (group / "cgroup.procs").read_text() == str(os.getpid())
    t.apply((32, 32, 32, 32))
    assert (group / "cpu.cfs_quota_us").read_text() == "200000"
    t.close()
    t.close()
    assert (cpu / "cgroup.procs").read_text() == str(os.getpid())  # moved back home
    assert not (cpu / "omnilearn").exists()


def test_cgroup_v2_fake_tree(v2_root):
    t = make_throttle("cgroup", rank=0, local_rank=0, local_world_size=1, run_id="run2", cpus=4.0)
    t.apply((1, 4))
    group = v2_root / "omnilearn" / "run2" / "rank0"
    assert (group / "cpu.max").read_text() == "100000 100000"
    assert (group / "cgroup.procs").read_text() == str(os.getpid())
    assert (v2_root / "omnilearn" / "cgroup.subtree_control").read_text() == "+cpu"
    assert (v2_root / "cgroup.subtree_control").read_text() == "+cpu"
    assert not (group / "cgroup.subtree_control").exists()  # a leaf holding processes delegates nothing
    t.close()
    assert not (v2_root / "omnilearn").exists()


def test_cgroup_default_cpus_are_cores_per_local_worker(v2_root):
    t = make_throttle("cgroup", rank=0, local_rank=0, local_world_size=2, run_id="r", cpus=None)
    t.apply((2, 1))
    expected = cgroup_quota_us(1.0, len(CORES) / 2)
    assert (v2_root / "omnilearn" / "r" / "rank0" / "cpu.max").read_text() == f"{expected} 100000"
    t.close()


def test_cleanup_run_removes_leftover_groups(v1_root):
    for rank in (0, 1):
        CgroupThrottle(os.getpid(), rank, "crashed", 1.0, str(v1_root)).apply((1, 1))
    other = CgroupThrottle(os.getpid(), 0, "other", 1.0, str(v1_root))
    base = v1_root / "cpu" / "omnilearn"
    removed = cleanup_run("crashed")
    assert set(removed[:2]) == {str(base / "crashed" / r) for r in ("rank0", "rank1")}  # leaves first
    assert removed[2:] == [str(base / "crashed")]
    assert not (base / "crashed").exists() and (base / "other").is_dir()
    assert cleanup_run("never-ran") == []
    other.close()
    assert not base.exists()


def test_cgroup_refusals(tmp_path, v1_root, monkeypatch):
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(tmp_path / "nothing"))
    with pytest.raises(ThrottleError, match="no cpu controller under .*use --emulator delay"):
        make_throttle("cgroup", 0, 0, 1, "r")
    assert cleanup_run("r") == []
    monkeypatch.setenv("OMNILEARN_CGROUP_ROOT", str(v1_root))

    def refuse(path, *a, **k):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "makedirs", refuse)
    with pytest.raises(ThrottleError, match=r"cannot create .*omnilearn: Permission denied; run as root"):
        make_throttle("cgroup", 0, 0, 1, "r")


# ---------------------------------------------------------- cgroup, real
@pytest.fixture
def real_run(monkeypatch):
    monkeypatch.delenv("OMNILEARN_CGROUP_ROOT", raising=False)
    try:
        layout = detect_layout("/sys/fs/cgroup")
    except ThrottleError:
        pytest.skip("no cgroup cpu controller on this machine")
    if not os.access(layout.path, os.W_OK):
        pytest.skip(f"{layout.path} is not writable")
    run_id = f"test-{uuid.uuid4().hex[:8]}"
    yield layout, run_id
    cleanup_run(run_id)
    assert not os.path.exists(os.path.join(layout.path, "omnilearn", run_id))


def test_real_cgroup_throttles_a_child(real_run, child):
    layout, run_id = real_run
    try:
        t = CgroupThrottle(child.pid, 0, run_id, 0.5, "/sys/fs/cgroup")
    except ThrottleError as e:
        pytest.skip(str(e))
    group = os.path.join(layout.path, "omnilearn", run_id, "rank0")
    t.apply((1, 4))  # r = 0.25 of 0.5 CPU
    if layout.version == 2:
        assert open(os.path.join(group, "cpu.max")).read().split() == ["12500", "100000"]
    else:
        assert open(os.path.join(group, "cpu.cfs_quota_us")).read().strip() == "12500"
    assert str(child.pid) in open(os.path.join(group, "cgroup.procs")).read().split()
    t.apply((4, 4))
    t.close()
    t.close()
    assert not os.path.exists(os.path.join(layout.path, "omnilearn", run_id))
    assert child.poll() is None  # moved back, still alive


def test_real_cleanup_run_moves_processes_out(real_run, child):
    layout, run_id = real_run
    try:
        CgroupThrottle(child.pid, 3, run_id, 1.0, "/sys/fs/cgroup").apply((1, 1, 1, 1))
    except ThrottleError as e:
        pytest.skip(str(e))
    run_dir = os.path.join(layout.path, "omnilearn", run_id)
    assert os.path.join(run_dir, "rank3") in cleanup_run(run_id)
    assert not os.path.exists(run_dir)
    assert str(child.pid) in open(os.path.join(layout.path, "cgroup.procs")).read().split()


# --------------------------------------------------------------- affinity
def test_affinity_pins_a_child_and_restores(child):
    n = min(2, len(CORES))
    t = AffinityThrottle(child.pid, rank=n - 1, local_rank=n - 1, local_world_size=n)
    sets = core_sets((1, 3)[:n], CORES)
    t.apply((1, 3)[:n])
    assert sorted(os.sched_getaffinity(child.pid)) == list(sets[n - 1])
    t.apply((3, 1)[:n])
    assert sorted(os.sched_getaffinity(child.pid)) == list(core_sets((3, 1)[:n], CORES)[n - 1])
    t.close()
    t.close()
    assert sorted(os.sched_getaffinity(child.pid)) == CORES


def test_affinity_make_throttle_pins_every_thread_of_this_process(restore_affinity):
    n = min(2, len(CORES))
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()  # started before apply: must be pinned too
    try:
        t = make_throttle("affinity", rank=0, local_rank=0, local_world_size=n, run_id="r")
        t.apply((1.0,) * n)
        mine = list(core_sets((1.0,) * n, CORES)[0])
        assert sorted(os.sched_getaffinity(0)) == mine == sorted(os.sched_getaffinity(thread.native_id))
        t.close()
        assert sorted(os.sched_getaffinity(0)) == CORES == sorted(os.sched_getaffinity(thread.native_id))
    finally:
        stop.set()
        thread.join()
    with pytest.raises(ThrottleError, match=f"needs at least {len(CORES) + 1} cores .* has {len(CORES)}"):
        make_throttle("affinity", 0, 0, len(CORES) + 1, "r")


# ----------------------------------------------------------------- docker
@pytest.fixture
def fake_docker(tmp_path, monkeypatch):
    """A ``docker`` that logs its argv as JSON lines; exits 1 when ``$FAKE_DOCKER_FAIL`` is set."""
    bin_dir, log = tmp_path / "bin", tmp_path / "docker.log"
    bin_dir.mkdir()
    script = bin_dir / "docker"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "if os.environ.get('FAKE_DOCKER_FAIL'):\n"
        "    sys.stderr.write('Error response from daemon: No such container: w9\\nmore\\n'); sys.exit(1)\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_docker_updates_every_container(fake_docker):
    names = ["w0", "w1", "w2", "w3"]
    t = make_throttle("docker", 0, 0, 1, "r", containers=names, cpus=8.0)
    t.apply(HL8)
    cpus = ["1.500", "1.500", "1.000", "8.000"]
    assert fake_docker() == [["update", "--cpus", c, n] for c, n in zip(cpus, names)]
    t.apply((12, 12, 12, 12))
    assert fake_docker()[4:] == [["update", "--cpus", "8.000", n] for n in names]
    t.close()
    t.close()


def test_docker_other_ranks_and_defaults(fake_docker):
    make_throttle("docker", 1, 1, 2, "r", containers=["a", "b"]).apply((1, 2))
    assert fake_docker() == []
    make_throttle("docker", 0, 0, 2, "r", containers=["a", "b"]).apply((1, 2))
    per = len(CORES) / 2
    assert fake_docker() == [["update", "--cpus", f"{per / 2:.3f}", "a"], ["update", "--cpus", f"{per:.3f}", "b"]]
    with pytest.raises(ThrottleError, match="1 containers for 2 workers"):
        make_throttle("docker", 1, 1, 2, "r", containers=["a"]).apply((1, 2))


def test_docker_failures(fake_docker, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DOCKER_FAIL", "1")
    t = make_throttle("docker", 0, 0, 1, "r", containers=["w9"], cpus=1.0)
    with pytest.raises(ThrottleError, match=r"`docker update --cpus 1.000 w9` exited 1: .*No such container: w9$"):
        t.apply((1,))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ThrottleError, match="`docker` is not on PATH"):
        make_throttle("docker", 0, 0, 1, "r", containers=["w9"])
    with pytest.raises(ThrottleError, match="one container name per worker"):
        make_throttle("docker", 1, 1, 2, "r")
