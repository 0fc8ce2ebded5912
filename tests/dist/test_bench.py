"""``omnilearn bench`` end to end on a tiny budget, and ``omnilearn report`` on its output.

Run: ``python -m pytest -q tests/dist/test_bench.py`` (about a minute on 2 cores).
"""

from __future__ import annotations

import json

import pytest

from omnilearn.cli import main

pytestmark = pytest.mark.dist


def test_bench_runs_every_arm_and_writes_json_table_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(["bench", "--quick", "--speeds", "HL1,paper", "--steps", "12", "--block-steps", "6",
                 "--control-interval", "3", "--global-batch", "256", "--target-accuracy", "0.05", "--out", str(out)])
    assert code == 0
    bench = json.loads((out / "bench.json").read_text())
    arms = {(r["setting"], r["arm"]) for r in bench["results"]}
    assert arms == {("HL1", a) for a in ("uniform", "static", "omnilearn", "ddp")} | {
        ("paper", a) for a in ("uniform", "static", "omnilearn")}
    by = {(r["setting"], r["arm"]): r for r in bench["results"]}
    assert by[("HL1", "uniform")]["speedup"] == pytest.approx(1.0)
    assert by[("HL1", "ddp")]["speedup"] > 0 and by[("HL1", "ddp")]["steps"] == 12
    paper = by[("paper", "omnilearn")]
    assert paper["steps"] == 48 and len(paper["reaction_steps"]) >= 4
    assert 0 < paper["balance_efficiency"] <= 1.2
    assert paper["time_to_accuracy_s"] is not None  # 5% is reached at the first evaluation
    assert "fidelity_error" in by[("HL1", "uniform")]
    table = capsys.readouterr().out
    assert "| paper | omnilearn |" in table and "| HL1 | ddp |" in table
    for png in ("speedup.png", "efficiency.png", "paper-omnilearn/batches.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A second bench into the same directory is refused, and the first is left as it was.
    assert main(["bench", "--quick", "--speeds", "HL1", "--out", str(out)]) == 2
    assert json.loads((out / "bench.json").read_text()) == bench
