"""The TensorFlow cluster: ``TF_CONFIG`` read and checked, the strategy made, local ``TF_CONFIG``s written.

Workers are the processes of one ``tf.distribute.MultiWorkerMirroredStrategy``
cluster, configured as TensorFlow users configure it: ``TF_CONFIG`` holds
``{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}``
(every worker the same list, its own index). No ``TF_CONFIG``: one worker.
Collectives run over gRPC (ring all-reduce on CPU; NCCL where TensorFlow
finds GPUs), with a timeout so a dead peer ends a collective in an error,
not a hang. Workers that share a host share its cores: each gets
``cores / workers on this host`` intra-op threads (one thread: its process
CPU time is its native compute, as in the PyTorch runtime).

``omnilearn train --framework tensorflow`` starts local workers with
:func:`local_config` (ports picked by :func:`free_ports`); on several
machines, start one worker per machine with each its own ``TF_CONFIG``.

Nothing here imports TensorFlow until :func:`make_strategy`.

Run: ``python -m pytest -q tests/tf/test_cluster.py``
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any, Mapping

from omnilearn.config import ConfigError
from omnilearn.tf import liveness

LOCAL_WORKERS_ENV = "OMNILEARN_LOCAL_WORKERS"  # set by the local launcher: workers on this host


@dataclass(frozen=True)
class Cluster:
    """This worker's place in the cluster."""

    rank: int
    workers: tuple[str, ...]  # host:port of every worker, in rank order; () when there is no TF_CONFIG

    @property
    def world_size(self) -> int:
        return max(1, len(self.workers))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def local_workers(self, environ: Mapping[str, str] = os.environ) -> int:
        """Workers on this host: the launcher's count, else those with this worker's host."""
        if environ.get(LOCAL_WORKERS_ENV):
            return int(environ[LOCAL_WORKERS_ENV])
        if not self.workers:
            return 1
        host = self.workers[self.rank].rpartition(":")[0]
        return sum(w.rpartition(":")[0] == host for w in self.workers)


def from_env(environ: Mapping[str, str] = os.environ) -> Cluster:
    """The cluster in ``TF_CONFIG`` (one worker without it); a bad one raises ConfigError naming what is wrong."""
    text = environ.get("TF_CONFIG", "").strip()
    if not text:
        return Cluster(0, ())
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"TF_CONFIG is not JSON ({e.msg} at character {e.pos}); set it to "
                          '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": i}}') from None
    return _parse(config)


def _parse(config: Any) -> Cluster:
    cluster = config.get("cluster") if isinstance(config, dict) else None
    task = config.get("task") if isinstance(config, dict) else None
    workers = cluster.get("worker") if isinstance(cluster, dict) else None
    if not isinstance(workers, list) or not workers or not all(isinstance(w, str) and ":" in w for w in workers):
        raise ConfigError(f"TF_CONFIG cluster {cluster!r} needs a 'worker' list of 'host:port' strings")
    other = sorted(set(cluster) - {"worker"})
    if other:
        raise ConfigError(f"TF_CONFIG cluster has {', '.join(other)} besides 'worker': omnilearn.tf.setup() is "
                          "synchronous (MultiWorkerMirroredStrategy): list every process as a worker (asynchronous "
                          "training on a parameter server: omnilearn.tf.asp.Chief, docs/tensorflow.md)")
    if not isinstance(task, dict) or task.get("type") != "worker":
        raise ConfigError(f"TF_CONFIG task {task!r} must be {{'type': 'worker', 'index': i}}")
    index = task.get("index")
    if type(index) is not int or not 0 <= index < len(workers):
        raise ConfigError(f"TF_CONFIG task index {index!r} must be an integer in [0, {len(workers)}) "
                          f"(one per worker of the cluster's {len(workers)})")
    if len(set(workers)) != len(workers):
        raise ConfigError(f"TF_CONFIG lists a worker address twice: {workers}; give each worker its own host:port")
    return Cluster(index, tuple(workers))


def local_config(ports: list[int], rank: int) -> str:
    """``TF_CONFIG`` of local worker ``rank`` among workers on ``ports`` (localhost)."""
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                       "task": {"type": "worker", "index": rank}})


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
PICK_RANGE = (20000, 32767)  # below Linux's default ephemeral range (32768-60999)


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands out to outgoing connections and ``bind(0)`` (Linux's default where unreadable)."""
    try:
        low, high = (int(v) for v in open(path).read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(count: int, rng: random.Random | None = None) -> list[int]:
    """``count`` distinct TCP ports free on localhost now (held open together while picked).

    Picked outside the kernel's ephemeral range: a port from ``bind(0)`` is closed again before TensorFlow's
    gRPC server binds it, and in between any process's outgoing connection (gloo's, another launch's) may be
    given it ("Could not start gRPC server"). A port outside that range is only taken by a listener that names it.
    """
    low, high = ephemeral_range()
    candidates = [p for p in range(*PICK_RANGE) if not low <= p <= high] or list(range(1024, low))
    rng = rng or random.Random()
    sockets: list[socket.socket] = []
    try:
        for port in rng.sample(candidates, min(len(candidates), 64 * count)):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("localhost", port))
            except OSError:
                s.close()
                continue
            sockets.append(s)
            if len(sockets) == count:
                return [s.getsockname()[1] for s in sockets]
        raise RuntimeError(f"no {count} free TCP ports on localhost in {PICK_RANGE[0]}-{PICK_RANGE[1]} outside the "
                           f"ephemeral range {low}-{high}")
    finally:
        for s in sockets:
            s.close()


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


_made: dict[Cluster, Any] = {}  # TensorFlow configures its collectives once per process: one strategy per cluster


def make_strategy(cluster: Cluster, timeout_s: float):
    """This worker's ``MultiWorkerMirroredStrategy`` (waits until every worker of ``TF_CONFIG`` is up).

    Made once per process (a second ``setup()`` reuses it). Call it before
    any other TensorFlow operation: thread counts can only be set before TensorFlow starts (after: a
    ConfigError saying so, not TensorFlow's own RuntimeError).
    A cluster that has not formed within ``timeout_s`` ends this worker naming the missing ones, and a worker
    of a local launcher beats for its watchdog (:mod:`omnilearn.tf.liveness`). TensorFlow's preemption notifier
    takes SIGTERM over (it would swallow it): the handler from before is put back.
    """
    import tensorflow as tf

    if cluster in _made:
        return _made[cluster]
    if _made:
        raise ConfigError(f"this process already joined the TensorFlow cluster {list(_made)[0].workers or 'of one'}; "
                          "TensorFlow joins one cluster per process: start a new process for another")
    if not os.environ.get("TF_CONFIG", "x").strip():
        del os.environ["TF_CONFIG"]  # blank means one worker here; TensorFlow would fail to parse it
    threads = max(1, usable_cpus() // cluster.local_workers())
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError as e:  # "Intra op parallelism cannot be modified after initialization."
        raise ConfigError(f"TensorFlow already started before omnilearn.tf.setup() ({e}): call omnilearn.tf.setup() "
                          "before building tf.data pipelines or models (or any other TensorFlow operation)") from None
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=timeout_s)
    deadline = liveness.JoinDeadline(cluster.workers, cluster.rank, timeout_s) if cluster.workers else None
    sigterm = signal.getsignal(signal.SIGTERM)
    _made[cluster] = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    if deadline is not None:
        deadline.done()
    if sigterm is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, sigterm)  # TensorFlow's preemption notifier took SIGTERM: give it back
    liveness.start_beats(cluster.rank)
    return _made[cluster]
