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
with a plain gloo script). Every attempt now keys its group under
``omnilearn/restart-<TORCHELASTIC_RESTART_COUNT>/`` (a ``PrefixStore``), so
no attempt reads another's keys. The c10d rendezvous (``--rdzv-backend
c10d``, ``--standalone``) was never affected; both are tested.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
    return init(
        rank,
        world_size,
        int(env.get("LOCAL_RANK", 0)),
        int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        device_preference,
        timeout_s,
        backend=backend,
        store=attempt_store(rank, world_size, timeout_s),
    )


def attempt_store(rank: int, world_size: int, timeout_s: float) -> dist.Store:
    """The rendezvous store of ``MASTER_ADDR:MASTER_PORT``, keyed by this torchrun attempt.

    torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``), else rank 0 does.
    """
    env = os.environ
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=not agent and rank == 0,
                          timeout=timedelta(seconds=timeout_s), multi_tenant=not agent)
    return dist.PrefixStore(f"omnilearn/restart-{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


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


def barrier() -> None:
    dist.barrier()


_CLOSES = [0]  # sessions closed in this process: each close waits on its own store key


def destroy(wait_s: float = 0.0) -> None:
    """Destroy the default group; then wait up to ``wait_s`` (on its store) until every rank has destroyed its own.

    Wait only when every rank is known to be alive and closing too (after a barrier, or a clean end): a dead
    peer never arrives, and the wait would cost its whole ``wait_s``.
    A rank that exits while a peer is still tearing down its gloo pairs closes
    their sockets under the peer, which then aborts at exit ("terminate called
    without an active exception", 1 torchrun run in 6 on 2 cores, 2026-11-24).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size()
    store = dist.distributed_c10d._get_default_store() if world > 1 and wait_s > 0 else None
    dist.destroy_process_group()
    if store is None:
        return
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
