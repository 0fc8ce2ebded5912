"""The torch check at the CLI and what breaks the private-name check (omnilearn/torchnames.py's require_torch).

``omnilearn train`` and ``omnilearn bench`` make the same check as ``omnilearn.setup``: a torch newer than the
tested range runs with one ``omnilearn: warning:`` line when the private names hold, and stops with one
``omnilearn: error:`` line (exit 2, no traceback) naming the name that changed; each check here is shown to fail
when its name goes.

Run: ``python -m pytest -q tests/unit/test_torch_policy.py``
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from omnilearn import torchnames, versions
from omnilearn.config import ConfigError
from omnilearn.experiments import args as cliargs
from omnilearn.experiments.cli import main


@pytest.fixture
def newer_torch(monkeypatch):
    """torch reads as a release past the tested range; the once-per-process outcome starts afresh."""
    monkeypatch.setattr(versions, "installed", lambda dist: "9.1.0" if dist == "torch" else None)
    monkeypatch.setattr(torchnames, "_CHANGED", [])
    monkeypatch.setattr(torchnames, "_SAID", set())
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)


@pytest.mark.parametrize("command", ["train", "bench"])
def test_the_cli_refuses_a_newer_torch_whose_private_name_changed_in_one_line(newer_torch, monkeypatch, capsys,
                                                                              command, tmp_path):
    monkeypatch.delattr(DDP, "_get_active_ddp_module")
    code = main([command, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"omnilearn: error: omnilearn {command}: torch 9.1.0 is newer than the releases")
    assert "changed DistributedDataParallel._get_active_ddp_module()" in err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_the_cli_warns_in_one_line_once_when_the_names_hold(newer_torch, capsys):
    cliargs.check_torch("omnilearn train")
    cliargs.check_torch("omnilearn train")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("omnilearn: warning: omnilearn train: torch 9.1.0 is newer")
    assert "the private names of torch it relies on hold, so it runs" in err


@pytest.mark.parametrize("owner, name, reported", [
    (DDP, "_get_active_ddp_module", "DistributedDataParallel._get_active_ddp_module()"),
    (torch._C._distributed_c10d.Reducer, "_reset_state", "Reducer._reset_state()"),
    (torch.distributed.distributed_c10d, "_get_default_store", "distributed_c10d._get_default_store()"),
    (_MultiProcessingDataLoaderIter, "_shutdown_workers", "_MultiProcessingDataLoaderIter._shutdown_workers()"),
    (FSDPModule, "set_custom_all_gather", "FSDPModule._get_fsdp_state() and its setters"),
])
def test_a_removed_name_is_the_change_reported(monkeypatch, owner, name, reported):
    assert torchnames.changed() is None
    monkeypatch.delattr(owner, name)
    assert torchnames.changed()[0] == reported


def test_a_source_check_fails_when_the_assignment_goes(monkeypatch):
    real = torchnames.inspect.getsource
    monkeypatch.setattr(torchnames.inspect, "getsource",
                        lambda obj: real(obj).replace("self.reduce_grads", "self.other") if obj is
                        torchnames._fsdp_group() else real(obj))
    assert torchnames.changed()[0] == "FSDPParamGroup.reduce_grads/gradient_divide_factor"


def test_require_torch_checks_once_per_process_and_warns_once(monkeypatch):
    calls = []
    monkeypatch.setattr(torchnames, "changed", lambda: calls.append(1))
    monkeypatch.setattr(versions, "installed", lambda dist: "9.1.0")
    monkeypatch.setattr(torchnames, "_CHANGED", [])
    monkeypatch.setattr(torchnames, "_SAID", set())
    with pytest.warns(RuntimeWarning, match="torch 9.1.0 is newer") as said:
        torchnames.require_torch(door="omnilearn.setup")
        torchnames.require_torch(door="omnilearn.setup")
    assert len(calls) == 1 and len(said) == 1


def test_require_torch_refuses_a_changed_name_unless_allowed(monkeypatch):
    monkeypatch.setattr(torchnames, "changed", lambda: ("Reducer._reset_state()", "bsp/memory.py"))
    monkeypatch.setattr(versions, "installed", lambda dist: "9.1.0")
    monkeypatch.setattr(torchnames, "_CHANGED", [])
    monkeypatch.setattr(torchnames, "_SAID", set())
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"changed Reducer._reset_state\(\)"):
        torchnames.require_torch(door="omnilearn.setup")
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"changed Reducer._reset_state\(\)"):
        torchnames.require_torch(door="omnilearn.setup")
