"""Every private (or undocumented) name of torch that OmniLearn reads, calls or overrides, held to what we rely on.

One test per name, in one process (a one-rank gloo group where DDP or FSDP2 needs one): each fails loudly, naming
the name and the OmniLearn module that relies on it, when a torch release removes it or changes its signature or
behaviour. Keep the list in step with ``grep -rnE "\\._[a-z]|\\"_[a-z]" src/omnilearn`` (torch objects only); the
torch versions these tests ran on are the ones ``omnilearn.setup`` accepts (``torchnames.require_torch``,
:mod:`omnilearn.versions`).

========================================================  ==========================================
name                                                      used by
========================================================  ==========================================
``DistributedDataParallel._get_active_ddp_module()``      bsp/wrap.py (a DDP wrapped in another)
``Variable._execution_engine.queue_callback``             bsp/backward.py (the reduced mark, after DDP's finalisation)
``torch._foreach_norm(..., dtype=)``                      bsp/replicas.py (the replica fingerprint)
``OptimizedModule._orig_mod``                             bsp/session.py (``ol.module`` of a compiled model)
``DistributedDataParallel.reducer/logger/process_group``  bsp/wrap.py (release), bsp/memory.py
``DistributedDataParallel.reducer._reset_state()``        bsp/memory.py (out-of-memory redo)
``DistributedDataParallel._has_rebuilt_buckets``          bsp/memory.py
``DistributedDataParallel.require_backward_grad_sync``    bsp/memory.py, bsp/micro.py
``FSDPModule._get_fsdp_state()``                          bsp/sharded.py
``FSDPState._fsdp_param_groups`` (``_fsdp_param_group``)  bsp/sharded.py
``FSDPParamGroup.wait_for_unshard/finalize_backward``     bsp/sharded.py (timed waits)
``FSDPParamGroup.reduce_grads``                           bsp/sharded.py (gradient sync set on a change)
``FSDPParamGroup.gradient_divide_factor``                 bsp/sharded.py (a factor the user set is kept)
``fsdp._fully_shard._fsdp_api.ReduceScatter/AllGather``   bsp/sharded.py (the custom comms' signatures)
``distributed_c10d._get_default_store()``                 distributed/group.py (default_store)
``DataLoader._iterator``, ``..._shutdown_workers()``      data/loader.py (release the workers)
``torch._dynamo`` (preloaded module)                      experiments/launch/supervise.py
``init_process_group``'s ``_distributed_excepthook``        bsp/rescue.py (a survivor's traceback to a file)
========================================================  ==========================================

Run: ``python -m pytest -q tests/unit/test_torch_private_names.py``
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

from omnilearn import torchnames


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def ddp(group):
    model = DDP(nn.Linear(3, 2))
    yield model
    for name in ("reducer", "logger", "process_group"):  # the group's holders let go before it is destroyed (as
        model.__dict__.pop(name, None)  # bsp/wrap.py's release does): freed after it, gloo's destructor hung once


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_ddp_get_active_ddp_module_is_the_ddp_whose_forward_runs(ddp):
    """bsp/wrap.py's BalancedDDP.forward: which DDP's forward is running (None outside any)."""
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            seen.append(DDP._get_active_ddp_module())
            return x

    assert DDP._get_active_ddp_module() is None, "DDP._get_active_ddp_module() outside a forward changed"
    outer = DDP(nn.Sequential(Probe(), nn.Linear(3, 2)))
    outer(torch.ones(1, 3)).sum().backward()
    assert seen == [outer], "DDP._get_active_ddp_module() no longer names the DDP whose forward runs"


def test_engine_queue_callback_chained_from_the_last_buckets_comm_hook_runs_after_ddps_finalisation(ddp):
    """bsp/backward.py: a callback queued in the last bucket's comm hook runs after the graph, and one it queues
    runs after DDP's ``finalize_backward`` (queued when the last bucket was launched, after the hook returned):
    the gradients are the reduced ones there (this comm hook doubles them)."""
    from torch.autograd import Variable

    seen: list[torch.Tensor] = []

    def hook(_, bucket):
        if bucket.is_last():
            Variable._execution_engine.queue_callback(lambda: Variable._execution_engine.queue_callback(
                lambda: seen.append(ddp.module.weight.grad.clone())))
        return _done(bucket.buffer() * 2)

    ddp.register_comm_hook(None, hook)
    ddp(torch.ones(2, 3)).sum().backward()
    local = torch.ones(2, 3) * 2  # d sum(x W^T) / dW for two rows of ones, before DDP's reduction
    assert seen and torch.equal(seen[0], local * 2), (
        "a callback chained from the last bucket's comm hook no longer runs after DDP's finalize_backward: "
        f"the gradient it saw was {seen[0].tolist() if seen else None}, not the reduced one")


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def test_ddp_holds_its_group_by_reducer_logger_and_process_group(ddp):
    """bsp/wrap.py's release pops these from the instance dict so the group can be destroyed."""
    for name in ("reducer", "logger", "process_group"):
        assert name in ddp.__dict__, f"DDP no longer keeps {name!r} in its instance dict"


