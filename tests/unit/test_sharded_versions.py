"""FSDP2's private state across torch releases: the parameter groups OmniLearn times are found in each.

torch 2.13 keeps a unit's groups in a list (``_fsdp_param_groups``); torch 2.11, which a GPU machine here ran,
has only ``_fsdp_param_group`` (one group or None). Wrapping an FSDP model on 2.11 failed with AttributeError.
"""

from __future__ import annotations

from types import SimpleNamespace

from omnilearn.bsp.sharded import param_groups


def unit(**state) -> SimpleNamespace:
    return SimpleNamespace(_get_fsdp_state=lambda: SimpleNamespace(**state))


def test_the_list_of_newer_torch_is_used_whole():
    assert param_groups(unit(_fsdp_param_groups=["a", "b"], _fsdp_param_group="a")) == ["a", "b"]
    assert param_groups(unit(_fsdp_param_groups=[])) == []


def test_the_single_group_of_torch_2_11_is_found():
    assert param_groups(unit(_fsdp_param_group="a")) == ["a"]
    assert param_groups(unit(_fsdp_param_group=None)) == []
