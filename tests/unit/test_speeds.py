"""Unit tests for worker speeds, heterogeneity levels and schedules (``omnilearn.emulation.speeds``).

Covers ``parse_speeds`` (comma lists, paper levels, every error path),
``slowdown``, the paper's HL1->2->4->8->8->4->2->1 routine (checked through
the speed in force at each step, not the internal lists), and TOML schedules
loaded from temporary files, including each error message naming the file.

Run:  cd /work/main && python -m pytest -q tests/unit/test_speeds.py
"""

from __future__ import annotations

import re
from itertools import groupby

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omnilearn.emulation.speeds import (
    ASP_LEVELS,
    BSP_LEVELS,
    PAPER_ROUTINE,
    SpeedError,
    SpeedSchedule,
    load_schedule,
    paper_schedule,
    parse_speeds,
    slowdown,
)

SETTINGS = settings(max_examples=100, deadline=None)
RUN_LEVELS = ["HL1", "HL2", "HL4", "HL8", "HL4", "HL2", "HL1"]  # the routine with the HL8 blocks merged


# ---------------------------------------------------------------- parse_speeds


def test_parse_comma_list():
    assert parse_speeds("4,2,1", 3) == (4.0, 2.0, 1.0)
    assert parse_speeds(" 0.5 , 1.5 ", 2) == (0.5, 1.5)
    assert all(isinstance(s, float) for s in parse_speeds("4,2,1", 3))


@pytest.mark.parametrize("text", ["HL8", "hl8", "Hl8", " hL8 "])
def test_parse_level_case_insensitive(text):
    assert parse_speeds(text, 4) == (6.0, 6.0, 4.0, 32.0)


def test_parse_levels_tables():
    for name, cores in BSP_LEVELS.items():
        assert parse_speeds(name, 4) == tuple(float(c) for c in cores)
        assert parse_speeds(name, 4, ASP_LEVELS) == tuple(float(c) for c in ASP_LEVELS[name])
        # the level's name is its heterogeneity: fastest / slowest
        assert max(cores) / min(cores) == int(name[2:])
        assert max(ASP_LEVELS[name]) / min(ASP_LEVELS[name]) == pytest.approx(int(name[2:]), rel=0.15)


@SETTINGS
@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=8), st.integers(1, 8))
def test_parse_count_checked(speeds, workers):
    text = ",".join(repr(s) for s in speeds)
    if len(speeds) == workers:
        assert parse_speeds(text, workers) == pytest.approx(tuple(speeds))
    else:
        with pytest.raises(SpeedError) as e:
            parse_speeds(text, workers)
        msg = str(e.value).replace(text, "")
        assert re.search(rf"\b{len(speeds)}\b", msg) and re.search(rf"\b{workers}\b", msg)


def test_wrong_count_names_both_counts():
    with pytest.raises(SpeedError) as e:
        parse_speeds("4,2,1", 4)
    msg = str(e.value).replace("4,2,1", "")
    assert "3" in msg and "4" in msg
    with pytest.raises(SpeedError) as e:
        parse_speeds("HL8", 3)
    assert "4" in str(e.value) and "3" in str(e.value)


@pytest.mark.parametrize("workers", [1, 2, 4, 16])
def test_hl1_is_equal_speeds_at_any_worker_count(workers):
    assert parse_speeds("HL1", workers) == BSP_LEVELS["HL1"][:1] * workers  # others: the paper's 4-worker mixes


@pytest.mark.parametrize(
    "text",
    ["0,1,2", "-1,1,2", "1,nan,2", "1,inf,2", "1,-inf,2", "1,1e400,2", "a,b,c", "1,,2", "", "1;2;3", "fast,2,1", "1,2,x"],
)
def test_parse_rejects_bad_values(text):
    with pytest.raises(SpeedError):
        parse_speeds(text, 3)


def test_speed_error_is_value_error():
    assert issubclass(SpeedError, ValueError)


@pytest.mark.parametrize("text", ["HL3", "hl16", "HL", "HLx"])
def test_unknown_level_names_valid_levels(text):
    with pytest.raises(SpeedError) as e:
        parse_speeds(text, 4)
    msg = str(e.value)
    for level in ("HL1", "HL2", "HL4", "HL8"):
        assert level in msg