def test_ddp_reducer_reset_state_and_rebuilt_buckets_flag(ddp):
    """bsp/memory.py's ReducerResets after an out-of-memory redo."""
    assert callable(getattr(ddp.reducer, "_reset_state", None)), "DDP reducer._reset_state() is gone"
    assert isinstance(ddp._has_rebuilt_buckets, bool), "DDP._has_rebuilt_buckets is gone or not a bool"
    ddp(torch.ones(2, 3)).sum()  # a forward announced a backward that never comes
    ddp.reducer._reset_state()
    ddp._has_rebuilt_buckets = False
    ddp(torch.ones(2, 3)).sum().backward()  # the reducer took the reset: the next step runs
    assert isinstance(ddp.require_backward_grad_sync, bool), "DDP.require_backward_grad_sync is gone"


def test_fsdp_state_param_groups_and_their_waits(group):
    """bsp/sharded.py's prepare: a unit's parameter groups and the waits it times, wrapped as ``(*args, **kw)``."""
    from torch.distributed.fsdp import fully_shard

    from omnilearn.bsp.sharded import param_groups

    model = fully_shard(nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)))
    state = model._get_fsdp_state()
    assert hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group"), \
        "FSDPState has neither _fsdp_param_groups (torch 2.13) nor _fsdp_param_group (2.11)"
    groups = param_groups(model)
    assert len(groups) == 1
    for name in ("wait_for_unshard", "finalize_backward"):
        method = getattr(groups[0], name, None)
        assert callable(method), f"FSDPParamGroup.{name} is gone"
        assert params(method) == [], f"FSDPParamGroup.{name} now takes {params(method)}"
    for name in ("set_custom_reduce_scatter", "set_custom_all_gather", "set_gradient_divide_factor"):
        assert callable(getattr(model, name, None)), f"FSDPModule.{name} is gone"


def test_fsdp_param_group_reduce_grads_is_the_gradient_sync(group):
    """bsp/sharded.py's gradient_sync reads each group's ``reduce_grads`` to call ``set_requires_gradient_sync``
    only on a change: the flag must be what that call sets, on every unit's groups, whoever calls it."""
    from torch.distributed.fsdp import fully_shard

    from omnilearn.bsp.sharded import gradient_sync, param_groups

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    model = fully_shard(model)
    groups = [g for unit in (model, model[0]) for g in param_groups(unit)]
    assert len(groups) == 2 and all(g.reduce_grads is True for g in groups), \
        "FSDPParamGroup.reduce_grads is gone or no longer starts True"
    model.set_requires_gradient_sync(False)
    assert all(g.reduce_grads is False for g in groups), "set_requires_gradient_sync no longer sets reduce_grads"
    set_sync = gradient_sync(model)
    set_sync(True)
    assert all(g.reduce_grads is True for g in groups)
    model[0].set_requires_gradient_sync(False)  # someone else turned one unit off: seen, set again
    set_sync(True)
    assert all(g.reduce_grads is True for g in groups)


