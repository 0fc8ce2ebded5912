"""``tools/suite_times.py``: pytest's durations summed per file and phase; bad input refused in one line.

Run: ``python -m pytest -q tests/unit/test_suite_times.py``
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import suite_times  # noqa: E402

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
