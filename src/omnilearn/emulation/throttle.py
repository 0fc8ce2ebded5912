"""Real-resource heterogeneity: slow a worker down with the OS instead of sleeping.

Speeds are relative, one per worker: worker i runs at ``r_i = speeds[i] /
max(speeds)`` of full speed. Every rank calls ``apply(speeds)`` at step 0 and
on every change, and ``close()`` at the end (idempotent). Backends:

- ``cgroup``: this process gets ``r * cpus`` CPUs through a CPU quota in its
  own cgroup; see :mod:`omnilearn.emulation.cgroups` (also ``cleanup_run``).
- ``affinity``: all threads pinned to a disjoint share of the usable cores.
- ``docker``: local rank 0 runs ``docker update --cpus <r_i * cpus> <container_i>``.

The pure share arithmetic (``allocate_cores``, ``core_sets``,
``docker_argvs``) and :class:`ThrottleError` live in
:mod:`omnilearn.emulation.shares`; this module re-exports the names its
callers use (``ThrottleError``, ``cleanup_run``). Refusals raise
:class:`ThrottleError` naming the fix; :func:`preflight` refuses before any
worker starts what the workers would hit (too few cores, a cgroup tree that
cannot take the cpu controller, docker containers missing or stopped;
tests in ``tests/unit/test_preflight.py``). Usage and tests::

    t = make_throttle("cgroup", rank, local_rank, local_world_size, run_id)
    t.apply((6, 6, 4, 32)); ...; t.close()
    python -m pytest -q tests/unit/test_throttle.py
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
from typing import Protocol, Sequence

from omnilearn.emulation.cgroups import (CGROUP_FIX, CgroupThrottle, cgroup_root, check_run_id, cleanup_run,
                                         detect_layout)
from omnilearn.emulation.shares import ThrottleError, allocate_cores, core_sets, docker_argvs

THROTTLES = ("cgroup", "affinity", "docker")
DOCKER_TIMEOUT_S = 30  # preflight's `docker container inspect`
__all__ = ["THROTTLES", "AffinityThrottle", "DockerThrottle", "Throttle", "ThrottleError", "check_containers",
           "cleanup_run", "for_run", "make_throttle", "preflight", "run_id"]


class Throttle(Protocol):
    def apply(self, speeds: Sequence[float]) -> None: ...  # called on every rank when the speeds change
    def close(self) -> None: ...  # undo; idempotent; safe to call twice


# ---------------------------------------------------------- affinity, docker
def _pin(pid: int, cores: Sequence[int]) -> None:
    """Set the affinity of every thread of ``pid`` (pid alone pins only one thread)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:
            continue  # a thread that just exited
        except OSError as e:
            raise ThrottleError(f"affinity backend: cannot pin {tid} to cores {sorted(cores)}: {e.strerror}") from None


class AffinityThrottle:
    """Pins process ``pid`` (local worker ``local_rank`` of ``local_world_size``) to its core share.

    Every local worker must start with the same affinity (as launched), so their shares are disjoint.
    """

    def __init__(self, pid: int, rank: int, local_rank: int, local_world_size: int) -> None:
        self.pid, self.local_rank, self.n = pid, local_rank, local_world_size
        self.first = rank - local_rank  # ranks on one node are consecutive (as torchrun assigns them)
        self.original = sorted(os.sched_getaffinity(pid))
        allocate_cores([1.0] * local_world_size, len(self.original))  # too few cores: fail now
        self.cores: tuple[int, ...] | None = None  # what this process is pinned to now

    def apply(self, speeds: Sequence[float]) -> None:
        local = list(speeds[self.first : self.first + self.n])
        if len(local) != self.n:
            raise ThrottleError(f"affinity backend: speeds {tuple(speeds)} have no entry for local worker {self.n}")
        mine = core_sets(local, self.original)[self.local_rank]
        if mine != self.cores:
            _pin(self.pid, mine)
            self.cores = mine
            if self.pid == os.getpid():  # as many intra-op threads as cores, no more, no fewer
                import torch

                self._threads = getattr(self, "_threads", None) or torch.get_num_threads()
                torch.set_num_threads(len(mine))

    def close(self) -> None:
        if self.cores is not None:
            _pin(self.pid, self.original)
            self.cores = None
            if getattr(self, "_threads", None):
                import torch

                torch.set_num_threads(self._threads)


