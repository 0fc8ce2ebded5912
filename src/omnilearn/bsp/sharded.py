"""Sharded data parallel (FSDP2): a model the user shards with ``fully_shard`` is balanced as it is.

    model = Transformer(...)
    for block in model.layers:
        fully_shard(block)                        # the usual way: per block, then the root
    fully_shard(model)
    model = ol.wrap_model(model)                  # recognised: not wrapped in DDP

Why ``ol.wrap_model`` recognises an ``FSDPModule`` instead of a ``shard=``
route: a torchtitan-style script shards with its own plan (which blocks,
``reshard_after_forward``, ``MixedPrecisionPolicy``, offload); OmniLearn
must not choose any of that, only weight the gradients, time the steps and
save the state. So the user shards, and ``wrap_model`` adapts what it is
given (:func:`prepare`) or refuses it (:func:`refuse_unbalanced`).

Weighting. FSDP2 reduce-scatters each unit's gradients and by default
averages them over the world size. :func:`prepare` sets every unit's divide
factor to 1 (a factor the user set with ``set_gradient_divide_factor``,
before or after, is kept and honoured: the weighted sum divided by it) and
its reduce-scatter to :class:`WeightedReduceScatter`: the
unit's local gradients (a flat buffer, in the reduce dtype) are multiplied
by this rank's weight ``b_i / B`` (``count_i / sum(count)`` for token
losses: a 0-dim device tensor, no host sync) and SUM-reduce-scattered. The
sharded gradient is then ``sum_i w_i g_i``, exactly the DDP path's.
Accumulation: ``set_requires_gradient_sync(False)`` until the step's last
micro-batch (FSDP2 accumulates unsharded gradients meanwhile), set by
:mod:`omnilearn.bsp.micro` as for DDP.

Timing. With FSDP the waits on slower peers are spread through forward
and backward: every all-gather (forward, and backward's re-gathers) and
every reduce-scatter. "Compute" is the step's time minus the time this rank
was blocked in them (:meth:`~omnilearn.clocks.host.HostClock.add_blocked`):

- CPU (gloo): each collective call is timed on the host (a synchronous call
  blocks until every peer joined), and so is each unit's
  ``wait_for_unshard`` (where an asynchronous, prefetched all-gather is
  waited for); the process CPU time spent meanwhile (gloo's threads moving
  the bytes) is left out of the native compute the emulator multiplies,
  and is read only in a step that needs it (``cpu_time``: reading it is
  costly, :mod:`omnilearn.bsp.sharded_comms`);
- CUDA: the host does not block; the compute stream does, in
  ``wait_for_unshard`` (all-gathers) and ``finalize_backward`` (the end of
  backward waits for the reduce-scatters). CUDA events on the compute stream
  before and after each are the stall, resolved with the step's other
  events at the interval's end (no host sync per step).

The delay emulator tops up a slow worker's time before each collective
(so a slow worker is slow all through forward and backward, and its
peers wait for it in the next collective, as with a slow machine). The
collectives and their timing live in :mod:`omnilearn.bsp.sharded_comms`.

Refused, in one line naming the supported route: FSDP1
(``FullyShardedDataParallel``), a model already in DDP, DeepSpeed engines,
tensor or pipeline parallel (parameters sharded on a mesh of more than one
dimension or not by ``fully_shard``), HSDP, a sharded model with parameters
``fully_shard`` does not manage, and with FSDP2: out-of-memory recovery and
``max_batch="auto"`` (a fixed ``max_batch`` runs a share above it as
micro-batches, exactly).

Checkpoints (:func:`save_sharded`, :func:`load_sharded`): the model and
optimizer through ``torch.distributed.checkpoint`` (each rank writes its
shards into ``step-<n>.dcp/`` beside ``step-<n>.pt``; DCP reshards on load, so a run resumes at
another world size), then the session's state (and scheduler, ``extra``)
in ``step-<n>.pt`` through the usual checksummed store, whose manifest is the
commit mark, written only after every rank's shards were written
(:func:`omnilearn.checkpoint.commit`; the store prunes and sweeps the shard
directories with their checkpoints).

Run: ``python -m pytest -q tests/dist/test_fsdp.py``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.bsp.sharded_comms import HostWait, TimedAllGather, WeightedReduceScatter, always, timed_wait
from omnilearn.checkpoint import CheckpointError


ROUTE = ("shard it with torch.distributed.fsdp.fully_shard (FSDP2) and pass the FSDPModule to ol.wrap_model(), or "
         "pass the plain module (ol.wrap_model wraps it in DDP)")


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is an ``FSDPModule``. Only a process that imported FSDP can hold one, so FSDP (half a
    second of imports, DTensor's included) is not imported here: every worker of an unsharded run starts faster."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_type = getattr(fsdp, "FSDPModule", None)  # torch >= 2.6
    return module_type is not None and isinstance(model, module_type)


def refuse_unbalanced(model: nn.Module, world_size: int) -> None:
    """Raise one line naming what OmniLearn cannot balance in ``model`` and the supported route; else nothing."""
    kind = type(model).__name__
    if isinstance(model, DDP):
        raise TypeError(f"ol.wrap_model() got a model already wrapped in {kind} (by accelerator.prepare(model) or "
                        "ray.train.torch.prepare_model?): "
                        "pass the plain module (ol.wrap_model wraps it in DDP with the weighted gradient hook; with "
                        "accelerate prepare only the optimizer)")
    if _is_fsdp1(model):
        raise TypeError(f"ol.wrap_model() got an FSDP1 model ({kind}), which OmniLearn cannot balance: {ROUTE}")
    if "deepspeed" in type(model).__module__.lower() or kind == "DeepSpeedEngine":
        raise TypeError(f"ol.wrap_model() got a DeepSpeed engine ({kind}), which OmniLearn cannot balance: {ROUTE}")
    meshes = {_mesh_shape(p) for p in model.parameters()}
    meshes.discard(None)
    if not is_sharded(model):
        if meshes:
            raise TypeError(f"ol.wrap_model() got a model with DTensor parameters (mesh {sorted(meshes)[0]}) not "
                            f"sharded by fully_shard at its root (tensor/pipeline parallel?), which OmniLearn cannot "
                            f"balance: {ROUTE}, calling fully_shard on the root module last")
        return
    plain = [n for n, p in model.named_parameters() if _mesh_shape(p) is None]
    if plain:
        raise TypeError(f"ol.wrap_model(): parameter {plain[0]!r} of the sharded model is not managed by fully_shard "
                        f"(its gradient would never be reduced): call fully_shard on the root module last")
    if any(len(shape) != 1 for shape in meshes) or meshes != {(world_size,)}:
        raise TypeError(f"ol.wrap_model(): a sharded model on a device mesh of shape {sorted(meshes)[0]} (HSDP, "
                        f"tensor or pipeline parallel) cannot be balanced: shard over one dimension of all "
                        f"{world_size} ranks (fully_shard's default mesh)")


def sharded_inside(module: nn.Module) -> str | None:
    """What in ``module`` (wrapped in DDP already) was sharded since: a ``fully_shard`` unit or a DTensor parameter
    (named), or None. DDP's reducer holds the parameters it was given; sharding swaps them for new ones, which FSDP
    then reduces by its own average, unweighted and untimed."""
    for name, unit in module.named_modules():
        if is_sharded(unit):
            return f"module {name or '(the root)'!r} was sharded"
    for name, p in module.named_parameters():
        if _mesh_shape(p) is not None:
            return f"parameter {name!r} is a DTensor"
    return None


def _is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FullyShardedDataParallel)


def _mesh_shape(p: torch.Tensor) -> tuple[int, ...] | None:
    mesh = getattr(p, "device_mesh", None)
    return tuple(mesh.shape) if mesh is not None else None


def prepare(model: nn.Module, weight: Callable[[], Any], before: Callable[[], object],
            blocked: Callable[[float, float], None], stall: Callable[[Any, Any], None], device: torch.device,
            cpu_time: Callable[[], bool] | None = None) -> nn.Module:
    """Make every FSDP unit of ``model`` reduce by weight and SUM, and time its collectives; returns ``model``.

    ``cpu_time``: whether this step needs the process CPU time spent blocked (the delay emulator stretching this
    rank's CPU time reads it); None: always measured (each read costs: :mod:`omnilearn.bsp.sharded_comms`)."""
    host = None if device.type == "cuda" else HostWait(blocked, cpu_time or always)
    scatter = WeightedReduceScatter(weight, before, host)
    gather = TimedAllGather(before, host)
    for unit in model.modules():
        if not is_sharded(unit):
            continue
        if all(getattr(g, "gradient_divide_factor", None) is None for g in param_groups(unit)):
            unit.set_gradient_divide_factor(1.0)  # a sum; a factor the user set is kept, and honoured (sharded_comms)
        unit.set_custom_reduce_scatter(scatter)
        unit.set_custom_all_gather(gather)
        for param_group in param_groups(unit):
            for name in ("wait_for_unshard", "finalize_backward"):
                setattr(param_group, name, timed_wait(getattr(param_group, name), host, stall))
    return model


def param_groups(unit: nn.Module) -> list[Any]:
    """A unit's FSDP parameter groups: torch 2.13 keeps a list (``_fsdp_param_groups``), 2.11 one or none."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group  # torch 2.11 (found on a GPU machine): at most one group per unit
    return [] if group is None else [group]


def gradient_sync(model: nn.Module) -> Callable[[bool], None]:
    """``set(sync)``: whether the next backward reduce-scatters (the step's last micro-batch) or accumulates
    locally. ``set_requires_gradient_sync`` walks every module of the model (20 us for the tiny GPT's 29, more in
    proportion): it is called only where a parameter group's flag differs (read each call, so a flag set by
    anyone else is seen), one attribute read per group a step otherwise."""
    groups = [group for unit in model.modules() if is_sharded(unit) for group in param_groups(unit)]

    def set_sync(sync: bool) -> None:
        for group in groups:
            if group.reduce_grads is not sync:
                model.set_requires_gradient_sync(sync)
                return

    return set_sync


def full_state(model: nn.Module) -> dict:
    """The sharded model's full ``state_dict`` on rank 0's CPU (a collective: every rank calls it; others get {})."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ------------------------------------------------------------ checkpoints through torch.distributed.checkpoint
def dcp_dir(directory: Path, step: int, generation: int = 0) -> Path:
    """The shard directory of ``step`` in ``generation`` (:mod:`omnilearn.checkpoint`: a step saved again)."""
    return Path(directory) / (f"step-{step:09d}.g{generation}.dcp" if generation else f"step-{step:09d}.dcp")


def save_sharded(model: nn.Module, optimizer, directory: str | Path, step: int, generation: int = 0) -> None:
    """Every rank writes its shards of the model (and optimizer) into ``step-<step>.dcp`` (a collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    target = dcp_dir(Path(directory), step, generation)
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
    state = {"model": model_state} if optimizer is None else {"model": model_state, "optimizer": optim_state}
    dcp.save(state, checkpoint_id=str(target))


def load_sharded(model: nn.Module, optimizer, directory: str | Path, step: int, generation: int = 0) -> None:
    """Load ``step-<step>.dcp`` into the sharded model (and optimizer), at any world size (DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    source = dcp_dir(Path(directory), step, generation)
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
    state = {"model": model_state} if optimizer is None else {"model": model_state, "optimizer": optim_state}
    try:
        dcp.load(state, checkpoint_id=str(source))
    except Exception as e:  # noqa: BLE001 - one line naming the directory, on every rank
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"the sharded checkpoint {source} cannot be loaded ({type(e).__name__}: {first}); "
                              f"its step-{step}.pt is intact: restore the directory or remove both") from None
    set_state_dict(model, [] if optimizer is None else optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optimizer", {}))
