"""The private names of torch that OmniLearn relies on, checked in one pass on the installed torch, and the torch
check every PyTorch door makes (:func:`require_torch`: ``omnilearn.setup`` and the doors built on it, the CLI).

A torch release newer than the tested range is not refused by its number: :func:`require_torch`
runs :func:`changed` once per process, and the release runs (with a one-line warning) when every name below
holds, or is refused in one line naming the first that changed. Each check is structural and cheap (no process
group, no model): the name exists, takes the parameters we call it with, or is assigned where we read it.
tests/unit/test_torch_private_names.py runs every check here on the installed torch, and beside them the
behavioural tests (what each name does on a one-rank group), so the two lists cannot drift apart.

Run: ``python -m pytest -q tests/unit/test_torch_private_names.py``
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import warnings
from pathlib import Path
from typing import Callable

import torch

from omnilearn import versions
from omnilearn.config import ConfigError

Check = Callable[[], bool]


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _assigned(cls: type, *names: str) -> bool:
    """Every ``self.NAME = ...`` (or ``self.NAME: T = ...``) appears in ``cls``'s source."""
    source = inspect.getsource(cls)
    return all(re.search(rf"self\.{name}\s*(:[^=\n]*)?=", source) for name in names)


def _ddp():
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


def _fsdp_group():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    return FSDPParamGroup


def _foreach_norm_float64() -> bool:
    norms = torch._foreach_norm([torch.ones(4, dtype=torch.float32)], 2, dtype=torch.float64)
    return norms[0].dtype == torch.float64 and float(norms[0]) == 2.0


def _fsdp_state_groups() -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    source = inspect.getsource(FSDPState)
    return "_fsdp_param_groups" in source or "_fsdp_param_group" in source


def _fsdp_waits() -> bool:
    group = _fsdp_group()
    return all(callable(getattr(group, n, None)) and _params(getattr(group, n)) == ["self"]
               for n in ("wait_for_unshard", "finalize_backward"))


def _fsdp_comm_interfaces() -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from omnilearn.bsp.sharded import TimedAllGather, WeightedReduceScatter
    return all(_params(theirs.__call__) == _params(ours.__call__) and _params(theirs.allocate) == _params(ours.allocate)
               for theirs, ours in ((ReduceScatter, WeightedReduceScatter), (AllGather, TimedAllGather)))


def _fsdp_module_setters() -> bool:
    from torch.distributed.fsdp import FSDPModule
    return all(callable(getattr(FSDPModule, n, None)) for n in
               ("_get_fsdp_state", "set_custom_reduce_scatter", "set_custom_all_gather", "set_gradient_divide_factor",
                "set_requires_gradient_sync"))


def _fsdp_param_sizes() -> bool:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    return _assigned(_fsdp_group(), "fsdp_params", "mp_policy") and _assigned(FSDPParam, "sharded_param")


def _shutdown_workers() -> bool:
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    method = getattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", None)
    return callable(method) and _params(method) == ["self"]


def _excepthook_keeps_old_hook() -> bool:
    from torch.distributed import distributed_c10d
    source = inspect.getsource(distributed_c10d)
    return "def _distributed_excepthook" in source and "old_hook" in source


def _orig_mod() -> bool:
    """Read from the module's file: importing torch._dynamo costs a second and a half (DDP imports it later)."""
    source = Path(torch.__file__).with_name("_dynamo").joinpath("eval_frame.py").read_text()
    return "class OptimizedModule" in source and re.search(r"self\._orig_mod\s*=", source) is not None


