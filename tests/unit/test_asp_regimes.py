"""``tools/asp_regimes.py``: the event-driven ASP run on a virtual clock models what it says.

Four workers at speeds 1:1:1:4 with no fixed time per push (a cycle is ``b x sample_ms x 4 / s``), the ``mlp``,
global batch 64, a decision every 2 x 4 pushes, one epoch:

- ``uniform`` keeps 16 each and the fast worker pushes about 4 times as often as a slow one;
- ``omnilearn`` moves the batches to the fast worker (about 4:1) until all four push at about the same rate;
- every run is evaluated at its epoch's end and its staleness counted per push.

Run: ``python -m pytest -q tests/unit/test_asp_regimes.py``
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "asp_regimes.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("asp_regimes", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_uniform_pushes_at_the_speeds_and_balanced_at_one_rate(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert load_tool().main(["--workers", "4", "--speeds", "1,1,1,4", "--model", "mlp", "--global-batch", "64",
                             "--control-interval", "2", "--epochs", "1", "--seeds", "1", "--fixed-ms", "0",
                             "--json", str(out)]) == 0
    runs = {r["arm"]: r for r in json.loads(out.read_text())["runs"]}
    uniform, balanced = runs["uniform"], runs["omnilearn"]
    assert uniform["batches"] == [16, 16, 16, 16]
    assert 3 * uniform["pushes"][0] < uniform["pushes"][3] < 5 * uniform["pushes"][0], uniform["pushes"]
    slow, fast = balanced["batches"][0], balanced["batches"][3]
    assert 3 * slow <= fast <= 5 * slow and sum(balanced["batches"]) == 64, balanced["batches"]
    late = balanced["pushes"]  # most of the epoch at the balanced plan: the rates within 30%
    assert max(late) < 1.3 * min(late), late
    for run in (uniform, balanced):
        assert [e for e, _, _ in run["evals"]] == [1] and 0 <= run["p50"] <= run["p99"] <= run["max"]
    assert "equal epochs" in capsys.readouterr().out