# ---------------------------------------------------------------- slowdown


def test_slowdown():
    assert [slowdown((4, 2, 1), r) for r in range(3)] == [1.0, 2.0, 4.0]
    assert [slowdown(BSP_LEVELS["HL8"], r) for r in range(4)] == [32 / 6, 32 / 6, 8.0, 1.0]


@SETTINGS
@given(st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=10))
def test_slowdown_properties(speeds):
    downs = [slowdown(speeds, r) for r in range(len(speeds))]
    assert min(downs) == pytest.approx(1.0)
    assert all(d >= 1.0 for d in downs)
    for s, d in zip(speeds, downs):
        assert s * d == pytest.approx(max(speeds))


# ---------------------------------------------------------------- paper schedule


def _per_step(sched: SpeedSchedule, total: int) -> list[tuple[float, ...]]:
    return [sched.at(s) for s in range(total)]


def _level_of(speeds) -> str:
    return next(k for k, v in BSP_LEVELS.items() if tuple(map(float, v)) == tuple(map(float, speeds)))


def test_paper_schedule_80_steps():
    sched = paper_schedule(total_steps=80, workers=4)
    steps = [_level_of(sched.at(s)) for s in range(80)]
    expected = [lvl for lvl in PAPER_ROUTINE for _ in range(10)]
    assert steps == expected
    runs = [(k, len(list(g))) for k, g in groupby(steps)]
    assert runs == list(zip(RUN_LEVELS, [10, 10, 10, 20, 10, 10, 10]))
    assert _level_of(sched.at(10_000)) == "HL1"  # past the end: the last level stays


@SETTINGS
@given(st.integers(8, 500))
def test_paper_schedule_equal_blocks(total):
    sched = paper_schedule(total, 4)
    steps = [_level_of(x) for x in _per_step(sched, total)]
    runs = [(k, len(list(g))) for k, g in groupby(steps)]
    assert [k for k, _ in runs] == RUN_LEVELS
    lo, hi = total // 8, -(-total // 8)
    for k, n in runs:
        if k == "HL8":
            assert 2 * lo <= n <= 2 * hi
        else:
            assert lo <= n <= hi
    assert sum(n for _, n in runs) == total


@pytest.mark.parametrize("total", [0, 1, 2, 3, 5, 7])
def test_paper_schedule_tiny_runs(total):
    sched = paper_schedule(total, 4)
    assert sched.starts[0] == 0
    assert list(sched.starts) == sorted(set(sched.starts))
    levels = [_level_of(sched.at(s)) for s in range(max(total, 1))]
    # levels in force appear in the routine's order
    it = iter(PAPER_ROUTINE)
    assert all(any(lvl == r for r in it) for lvl, _ in groupby(levels))


@pytest.mark.parametrize("workers", [1, 3, 5, 8])
def test_paper_schedule_needs_four_workers(workers):
    with pytest.raises(SpeedError, match=str(workers)):
        paper_schedule(80, workers)


def test_speed_schedule_validates_starts():
    with pytest.raises(SpeedError):
        SpeedSchedule((1, 5), ((1.0,), (2.0,)))
    with pytest.raises(SpeedError):
        SpeedSchedule((0, 5, 5), ((1.0,), (2.0,), (3.0,)))
    with pytest.raises(SpeedError):
        SpeedSchedule((), ())
    c = SpeedSchedule.constant((3, 1))
    assert c.at(0) == c.at(10**6) == (3, 1)


# ---------------------------------------------------------------- TOML schedules


