"""``tools/suite_times.py``: pytest's durations summed per file and phase; bad input refused in one line.

Run: ``python -m pytest -q tests/unit/test_suite_times.py``
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import suite_times  # noqa: E402
import suitecost  # noqa: E402  (tests/, on the path as the suite's helpers are)

LOG = """
============================= slowest durations ==============================
61.00s setup    tests/exactness/test_matrix.py::test_cell[a]
0.50s call     tests/exactness/test_matrix.py::test_cell[a]
0.25s call     tests/exactness/test_matrix.py::test_cell[b]
3.00s call     tests/unit/test_x.py::test_y
0.10s teardown tests/unit/test_x.py::test_y
1804 passed in 1096.99s
"""


def test_durations_are_summed_per_file_and_phase():
    files = suite_times.per_file(LOG)
    assert files == {"tests/exactness/test_matrix.py": {"setup": 61.0, "call": 0.75, "teardown": 0.0},
                     "tests/unit/test_x.py": {"setup": 0.0, "call": 3.0, "teardown": 0.1}}
    rows = suite_times.table(files, 1)
    assert len(rows) == 3 and rows[1].startswith("tests/exactness/test_matrix.py") and "95.2%" in rows[1]


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    assert suite_times.main([str(tmp_path / "none.log")]) == 2
    empty = tmp_path / "empty.log"
    empty.write_text("1 passed\n")
    assert suite_times.main([str(empty)]) == 2
    assert suite_times.main([str(empty), "--top", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "no such file" in err[0] and "holds no durations" in err[1] and "--top 0" in err[2]


def test_write_keeps_the_budget_and_ranks_the_files(tmp_path):
    log, costs = tmp_path / "suite.log", tmp_path / "costs.json"
    log.write_text(LOG)
    costs.write_text('{"budget_share": 0.07, "files": {"tests/gone.py": 9.0}}')
    assert suite_times.main([str(log), "--write", str(costs)]) == 0
    files, budget = suitecost.load(costs)
    assert budget == 0.07 and list(files) == ["tests/exactness/test_matrix.py", "tests/unit/test_x.py"]
    assert files["tests/unit/test_x.py"] == 3.1


def test_the_dearest_files_run_first_and_each_file_keeps_its_order():
    ids = ["a.py::t1", "b.py::t1", "a.py::t2", "c.py::t1", "b.py::t2"]
    assert suitecost.order(ids, str, {"b.py": 5.0, "a.py": 1.0}) == ["b.py::t1", "b.py::t2", "a.py::t1", "a.py::t2",
                                                                    "c.py::t1"]


def test_a_file_over_its_share_fails_the_whole_run_by_name():
    files = suitecost.per_file([("a.py::t1[x]", 30.0), ("a.py::t1[x]", 1.0), ("b.py::t", 60.0), ("c.py::t", 9.0)])
    assert files == {"a.py": 31.0, "b.py": 60.0, "c.py": 9.0}
    assert suitecost.over_budget(files, 0.6) == []
    assert suitecost.over_budget(files, 0.3) == [("b.py", 0.6), ("a.py", 0.31)]
    lines = suitecost.report(files, 0.5, top=2)
    assert len(lines) == 4 and "b.py" in lines[1] and "a.py" in lines[2]
    assert lines[-1].startswith("suite budget exceeded: b.py takes 60.0%") and "a.py" not in lines[-1]
    assert not suitecost.report(files, 0.6)[-1].startswith("suite budget exceeded")


def test_the_checked_in_costs_name_only_files_that_exist():
    files, budget = suitecost.load()
    root = Path(__file__).resolve().parents[2]
    assert 0 < budget < 0.2 and files
    assert [name for name in files if not (root / name).is_file()] == []


def test_a_costs_file_that_cannot_be_written_is_one_line_and_left_as_it_was(tmp_path, capsys):
    log, bad = tmp_path / "suite.log", tmp_path / "bad.json"
    log.write_text(LOG)
    bad.write_text("{not json")
    assert suite_times.main([str(log), "--write", str(tmp_path / "none" / "c.json")]) == 2
    assert suite_times.main([str(log), "--write", str(bad)]) == 2
    bad_share = tmp_path / "share.json"
    bad_share.write_text('{"budget_share": 2, "files": {}}')
    assert suite_times.main([str(log), "--write", str(bad_share)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 3 and "no directory" in lines[0] and "not a costs file" in lines[1]
    assert "budget_share 2 must be a share" in lines[2]
    assert bad.read_text() == "{not json" and not (tmp_path / "none").exists()