class DockerThrottle:
    """``docker update --cpus`` on every worker's container, run by local rank 0 only."""

    def __init__(self, containers: Sequence[str], cpus: float, active: bool) -> None:
        if not containers:
            raise ThrottleError("docker backend needs one container name per worker (containers=...)")
        self.containers, self.cpus, self.docker = tuple(containers), cpus, None
        if active:
            self.docker = shutil.which("docker")
            if self.docker is None:
                raise ThrottleError("docker backend: `docker` is not on PATH; install Docker or use --emulator delay")

    def apply(self, speeds: Sequence[float]) -> None:
        argvs = docker_argvs(speeds, self.containers, self.cpus)  # checked on every rank
        if self.docker is None:
            return  # not local rank 0
        for argv in argvs:
            try:
                p = subprocess.run([self.docker, *argv[1:]], capture_output=True, text=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise ThrottleError(f"docker backend: `{' '.join(argv)}` failed: {e}") from None
            if p.returncode != 0:
                why = (p.stderr.strip().splitlines() or ["(no message)"])[0]
                raise ThrottleError(f"docker backend: `{' '.join(argv)}` exited {p.returncode}: {why}")

    def close(self) -> None:
        """Nothing to undo here: the limits live on the containers, which their launcher owns."""


def preflight(name: str, local_world_size: int, containers: Sequence[str] = ()) -> None:
    """Refuse up front what the OS will refuse anyway (before any run directory is written).

    ``containers`` (docker): each must exist and run, as ``docker update`` needs; cgroup v2: the cpu
    controller must be delegable below the root (no processes in a non-root group without it).
    """
    if name == "affinity":
        if not hasattr(os, "sched_getaffinity"):
            raise ThrottleError("affinity backend needs Linux (os.sched_setaffinity); use --emulator delay")
        allocate_cores([1.0] * local_world_size, len(os.sched_getaffinity(0)))
    elif name == "docker":
        if shutil.which("docker") is None:
            raise ThrottleError("docker backend: no `docker` command on PATH; install the Docker CLI or use "
                                "--emulator delay")
        if containers:
            check_containers(containers)
    elif name == "cgroup":
        layout = detect_layout(cgroup_root())
        if not os.access(layout.path, os.W_OK):
            raise ThrottleError(f"cgroup backend: cannot write {layout.path}; {CGROUP_FIX}")
        if layout.version == 2:
            _check_delegation(layout.path)


def _check_delegation(path: str) -> None:
    """cgroup v2: ``+cpu`` can be written to ``path``'s ``cgroup.subtree_control`` (what the workers do first)."""
    control = os.path.join(path, "cgroup.subtree_control")
    try:
        with open(control) as f:
            if "cpu" in f.read().split():
                return
    except OSError:
        return  # not there (a fake tree): creating the groups will say what is wrong
    if not os.access(control, os.W_OK):
        raise ThrottleError(f"cgroup backend: cannot write {control} to enable the cpu controller; {CGROUP_FIX}")
    try:
        with open(os.path.join(path, "cgroup.procs")) as f:
            procs = f.read().split()
    except OSError:
        procs = []
    if procs and os.path.exists(os.path.join(path, "cgroup.type")):  # a non-root group holding processes
        more = " and more" if len(procs) > 1 else ""
        raise ThrottleError(f"cgroup backend: {path} holds processes (pid {procs[0]}{more}), so cgroup v2 cannot "
                            "enable the cpu controller below it (no internal processes); point "
                            "OMNILEARN_CGROUP_ROOT at an empty delegated cgroup, or use --emulator delay")


def check_containers(containers: Sequence[str]) -> None:
    """Every container exists and runs (one ``docker container inspect``), else a :class:`ThrottleError` naming it."""
    names = ", ".join(containers)
    argv = [shutil.which("docker") or "docker", "container", "inspect", "--format", "{{.State.Running}}",
            *containers]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=DOCKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ThrottleError(f"docker backend: `docker container inspect {names}` did not answer in {DOCKER_TIMEOUT_S} "
                            "s; check that the Docker daemon runs, or use --emulator delay") from None
    except OSError as e:
        raise ThrottleError(f"docker backend: cannot run docker ({e.strerror}); use --emulator delay") from None
    if p.returncode != 0:
        missing = [c for c in containers if re.search(rf"No such (container|object): {re.escape(c)}(\s|$)", p.stderr)]
        if missing:
            raise ThrottleError(f"docker backend: no container {missing[0]!r} (--containers {','.join(containers)}); "
                                f"start it or name existing containers")
        why = (p.stderr.strip().splitlines() or ["(no message)"])[0]
        raise ThrottleError(f"docker backend: `docker container inspect` exited {p.returncode}: {why}; check that "
                            "the Docker daemon runs and you may use it, or use --emulator delay")
    states = p.stdout.split()
    if len(states) != len(containers):
        raise ThrottleError(f"docker backend: `docker container inspect {names}` answered {p.stdout.strip()!r}, "
                            "not one state per container; check the names in --containers")
    stopped = [c for c, state in zip(containers, states) if state != "true"]
    if stopped:
        name = stopped[0]
        raise ThrottleError(f"docker backend: container {name!r} is not running; `docker start {name}` or name "
                            "running containers in --containers")


def make_throttle(name: str, rank: int, local_rank: int, local_world_size: int, run_id: str,
                  containers: Sequence[str] = (), cpus: float | None = None) -> Throttle:
    """The ``name`` backend for this process; ``cpus``: CPUs of a full-speed worker."""
    if name not in THROTTLES:
        raise ThrottleError(f"unknown throttle {name!r}; choose one of {', '.join(THROTTLES)}")
    if not 0 <= local_rank < local_world_size or rank < local_rank:
        raise ThrottleError(f"rank {rank}, local rank {local_rank} of {local_world_size} do not fit together")
    if cpus is not None and not (math.isfinite(cpus) and cpus > 0):
        raise ThrottleError(f"cpus={cpus} must be a positive number")
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if name == "cgroup":
        check_run_id(run_id)
        share = cpus or usable / local_world_size
        return CgroupThrottle(os.getpid(), rank, run_id, share, cgroup_root())
    if name == "affinity":
        if not hasattr(os, "sched_setaffinity"):
            raise ThrottleError("affinity backend needs Linux (os.sched_setaffinity); use --emulator delay")
        return AffinityThrottle(os.getpid(), rank, local_rank, local_world_size)
    share = cpus or usable / max(1, len(containers))
    return DockerThrottle(containers, share, active=local_rank == 0)


def run_id() -> str:
    """Shared by every rank of a launch: names the run's cgroups."""
    if "OMNILEARN_RUN_ID" in os.environ:
        return os.environ["OMNILEARN_RUN_ID"]
    return f"torchrun-{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.environ.get('MASTER_PORT', '0')}"


def for_run(cfg, rank: int, local_rank: int, local_world_size: int) -> Throttle | None:
    """The OS-level speed emulator a config asks for (``--emulator cgroup|affinity|docker``), else None."""
    if cfg.emulator not in ("cgroup", "affinity", "docker"):
        return None
    containers = tuple(cfg.containers.split(",")) if cfg.containers else ()
    return make_throttle(cfg.emulator, rank, local_rank, local_world_size, run_id(), containers, cfg.throttle_cpus)
