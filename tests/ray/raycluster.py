"""A local Ray cluster for the Ray door's tests: nodes are processes of this machine, every address loopback.

:func:`local_cluster` starts a head node (``ray.cluster_utils.Cluster``; more nodes with ``cluster.add_node``),
connects this process to it, and at the end shuts it down and checks that every process it started is gone.
Ray is told to start no dashboard, send no usage statistics, use 127.0.0.1 for every node (the machine's other
address is never used), find this cluster and no other (``RAY_ADDRESS``: Ray's own actors call ``ray.init()``
without an address, and another test file's cluster may run beside this one), poll its training workers every
0.1 s (a report is committed within one poll), run its workers at the suite's priority (not Ray's nice 15), and
run no preemption watcher, state reconciliation or metrics of Ray Train (:data:`ENV`: tests/ray/conftest.py puts
it in the environment before Ray is imported). Its logs and sockets live in a temporary directory, removed at the end.

What listens: once the training workers are gone, nothing the cluster started may listen beyond loopback. While a
run lasts, rank 0's worker also holds torch's TCPStore of the process group Ray's backend makes, bound to every
interface (torch has no bind address for it; a multi-node job needs it reachable): the check waits for the
workers to exit first, and the end of the block checks that every process is gone.

Run: ``python -m pytest -q tests/ray/``
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import listeners
from ranks import free_port

ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # node addresses: 127.0.0.1, not the machine's interface
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    # a node removed: Ray first tries the old count from its stale view and waits this long before fewer (60 s by
    # default); a start that takes longer is tried again, without limit, so a loaded machine only waits longer
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "30",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_ENABLE_STATE_ACTOR_RECONCILIATION": "0",
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    # Ray runs its workers (the training workers, the controller) at nice 15: beside the suite's other tests, or any
    # CPU hog, they got a few percent of a core (a first worker group took 386 s to start beside three busy loops,
    # 15 s alone). At the suite's own priority they get their share.
    "RAY_worker_niceness": "0",
    "OMP_NUM_THREADS": "1",
}
GONE_S = 30.0  # a hang guard for the processes to exit after the shutdown


def node_args(cpus: int, temp: str) -> dict:
    """A node's settings: ``cpus`` CPUs, a small object store, Ray's API server (started even without the dashboard)
    on a free port of its own rather than 8265, which another test's cluster may hold."""
    return {"num_cpus": cpus, "include_dashboard": False, "temp_dir": temp, "object_store_memory": 80 * 2**20,
            "dashboard_port": free_port()}


@contextmanager
def local_cluster(head_cpus: int) -> Iterator:
    """A connected local cluster whose head offers ``head_cpus`` CPUs (one Ray Train worker each)."""
    import ray
    from ray.cluster_utils import Cluster

    before = set(listeners.tree(os.getpid()))
    temp = tempfile.mkdtemp(prefix="olray", dir="/tmp")  # short: Ray's socket paths live under it
    port, outer = free_port(), os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = f"127.0.0.1:{port}"  # every process of this cluster inherits it
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**node_args(head_cpus, temp), "gcs_server_port": port})
        cluster.temp = temp
        ray.init(address=cluster.address)
        yield cluster
        started = set(listeners.tree(os.getpid())) - before
        _await_gone([p for p in started if _cmdline(p).startswith("ray::RayTrainWorker")])
        exposed = listeners.exposed(set(listeners.tree(os.getpid())) - before)
        assert not exposed, f"Ray listens beyond loopback: {exposed}"
    finally:
        started = set(listeners.tree(os.getpid())) - before
        _restore("RAY_ADDRESS", outer)
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        left = _await_gone(started)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"Ray left processes behind: {left}"


def _await_gone(pids) -> list[int]:
    """Those of ``pids`` still alive after waiting for them to exit (a hang guard of :data:`GONE_S`)."""
    deadline = time.monotonic() + GONE_S
    while any(listeners.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if listeners.alive(p)]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _restore(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


class Fit:
    """``trainer.fit()`` in a thread of its own: off the main thread Ray installs no SIGINT handler in the test
    process, and the test can change the cluster while the run goes on."""

    def __init__(self, trainer) -> None:
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(trainer,), name="ray-fit", daemon=True)
        self.thread.start()

    def _run(self, trainer) -> None:
        try:
            self.result = trainer.fit()
        except BaseException as e:  # the test raises it
            self.error = e

    def wait(self, timeout_s: float):
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the Ray Train run did not end within {timeout_s:.0f} s"
        if self.error is not None:
            raise self.error
        return self.result


def await_event(read, match, timeout_s: float, fit: Fit | None = None) -> dict:
    """The first event of ``read()`` for which ``match(event)`` holds, awaited (checked every 0.1 s; a hang guard
    of ``timeout_s``); fails at once when ``fit`` ended first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in read() if match(e)]
        if found:
            return found[0]
        assert fit is None or fit.thread.is_alive(), f"the run ended first: {fit.error or fit.result}"
        time.sleep(0.1)
    raise AssertionError(f"no such event within {timeout_s:.0f} s: {read()[-5:]}")
