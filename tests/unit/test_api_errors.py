"""The Python API speaks Python: errors name keywords, not CLI flags; defaults follow the job.

- :func:`omnilearn.config.api_wording` turns ``--min-batch 8`` into ``min_batch=8`` (and leaves what is
  not a keyword alone); ``omnilearn.setup()`` raises every ``ConfigError`` in that wording, one line;
- an unknown keyword to ``setup()`` is named with the valid ones;
- ``ConfigError`` and ``BalanceConfig`` are exported without importing torch;
- ``min_batch`` not given is derived from the per-worker batch (:func:`omnilearn.config.derive_min_batch`):
  always feasible, never above the share, at least one sample per micro-batch.

Run: ``python -m pytest -q tests/unit/test_api_errors.py``
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

import omnilearn
from omnilearn.balance.allocation import check_feasible
from omnilearn.config import BalanceConfig, ConfigError, api_wording, derive_min_batch


@pytest.mark.parametrize("flags, words", [
    ("--min-batch 8 is below --accumulation-steps 16: use --min-batch 16 or more",
     "min_batch=8 is below accumulation_steps=16: use min_batch=16 or more"),
    ("--max-batch 256,64,64 gives 3 caps", "max_batch=256,64,64 gives 3 caps"),
    ("lower --min-batch or raise --max-batch", "lower min_batch or raise max_batch"),
    ("--emulator docker needs --containers", "emulator=docker needs containers"),
    ("--config x.toml and --epochs 3 are CLI-only", "--config x.toml and --epochs 3 are CLI-only"),
])
def test_flags_become_keywords(flags, words):
    assert api_wording(flags) == words


@pytest.mark.parametrize("settings, said", [
    ({"bogus": 1}, "omnilearn.setup() got an unknown keyword bogus=1; valid ones: accumulation_steps, "),
    ({"control_interval": 0}, "control_interval=0 must be positive"),
    ({"global_batch": 16, "min_batch": 17}, "min_batch"),
    ({"controller": "pid"}, "unknown controller 'pid'; choose one of"),
    ({"deadband": 2.0}, "deadband=2.0 must be in [0, 1)"),
    ({"min_window_s": -1.0}, "min_window_s=-1 must be in [0, 604800] seconds, e.g. 0.15"),
])
def test_setup_errors_are_one_line_and_name_keywords(settings, said):
    with pytest.raises(ConfigError) as e:
        omnilearn.setup(device="cpu", **settings)
    message = str(e.value)
    assert said in message and "\n" not in message and "--" not in message, message


def test_unknown_keyword_lists_every_valid_one():
    with pytest.raises(ConfigError) as e:
        omnilearn.setup(globl_batch=64)
    for name in ("global_batch", "local_batch", "total_steps", "speeds", "min_batch"):
        assert name in str(e.value)


def test_config_error_is_exported_without_torch():
    code = ("import sys, omnilearn; from omnilearn import ConfigError, BalanceConfig; "
            "assert 'ConfigError' in dir(omnilearn) and issubclass(ConfigError, ValueError); "
            "assert 'torch' not in sys.modules, 'import omnilearn pulled in torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_min_batch_follows_the_per_worker_batch():
    assert BalanceConfig(workers=2, global_batch=16).min_batch == 2  # not 8: 8/8 could never move
    assert BalanceConfig(workers=4, global_batch=512).min_batch == 8
    assert BalanceConfig(workers=2, global_batch=16, min_batch=8).min_batch == 8  # given: kept
    assert BalanceConfig(workers=4, global_batch=256, max_batch=(256, 4, 64, 64)).min_batch == 4  # below a cap
    assert BalanceConfig(global_batch=16).min_batch is None  # workers unknown yet: derived when known


@given(batch=st.integers(1, 4096), workers=st.integers(1, 64), steps=st.integers(1, 8))
def test_derived_min_batch_is_always_feasible(batch, workers, steps):
    if batch < workers * steps:
        return
    low = derive_min_batch(batch, workers, steps)
    assert steps <= low <= max(steps, 8) and low <= batch // workers
    check_feasible(batch, workers, low, batch)  # must not raise


def test_speeds_that_do_not_match_the_process_group_say_so():
    with pytest.raises(ConfigError) as e:
        omnilearn.setup(speeds="3,1,2", device="cpu")
    assert str(e.value).startswith("speeds='3,1,2' give 3 workers but the process group has 1 (torchrun "
                                   "--nproc-per-node 3 starts 3)"), str(e.value)


def test_a_single_cap_lowers_the_derived_min_batch_so_the_error_names_the_real_problem():
    with pytest.raises(ConfigError, match="global batch 512 is larger than workers x max batch = 4 x 4"):
        BalanceConfig(workers=4, global_batch=512, max_batch=4)  # not "min batch 8 > max batch 4"
    assert BalanceConfig(workers=4, global_batch=16, max_batch=6).min_batch == 1  # a quarter of the share 4