def test_fsdp_param_group_gradient_divide_factor_is_the_units_setting(group):
    """bsp/sharded.py keeps a divide factor the user set (None: FSDP2's default average, replaced by a sum)."""
    from torch.distributed.fsdp import fully_shard

    from omnilearn.bsp.sharded import param_groups

    unit = fully_shard(nn.Linear(3, 2))
    assert [g.gradient_divide_factor for g in param_groups(unit)] == [None], "FSDP2's default divide factor changed"
    unit.set_gradient_divide_factor(4.0)
    assert [g.gradient_divide_factor for g in param_groups(unit)] == [4.0], \
        "FSDPParamGroup.gradient_divide_factor no longer holds set_gradient_divide_factor's value"


def test_fsdp_param_groups_hold_their_params_and_policy_and_views_know_their_base(group):
    """bsp/membytes.py counts a unit's unsharded bytes from ``fsdp_params`` (``sharded_param``: a DTensor whose numel is
    the whole parameter's) in ``mp_policy.param_dtype``, and leaves a parameter's views (``_base``) out of the
    activations."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from omnilearn.bsp import membytes
    from omnilearn.bsp.sharded import param_groups

    unit = fully_shard(nn.Linear(3, 2), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    (g,) = param_groups(unit)
    assert [fp.sharded_param.numel() for fp in g.fsdp_params] == [6, 2], "FSDPParam.sharded_param changed"
    assert g.mp_policy.param_dtype is torch.bfloat16, "FSDPParamGroup.mp_policy changed"
    assert membytes.block_bytes(unit) == 2 * 8 * 2  # parameters and gradients, 8 numbers in bfloat16
    weight = nn.Parameter(torch.ones(2, 2))
    assert weight.t()._base is weight, "Tensor._base no longer names a view's base"
    with membytes.SavedBytes() as saved:
        (torch.ones(4, 2) @ weight.t()).sum().backward()
    assert saved.peak == 4 * 2 * 4  # the input only: the weight's view is the state, not an activation


def test_fsdp_custom_comm_interfaces_match_ours():
    """bsp/sharded.py's WeightedReduceScatter and TimedAllGather implement FSDP2's comm interfaces (private module
    ``torch.distributed.fsdp._fully_shard._fsdp_api``): same parameters, in order. (Their calls on 2+ ranks:
    tests/dist/test_fsdp.py; one rank copies and never calls them.)"""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from omnilearn.bsp.sharded import TimedAllGather, WeightedReduceScatter

    for theirs, ours in ((ReduceScatter, WeightedReduceScatter), (AllGather, TimedAllGather)):
        assert params(theirs.__call__) == params(ours.__call__), f"FSDP2's {theirs.__name__}.__call__ changed"
        assert params(theirs.allocate) == params(ours.allocate), f"FSDP2's {theirs.__name__}.allocate changed"


def test_default_store_of_the_group(group):
    """distributed/group.py and watchdog.py reach the group's store (torch has no public accessor)."""
    store = dist.distributed_c10d._get_default_store()
    store.set("omnilearn", "ok")
    assert store.get("omnilearn") == b"ok"


def test_dataloader_iterator_and_shutdown_workers():
    """data/loader.py's shutdown: a persistent-worker DataLoader keeps its iterator in ``_iterator``."""
    loader = DataLoader(TensorDataset(torch.arange(4)), num_workers=0)
    assert "_iterator" in vars(loader) and loader._iterator is None, "DataLoader._iterator is gone"
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    method = getattr(_MultiProcessingDataLoaderIter, "_shutdown_workers", None)
    assert callable(method), "_MultiProcessingDataLoaderIter._shutdown_workers is gone"
    assert params(method) == ["self"], f"_shutdown_workers now takes {params(method)}"


