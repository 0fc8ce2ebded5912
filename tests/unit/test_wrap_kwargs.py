"""DDP keywords that would change how DDP reduces (outside the weighting and the step's marks) are refused by ol.wrap_model in one line.

Run: python -m pytest -q tests/unit/test_wrap_kwargs.py
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnilearn.bsp.wrap import UNWEIGHTED_DDP_KWARGS, wrap
from omnilearn.config import ConfigError
from omnilearn.bsp.backward import HookState


@pytest.mark.parametrize("name", sorted(UNWEIGHTED_DDP_KWARGS))
def test_a_keyword_that_bypasses_the_weighting_is_refused_before_any_wrapping(name):
    value = {"mixed_precision": object(), "delay_all_reduce_named_params": [("w", nn.Parameter(torch.ones(1)))],
             "param_to_hook_all_reduce": nn.Parameter(torch.ones(1))}[name]
    with pytest.raises(ConfigError) as e:  # no process group needed: refused before DDP is built
        wrap(nn.Linear(2, 2), torch.device("cpu"), True, HookState(), **{name: value})
    assert name in str(e.value) and "\n" not in str(e.value)


def test_ordinary_ddp_keywords_pass_the_check():
    model = wrap(nn.Linear(2, 2), torch.device("cpu"), False, HookState(), find_unused_parameters=True,
                 mixed_precision=None)
    assert isinstance(model, nn.Linear)
