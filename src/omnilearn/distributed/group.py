"""Process-group set-up: the only place that decides backend and device.

Two ways in, one code path after: ``omnilearn train`` spawns local workers
that rendezvous through a file store in a private temp directory, and
``torchrun`` sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` for
the rendezvous. gloo on CPU, NCCL when the device is CUDA.

Under torchrun the group's store is made here, not by ``env://``, for one
reason: with torchrun's static rendezvous (``--nnodes N``, no
``--rdzv-backend``) the agent's TCPStore outlives a restart, and a
restarted gloo group read the previous attempt's peer addresses from it
and failed in ``connectFullMesh`` ("Connection refused"; torch 2.13, also
with a plain gloo script). The c10d rendezvous shares one store across its
rounds too (torch 2.4 on), and there the workers of one round can hold
different restart counts. Every round now keys its group under an id its
ranks agree on through the store (:mod:`omnilearn.distributed.rounds`), so
no round reads another's keys; both rendezvous are tested.

Teardown has one way out, :func:`destroy` (``Session.close()``, the
launcher, and at exit for a group still up): holders of the group let go
first (:func:`before_destroy`: DDP models), then the group is destroyed and
unpinned, so its gloo threads end and its sockets close there and then,
never during interpreter finalisation, where a gloo thread that must take
the GIL aborts the process ("terminate called without an active
exception"; docs/failures.md, "The abort at exit"; docs/upstream.md).

Why one file over 300 lines: a process group's whole life (the ways in, the stores, the device, the
teardown that must happen in one order) is one state; split, the order would be checked across files.

Tests: ``python -m pytest -q tests/dist/test_teardown.py``.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from omnilearn.distributed.rounds import round_store


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def grouped(self) -> bool:
        """Whether collectives go through a process group (False: one process on its own)."""
        return self.backend != "none"

    def synchronize(self) -> None:
        """Wait for queued device work, so host clocks measure it (CUDA only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # all streams: compute and NCCL's


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def device_problem(preference: str, local_world_size: int) -> str | None:
    """Why ``preference`` cannot be honoured for this many workers per host, or None."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if preference == "cuda" and gpus == 0:
        return "--device cuda was asked for but CUDA is not available here; use --device cpu or auto"
    if preference == "cuda" and local_world_size > gpus:
        return (f"--device cuda needs one GPU per worker: {local_world_size} workers on this host but {gpus} GPUs; "
                f"use --workers {gpus} or --device cpu")
    return None


def pick_device(preference: str, local_rank: int, local_world_size: int) -> torch.device:
    """``auto``: this rank's own GPU when every local worker can have one, else the CPU."""
    problem = device_problem(preference, local_world_size)
    if problem:
        raise RuntimeError(problem)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if preference == "cpu" or (preference == "auto" and local_world_size > gpus):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def init(
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    device_preference: str,
    timeout_s: float,
    init_method: str | None = "env://",
    backend: str | None = None,
    store: dist.Store | None = None,
) -> DistContext:
    """Join the process group and pin this process to its device and CPU share.

    ``backend`` None: NCCL for a CUDA device, else gloo. A forced gloo group
    (the ASP parameter server's) keeps every process on the CPU here; its
    workers pick their own compute device.
    """
    if backend == "gloo":
        device_preference = "cpu"
    device = pick_device(device_preference, local_rank, local_world_size)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        # Workers share the host's cores: no oversubscription from intra-op threads.
        torch.set_num_threads(max(1, usable_cpus() // local_world_size))
    dist.init_process_group(
        backend, init_method=None if store is not None else init_method, store=store, rank=rank,
        world_size=world_size, timeout=timedelta(seconds=timeout_s),
    )
    return DistContext(rank, world_size, local_rank, local_world_size, device, backend)


def init_from_torchrun(device_preference: str, timeout_s: float, backend: str | None = None) -> DistContext:
    env = os.environ
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise RuntimeError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: launch with torchrun, "
                           "or set the rendezvous address of rank 0")
    rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
    with round_store(attempt_store(rank, world_size, timeout_s), rank, world_size) as store:
        return init(
            rank,
            world_size,
            int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            device_preference,
            timeout_s,
            backend=backend,
            store=store,
        )


def join_torchrun(backend: str, timeout: timedelta | None, device_id: torch.device | None = None) -> None:
    """A torchrun worker's default process group, made from the rendezvous store in this round's own key space
    (:func:`~omnilearn.distributed.rounds.round_store`), for a framework that would make it from torchrun's store
    as it is (``env://``: Lightning), where a restart shares the dead attempt's keys and hangs or reads its peer
    addresses unless torchrun runs with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timeout or timedelta(minutes=30)  # torch's default for a group
    with round_store(attempt_store(rank, world_size, timeout.total_seconds()), rank, world_size) as store:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=device_id)


def attempt_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The rendezvous store of ``MASTER_ADDR:MASTER_PORT`` (keyed per round by :func:`~omnilearn.distributed.rounds.round_store`).

    torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``), else rank 0 does.
    """
    env = os.environ
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=not agent and rank == 0,
                         timeout=timedelta(seconds=timeout_s), multi_tenant=not agent)


def single_process(device_preference: str) -> DistContext:
    """A world of one without any process group (the API outside torchrun)."""
    return DistContext(0, 1, 0, 1, pick_device(device_preference, 0, 1), "none")


def from_existing_group(device_preference: str) -> DistContext:
    """The caller already ran ``init_process_group``: use its group.

    Any backend but plain gloo (nccl, or torch's default of gloo for CPU and
    NCCL for CUDA tensors) may carry CUDA tensors: then this rank computes on
    GPU ``LOCAL_RANK`` unless ``device_preference`` is ``cpu``.
    """
    env = os.environ
    rank, world = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    cuda_ok = torch.cuda.is_available() and backend != "gloo"
    local_rank = int(env.get("LOCAL_RANK", torch.cuda.current_device() if cuda_ok else 0))
    if device_preference == "cuda" and not cuda_ok:
        raise RuntimeError(f"device cuda asked for, but the process group ({backend}) cannot carry CUDA tensors "
                           "here; initialise it with nccl on a CUDA machine, or use device cpu")
    if cuda_ok and device_preference != "cpu":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistContext(rank, world, local_rank, int(env.get("LOCAL_WORLD_SIZE", world)), device, backend)


def join(device_preference: str, timeout_s: float) -> DistContext:
    """An existing process group, else torchrun's (from its environment), else a single process."""
    if dist.is_available() and dist.is_initialized():
        return from_existing_group(device_preference)
    if launched_by_torchrun():
        return init_from_torchrun(device_preference, timeout_s)
    return single_process(device_preference)


@contextmanager
def cpu_group(ctx: DistContext) -> Iterator[dist.ProcessGroup | None]:
    """A group that carries CPU tensors, for collectives on host memory; every rank enters it together.

    The default group (None) when it is gloo; else a new gloo group over all ranks, destroyed on exit
    (one per use: a load happens once per run, and a cached group would outlive the default one).
    """
    if not ctx.grouped or dist.get_backend() == "gloo":
        yield None
        return
    side = dist.new_group(backend="gloo")
    try:
        yield side
    finally:
        dist.destroy_process_group(side)


def barrier() -> None:
    dist.barrier()


def default_store() -> dist.Store:
    """The default group's store (its keys: the watchdog's heartbeats, failure announcements, closes)."""
    return dist.distributed_c10d._get_default_store()  # torch has no public accessor


_CLOSES = [0]  # sessions closed in this process: each close waits on its own store key
_RELEASES: list[Callable[[], None]] = []  # run first by destroy(): holders of the group let go of it


def before_destroy(release: Callable[[], None]) -> None:
    """Have :func:`destroy` call ``release()`` before it destroys the group (once per callable).

    For holders of the group that outlive it otherwise: ``bsp.wrap`` registers the release of its DDP models.
    """
    if release not in _RELEASES:
        _RELEASES.append(release)


def destroy(wait_s: float = 0.0) -> None:
    """The one teardown: holders let go, the default group is destroyed and unpinned, then wait.

    Nothing of ours holds the group after it, so its gloo threads end here
    (a collective still running is waited for, GIL released) and never
    during interpreter finalisation. Safe to call twice, and after
    ``dist.destroy_process_group()``.

    ``wait_s``: then wait up to this long (on the group's store) until every
    rank has destroyed its own. Wait only when every rank is known to be
    alive and closing too (after a barrier, or a clean end): a dead peer
    never arrives, and the wait would cost its whole ``wait_s``.
    """
    for release in _RELEASES:
        release()
    gc.collect()  # models nobody refers to any more but a cycle of their own (a plain DDP's) let go too
    if not (dist.is_available() and dist.is_initialized()):
        _unpin()
        return
    world = dist.get_world_size()
    store = default_store() if world > 1 and wait_s > 0 else None
    dist.destroy_process_group()
    _unpin()  # the last reference: the group's threads are joined here, with the GIL released
    if store is not None:
        _wait_for_peers(store, world, wait_s)


def _wait_for_peers(store: dist.Store, world: int, wait_s: float) -> None:
    _CLOSES[0] += 1
    key = f"omnilearn/closed/{_CLOSES[0]}"
    deadline = time.monotonic() + wait_s
    try:
        count = store.add(key, 1)
        while count < world and time.monotonic() < deadline:
            time.sleep(0.01)
            count = store.add(key, 0)
    except (RuntimeError, ValueError):  # the store's host is gone: nobody is left to wait for
        pass


def _unpin() -> None:
    """Drop destroyed groups from ``torch.distributed.nn.functional``'s default arguments.

    Its functions default to ``group=group.WORLD``, evaluated when the module
    is imported -- DDP imports it, while the group exists -- so the group
    would live as long as the process (torch 2.13). None is torch's own word
    for the default group.
    """
    functional = sys.modules.get("torch.distributed.nn.functional")
    for fn in vars(functional).values() if functional is not None else ():
        defaults = getattr(fn, "__defaults__", None) or ()
        if any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def _destroy_at_exit() -> None:
    """A group still up at exit is torn down before the interpreter finalises (no wait: a peer may be gone).

    An in-flight collective (one that timed out) then ends while its thread can still take the GIL.
    """
    try:
        destroy()
    except RuntimeError as e:  # nothing left to do about it at exit; say so
        print(f"omnilearn: destroying the process group at exit failed: {e}", file=sys.stderr)


atexit.register(_destroy_at_exit)