def test_the_preloaded_private_module_imports():
    """experiments/launch/supervise.py preloads ``torch._dynamo`` in the fork server (DDP's constructor imports it)."""
    assert importlib.import_module("torch._dynamo") is not None


def test_setup_refuses_an_older_torch_by_its_number(monkeypatch):
    """``omnilearn.setup`` refuses a torch older than the tested range (versions.require_torch)."""
    import omnilearn
    from omnilearn import versions
    from omnilearn.config import ConfigError

    monkeypatch.setitem(versions.TESTED, "torch", ("9.0", "9.1"))
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"omnilearn.setup: torch .* is outside the versions OmniLearn was tested"):
        omnilearn.setup(global_batch=4, device="cpu")


@pytest.mark.parametrize("name, used_by, check", torchnames.CHECKS, ids=[c[0] for c in torchnames.CHECKS])
def test_every_runtime_check_holds_on_the_installed_torch(name, used_by, check):
    """The checks ``omnilearn.setup`` runs on a torch newer than the tested range (omnilearn/torchnames.py) hold
    here, where the behavioural tests above pass: a check that fails here would refuse a release that works."""
    assert torchnames.holds(check), f"{name} (used by {used_by}) no longer holds on torch {torch.__version__}"


def test_setup_on_a_newer_torch_names_the_private_name_that_changed(monkeypatch):
    """A newer torch that dropped a name we use is refused at setup in one line naming it (not by its number)."""
    import omnilearn
    from omnilearn import versions
    from omnilearn.config import ConfigError

    monkeypatch.setitem(versions.TESTED, "torch", ("0.1", "0.2"))
    monkeypatch.setattr(torchnames, "_CHANGED", [])
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    monkeypatch.delattr(torch._C._distributed_c10d.Reducer, "_reset_state")
    with pytest.raises(ConfigError) as e:
        omnilearn.setup(global_batch=4, device="cpu")
    assert "\n" not in str(e.value) and "is newer than the releases" in str(e.value)
    assert "changed Reducer._reset_state(), which OmniLearn relies on (bsp/memory.py)" in str(e.value)


def test_foreach_norm_in_float64_per_tensor():
    """bsp/replicas.py: ``torch._foreach_norm(tensors, 2, dtype=torch.float64)`` gives each tensor's 2-norm in
    float64 (one fused pass), whatever the tensors' own dtype."""
    norms = torch._foreach_norm([torch.full((4,), 0.5, dtype=torch.float32), torch.ones(2, 2)], 2,
                                dtype=torch.float64)
    assert [n.dtype for n in norms] == [torch.float64] * 2 and [float(n) for n in norms] == [1.0, 2.0], \
        "torch._foreach_norm(..., dtype=) changed"


def test_compiled_module_keeps_the_original_as_orig_mod():
    """bsp/session.py's ``ol.module`` takes torch.compile's wrapper off through ``_orig_mod``."""
    net = nn.Linear(2, 2)
    assert torch.compile(net)._orig_mod is net, "torch.compile's OptimizedModule no longer keeps _orig_mod"



def test_init_process_group_wraps_the_excepthook_it_found_as_old_hook(tmp_path):
    """bsp/rescue.py's ``_prints_only``: torch's rank-prefixing excepthook calls the hook it replaced, ``old_hook``
    (a survivor's traceback goes to a file only when nothing but printing would have happened)."""
    import sys

    before = sys.excepthook
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        hook = sys.excepthook
        assert hook.__name__ == "_distributed_excepthook", hook
        assert inspect.getclosurevars(hook).nonlocals.get("old_hook") is before
    finally:
        sys.excepthook = before
        dist.destroy_process_group()
