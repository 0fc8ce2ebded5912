"""FSDP2's collectives as OmniLearn runs them: the weighted reduce-scatter, and every collective and wait timed.

:func:`omnilearn.bsp.sharded.prepare` installs them on each FSDP unit (the
method: that module's docstring). Per collective, on the hot path:

- :class:`WeightedReduceScatter` multiplies the unit's flat gradient buffer
  by this rank's weight (a float, or a 0-dim device tensor: no host sync)
  and SUM-reduce-scatters it; :class:`TimedAllGather` all-gathers. Both run
  the delay emulator's ``before`` first. FSDP2 passes the reduction it wants
  (``op``, from the unit's gradient divide factor, which :func:`~omnilearn.bsp.sharded.prepare`
  sets to 1: ``PREMUL_SUM(1.0)`` in float32/bfloat16, ``SUM`` where it
  divides itself): it is honoured on top of the weighting (:func:`op_factor`:
  ``PREMUL_SUM(f)`` multiplies by ``f`` too, ``AVG`` divides by the group's
  size, as a divide factor set later with ``set_gradient_divide_factor``
  asks), and any other reduction is refused in one line.
- CPU: each call, and each unit's ``wait_for_unshard`` and
  ``finalize_backward``, adds its host wall time to ``blocked``
  (:class:`HostWait`). The process CPU time meanwhile (gloo's threads moving
  the bytes) is read only when ``cpu_time()`` says the step needs it (the
  delay emulator stretching this rank's CPU time): reading the process CPU
  clock sums every thread's time, gloo's running ones included, and at one
  read per collective and wait it cost a tiny GPT on 2 ranks over 2 cores
  7-14% of its step, the wall clock alone 0-4% (``tools/fsdp2_breakdown.py``,
  docs/fsdp.md).
- CUDA: the host does not block; CUDA events on the compute stream around
  each wait are the stall, handed to ``stall`` (resolved at the interval's
  end, no host sync).

Run: ``python -m pytest -q tests/unit/test_sharded_comms.py tests/dist/test_fsdp.py``
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed them (the old names warn); the same collectives
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def always() -> bool:
    return True


class HostWait:
    """Runs a call that may block on peers and adds its wall time (and, when ``cpu_time()``, the process CPU time
    spent meanwhile, else 0) to ``blocked(wall_s, cpu_s)``."""

    def __init__(self, blocked: Callable[[float, float], None], cpu_time: Callable[[], bool] = always) -> None:
        self.blocked, self.cpu_time = blocked, cpu_time

    def run(self, call: Callable[..., Any], *args, **kwargs) -> Any:
        if self.cpu_time():
            return self._run_with_cpu(call, *args, **kwargs)
        start = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.blocked(time.perf_counter() - start, 0.0)

    def _run_with_cpu(self, call: Callable[..., Any], *args, **kwargs) -> Any:
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return call(*args, **kwargs)
        finally:
            self.blocked(time.perf_counter() - start, time.process_time() - cpu)


class _Timed:
    """What a comm needs from the session: the emulator to run before, the host timer (None on CUDA)."""

    def __init__(self, before: Callable[[], object], host: HostWait | None) -> None:
        self.before, self.host = before, host

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def timed(self, call: Callable[..., Any], *args, **kwargs) -> Any:
        self.before()
        if self.host is None:  # CUDA: the host does not wait; the compute stream's stalls are timed in the waits
            return call(*args, **kwargs)
        return self.host.run(call, *args, **kwargs)


def op_factor(op: Any, group: Any) -> Any:
    """The factor the reduction ``op`` FSDP2 asks for applies to a sum (see the module docstring); raises
    :class:`~omnilearn.config.ConfigError` for a reduction that is no scaled sum."""
    kind = getattr(op, "op", op)  # a ReduceOp object (PREMUL_SUM carries its factor) or a RedOpType
    if op is None or kind == dist.ReduceOp.SUM:
        return 1.0
    if kind == dist.ReduceOp.PREMUL_SUM:
        return op.factor
    if kind == dist.ReduceOp.AVG:
        return 1.0 / group.size()
    from omnilearn.config import ConfigError

    raise ConfigError(f"FSDP2 asked OmniLearn's weighted reduce-scatter for a {kind} reduction, which is no "
                      "weighted sum: keep FSDP2's default reduction (a gradient divide factor is honoured)")


class WeightedReduceScatter(_Timed):
    """FSDP2's reduce-scatter with this rank's weight applied first and a SUM (see the module docstring)."""

    def __init__(self, weight: Callable[[], Any], *args) -> None:
        super().__init__(*args)
        self.weight = weight

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any = None, async_op: bool = False):
        weight, factor = self.weight(), op_factor(op, group)
        if torch.is_tensor(weight):
            input_tensor.mul_(weight.to(input_tensor.dtype) * factor)
        elif weight * factor != 1.0:
            input_tensor.mul_(weight * factor)
        return self.timed(_REDUCE_SCATTER, output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group,
                          async_op=async_op)


class TimedAllGather(_Timed):
    """FSDP2's all-gather, timed (a prefetched, asynchronous one is timed where it is waited for)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        return self.timed(_ALL_GATHER, output_tensor, input_tensor, group=group, async_op=async_op)


def timed_wait(wait: Callable[..., Any], host: HostWait | None, stall: Callable[[Any, Any], None]) -> Callable[..., Any]:
    """``wait`` (a unit's wait for its collectives), its blocking time added: host clock (``host``), or compute-stream
    events handed to ``stall`` (CUDA: ``host`` None)."""
    if host is not None:
        return partial(host.run, wait)

    def timed(*args, **kwargs):
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        result = wait(*args, **kwargs)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        stall(start, end)
        return result
    return timed