# (the name as the guard tests and docs/versions.md call it, the OmniLearn module relying on it, the check)
CHECKS: tuple[tuple[str, str, Check], ...] = (
    ("DistributedDataParallel._get_active_ddp_module()", "bsp/wrap.py",
     lambda: callable(getattr(_ddp(), "_get_active_ddp_module", None))),
    ("Variable._execution_engine.queue_callback", "bsp/backward.py",
     lambda: callable(getattr(torch.autograd.Variable._execution_engine, "queue_callback", None))),
    ("torch._foreach_norm(..., dtype=)", "bsp/replicas.py", _foreach_norm_float64),
    ("OptimizedModule._orig_mod", "bsp/session.py", _orig_mod),
    ("DistributedDataParallel.reducer/logger/process_group", "bsp/wrap.py",
     lambda: _assigned(_ddp(), "reducer", "logger", "process_group")),
    ("Reducer._reset_state()", "bsp/memory.py",
     lambda: callable(getattr(torch._C._distributed_c10d.Reducer, "_reset_state", None))),
    ("DistributedDataParallel._has_rebuilt_buckets/require_backward_grad_sync", "bsp/memory.py, bsp/micro.py",
     lambda: _assigned(_ddp(), "_has_rebuilt_buckets", "require_backward_grad_sync")),
    ("FSDPModule._get_fsdp_state() and its setters", "bsp/sharded.py", _fsdp_module_setters),
    ("FSDPState._fsdp_param_groups (_fsdp_param_group)", "bsp/sharded.py", _fsdp_state_groups),
    ("FSDPParamGroup.wait_for_unshard/finalize_backward", "bsp/sharded.py", _fsdp_waits),
    ("FSDPParamGroup.reduce_grads/gradient_divide_factor", "bsp/sharded.py",
     lambda: _assigned(_fsdp_group(), "reduce_grads", "gradient_divide_factor")),
    ("fsdp._fully_shard._fsdp_api.ReduceScatter/AllGather", "bsp/sharded.py", _fsdp_comm_interfaces),
    ("FSDPParamGroup.fsdp_params/mp_policy, FSDPParam.sharded_param", "bsp/membytes.py", _fsdp_param_sizes),
    ("Tensor._base (a view's base)", "bsp/membytes.py",
     lambda: torch.zeros(2, 2, requires_grad=True).t()._base is not None),
    ("distributed_c10d._get_default_store()", "distributed/group.py",
     lambda: callable(getattr(torch.distributed.distributed_c10d, "_get_default_store", None))),
    ("DataLoader._iterator", "data/loader.py",
     lambda: _assigned(torch.utils.data.DataLoader, "_iterator")),
    ("_MultiProcessingDataLoaderIter._shutdown_workers()", "data/loader.py", _shutdown_workers),
    ("torch._dynamo (preloaded module)", "experiments/launch/supervise.py",
     lambda: importlib.util.find_spec("torch._dynamo") is not None),
    ("init_process_group's _distributed_excepthook (old_hook)", "bsp/rescue.py", _excepthook_keeps_old_hook),
)


def holds(check: Check) -> bool:
    """``check()``, with a raise (a module gone, a signature unreadable) counted as a change."""
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - whatever a changed release raises is the change we report
        return False


def changed() -> tuple[str, str] | None:
    """The first private name that no longer holds on the installed torch, as (name, used by), or None."""
    for name, used_by, check in CHECKS:
        if not holds(check):
            return name, used_by
    return None


_SAID: set[str] = set()  # the warnings require_torch gave in this process (each once)
_CHANGED: list[tuple[str, str] | None] = []  # changed()'s outcome, once per process


def _changed_once() -> tuple[str, str] | None:
    if not _CHANGED:
        _CHANGED.append(changed())
    return _CHANGED[0]


def require_torch(*, door: str) -> None:
    """Inside the tested range (``versions.TESTED["torch"]``), nothing; older, refused by its number; newer or no
    readable version, :func:`changed` (once per process) decides: a one-line RuntimeWarning (once) when every name
    holds, else a one-line :class:`ConfigError` naming the name that changed. ``OMNILEARN_ALLOW_UNTESTED=1`` turns
    a refusal into a warning."""
    line, refused = versions.torch_problem(versions.installed("torch"), door, _changed_once)
    if not line:
        return
    if refused and not versions.allowed():
        raise ConfigError(line)
    if line not in _SAID:
        _SAID.add(line)
        warnings.warn(line, RuntimeWarning, stacklevel=2)
