"""The task servers of a TensorFlow parameter-server cluster, and a local one for asynchronous training.

``python -m omnilearn.tf.servers SPEC JOB INDEX`` hosts task ``INDEX`` of ``JOB`` (``ps`` or ``worker``) of
the cluster ``SPEC`` (``{"worker": ["host:port", ...], "ps": ["host:port"]}`` as JSON) until it is killed:
on several machines, start one per task with the same ``SPEC``; the chief
(:class:`omnilearn.tf.asp.Chief`, on a ``ParameterServerStrategy`` over that spec) needs no server of its own.

:func:`local_cluster` starts one parameter server and ``workers`` workers on this machine (ports from
:func:`~omnilearn.tf.cluster.free_ports`; each server's messages in ``logs/tf-<job><i>.log`` when ``logs`` is
given) and yields the spec; leaving the block kills them::

    with local_cluster(3) as spec:
        strategy = tf.distribute.ParameterServerStrategy(
            tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(spec), rpc_layer="grpc"))
        Chief(strategy, cfg, build_model, loss, make_optimizer, x, y, epochs).run()

It imports no TensorFlow itself (the servers do, in their processes). ``kill(spec, job, index)`` is for
fault tests. Run: ``python -m pytest -q tests/tf/test_tf_asp.py``
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from omnilearn.tf.cluster import free_ports

SERVER_START_S = 1.0  # the servers bind their ports before the chief connects (it retries meanwhile too)


def local_spec(workers: int) -> dict:
    """The spec of a cluster of one ``ps`` and ``workers`` workers on localhost, on free ports."""
    if workers < 1:
        raise ValueError(f"a parameter-server cluster needs at least one worker, got {workers}")
    ports = free_ports(workers + 1)
    return {"worker": [f"localhost:{p}" for p in ports[:-1]], "ps": [f"localhost:{ports[-1]}"]}


def tasks(spec: dict) -> list[tuple[str, int]]:
    """The servers a local cluster starts, in order: the ``ps`` first, then the workers."""
    return [(job, index) for job in ("ps", "worker") for index in range(len(spec[job]))]


@contextmanager
def local_cluster(workers: int, logs: Path | None = None,
                  preexec_fn: Callable[[], None] | None = None) -> Iterator[dict]:
    """One ``ps`` and ``workers`` worker servers on localhost while the block runs; yields the cluster spec.
    ``preexec_fn``: run in each server's process before its exec (a launcher's parent-death signal)."""
    spec = local_spec(workers)
    servers: list[subprocess.Popen] = []
    try:
        for job, index in tasks(spec):
            log = subprocess.DEVNULL if logs is None else open(Path(logs) / f"tf-{job}{index}.log", "w")
            try:
                servers.append(subprocess.Popen([sys.executable, "-m", __name__, json.dumps(spec), job, str(index)],
                                                stdout=subprocess.DEVNULL, stderr=log, preexec_fn=preexec_fn))
            finally:
                if log is not subprocess.DEVNULL:
                    log.close()
        time.sleep(SERVER_START_S)
        yield spec
    finally:
        for server in servers:
            server.kill()
            server.wait()


def serve(spec: dict, job: str, index: int) -> None:
    import tensorflow as tf

    tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=index, protocol="grpc",
                         start=True).join()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[1] not in ("ps", "worker") or not args[2].isdigit():
        print("usage: python -m omnilearn.tf.servers SPEC {ps,worker} INDEX", file=sys.stderr)
        return 2
    serve(json.loads(args[0]), args[1], int(args[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