def _write(tmp_path, text: str, name: str = "sched.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_load_schedule_steps_epochs_levels_lists(tmp_path):
    path = _write(
        tmp_path,
        """
[[change]]
at_step = 0
speeds = "HL1"

[[change]]
at_epoch = 2
speeds = [1, 2, 3.5, 4]

[[change]]
at_step = 7
speeds = "hl8"
""",
    )
    sched = load_schedule(path, workers=4, steps_per_epoch=10)
    assert sched.starts == (0, 7, 20)
    assert sched.at(0) == sched.at(6) == (12.0, 12.0, 12.0, 12.0)
    assert sched.at(7) == sched.at(19) == (6.0, 6.0, 4.0, 32.0)
    assert sched.at(20) == sched.at(999) == (1.0, 2.0, 3.5, 4.0)


def test_load_schedule_epoch_zero_and_asp_levels(tmp_path):
    path = _write(tmp_path, '[[change]]\nat_epoch = 0\nspeeds = "HL4"\n')
    assert load_schedule(path, 4, 5, ASP_LEVELS).at(3) == (10.0, 10.0, 4.0, 16.0)


ERROR_CASES = {
    "bad_toml": "[[change]\nat_step = 0\n",
    "no_change": 'title = "x"\n',
    "empty_change": "change = []\n",
    "no_step_zero": '[[change]]\nat_step = 3\nspeeds = "HL1"\n',
    "both_at": '[[change]]\nat_step = 0\nat_epoch = 0\nspeeds = "HL1"\n',
    "neither_at": '[[change]]\nspeeds = "HL1"\n',
    "no_speeds": "[[change]]\nat_step = 0\n",
    "negative_step": '[[change]]\nat_step = 0\nspeeds = "HL1"\n[[change]]\nat_step = -2\nspeeds = "HL2"\n',
    "float_step": '[[change]]\nat_step = 0.5\nspeeds = "HL1"\n',
    "speeds_not_list": "[[change]]\nat_step = 0\nspeeds = 4\n",
    "speeds_strings": '[[change]]\nat_step = 0\nspeeds = ["a", "b", "c", "d"]\n',
}


@pytest.mark.parametrize("case", sorted(ERROR_CASES))
def test_load_schedule_errors_name_file(tmp_path, case):
    path = _write(tmp_path, ERROR_CASES[case], name=f"my_{case}.toml")
    with pytest.raises(SpeedError) as e:
        load_schedule(path, workers=4, steps_per_epoch=10)
    assert path in str(e.value)


def test_load_schedule_missing_file_names_file(tmp_path):
    path = str(tmp_path / "does_not_exist.toml")
    with pytest.raises(SpeedError) as e:
        load_schedule(path, 4, 10)
    assert path in str(e.value)


BAD_SPEEDS_MSG = "load_schedule: SpeedError for bad speeds inside the file does not name the file"

BAD_SPEED_CASES = {
    "count_list": "[[change]]\nat_step = 0\nspeeds = [4, 2, 1]\n",
    "count_text": '[[change]]\nat_step = 0\nspeeds = "4,2,1"\n',
    "nonpositive_list": "[[change]]\nat_step = 0\nspeeds = [4, 2, 0, 1]\n",
    "unknown_level": '[[change]]\nat_step = 0\nspeeds = "HL3"\n',
}


@pytest.mark.parametrize("case", sorted(BAD_SPEED_CASES))
def test_load_schedule_bad_speeds_raise(tmp_path, case):
    path = _write(tmp_path, BAD_SPEED_CASES[case], name=f"my_{case}.toml")
    with pytest.raises(SpeedError):
        load_schedule(path, workers=4, steps_per_epoch=10)


@pytest.mark.parametrize("case", sorted(BAD_SPEED_CASES))
def test_load_schedule_bad_speeds_name_file(tmp_path, case):
    path = _write(tmp_path, BAD_SPEED_CASES[case], name=f"my_{case}.toml")
    with pytest.raises(SpeedError) as e:
        load_schedule(path, workers=4, steps_per_epoch=10)
    assert path in str(e.value)


def test_load_schedule_wrong_count_names_counts(tmp_path):
    path = _write(tmp_path, "[[change]]\nat_step = 0\nspeeds = [4, 2, 1]\n")
    with pytest.raises(SpeedError) as e:
        load_schedule(path, workers=4, steps_per_epoch=10)
    msg = str(e.value).replace(path, "")
    assert "3" in msg and "4" in msg


def test_nan_in_schedule_list_rejected(tmp_path):
    path = _write(tmp_path, "[[change]]\nat_step = 0\nspeeds = [1.0, nan, 2.0, 3.0]\n")
    with pytest.raises(SpeedError):
        load_schedule(path, 4, 10)


def test_load_schedule_rejects_boolean_step(tmp_path):
    path = _write(tmp_path, '[[change]]\nat_step = 0\nspeeds = "HL1"\n[[change]]\nat_step = true\nspeeds = "HL8"\n')
    with pytest.raises(SpeedError):
        load_schedule(path, 4, 10)
