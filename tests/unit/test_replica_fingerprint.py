"""The replica fingerprint and its comparison (``omnilearn.bsp.replicas``), in one process.

Run: ``python -m pytest -q tests/unit/test_replica_fingerprint.py``
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from omnilearn.bsp import replicas


def test_equal_replicas_agree_and_any_parameter_moved_shows():
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 2))
    b = copy.deepcopy(a)
    assert replicas.parted([replicas.fingerprint(a), replicas.fingerprint(b)]) == []
    for i, p in enumerate(b.parameters()):
        c = copy.deepcopy(a)
        with torch.no_grad():
            list(c.parameters())[i].view(-1)[0] += 1e-4  # one entry of one tensor, one SGD step's size
        assert replicas.parted([replicas.fingerprint(a), replicas.fingerprint(b), replicas.fingerprint(c)]) == [2]


def test_moving_a_value_between_tensors_shows():
    a = nn.ParameterList([nn.Parameter(torch.tensor([3.0])), nn.Parameter(torch.tensor([4.0]))])
    b = nn.ParameterList([nn.Parameter(torch.tensor([4.0])), nn.Parameter(torch.tensor([3.0]))])
    assert replicas.parted([replicas.fingerprint(a), replicas.fingerprint(b)]) == [1]


def test_no_fingerprint_compares_nothing_and_the_error_is_one_line():
    assert replicas.parted([replicas.NONE, (1.0, 2.0)]) == []
    said = str(replicas.parted_error([1, 3], "the end of a control interval after 8 steps"))
    assert "\n" not in said and "rank(s) [1, 3]" in said and "no_sync()" in said
