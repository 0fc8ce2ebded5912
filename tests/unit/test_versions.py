"""omnilearn.versions: the tested-range check each front door makes at setup (pure; no framework imported).

Run: python -m pytest -q tests/unit/test_versions.py
"""

from __future__ import annotations

import pytest

from omnilearn import versions
from omnilearn.config import ConfigError


@pytest.mark.parametrize("text, parts", [("4.57.1", (4, 57, 1)), ("5.0.0rc1", (5, 0, 0)), ("2.13.0+cpu", (2, 13, 0)),
                                         ("2.6", (2, 6, 0)), ("v1.2.3.4", (1, 2, 3, 4))])
def test_release_reads_the_numeric_part(text, parts):
    assert versions.release(text) == parts


def test_release_refuses_what_is_no_version():
    with pytest.raises(ValueError, match="not a version"):
        versions.release("dev")


@pytest.mark.parametrize("text, parsed", [("1!2.14.0", (1, (2, 14, 0))), ("0!2.13.0+cu130", (0, (2, 13, 0))),
                                          ("2.15.0", (0, (2, 15, 0))), ("", None), ("unknown", None), ("dev", None),
                                          ("!2.1", None)])
def test_parse_reads_pep440_epochs_and_gives_none_for_no_version(text, parsed):
    assert versions.parse(text) == parsed


@pytest.mark.parametrize("version, where", [("2.10.9", "older"), ("2.11.0", "inside"), ("2.15.9+cu130", "inside"),
                                            ("2.16.0", "newer"), ("2.16.0rc1", "newer"), ("1!2.12.0", "newer"),
                                            ("1!1.0", "newer"), ("unknown", "unknown"), ("", "unknown")])
def test_placement_against_a_range(version, where):
    assert versions.placement(version, "2.11", "2.16") == where


@pytest.mark.parametrize("version, inside", [("2.9.9", False), ("2.10.0", True), ("2.13.1", True),
                                             ("2.14.0", False), ("2.14.0rc1", False), ("3.0", False)])
def test_range_is_low_inclusive_high_exclusive(version, inside):
    assert versions.in_range(version, "2.10", "2.14") is inside


def test_an_untested_version_is_refused_in_one_line_naming_version_range_and_fix(monkeypatch):
    monkeypatch.setitem(versions.TESTED, "fakelib", ("1.2", "1.4"))
    monkeypatch.setattr(versions, "installed", lambda dist: "1.4.2")
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        versions.require_tested("fakelib", door="TheDoor")
    message = str(e.value)
    assert "\n" not in message and message.startswith("TheDoor: fakelib 1.4.2")
    assert "fakelib>=1.2,<1.4" in message and versions.ALLOW_ENV in message


def test_a_tested_version_and_a_missing_package_pass(monkeypatch):
    monkeypatch.setitem(versions.TESTED, "fakelib", ("1.2", "1.4"))
    monkeypatch.setattr(versions, "installed", lambda dist: "1.3.0")
    versions.require_tested("fakelib", door="TheDoor")
    monkeypatch.setattr(versions, "installed", lambda dist: None)
    versions.require_tested("fakelib", door="TheDoor")


def test_the_escape_hatch_warns_instead(monkeypatch):
    monkeypatch.setitem(versions.TESTED, "fakelib", ("1.2", "1.4"))
    monkeypatch.setattr(versions, "installed", lambda dist: "0.9")
    monkeypatch.setenv(versions.ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match="fakelib 0.9"):
        versions.require_tested("fakelib", door="TheDoor")


def test_every_installed_framework_of_the_test_environment_is_in_its_tested_range():
    """The versions this suite runs on are the versions the doors accept (the ranges in docs/versions.md)."""
    for dist in versions.TESTED:
        version = versions.installed(dist)
        if version is not None:
            assert versions.untested(dist, version, "test") is None, (dist, version)


@pytest.mark.parametrize("version", ["", "unknown", "1!2.3"])
def test_an_unreadable_or_epoch_version_of_another_framework_is_one_line_not_a_traceback(monkeypatch, version):
    monkeypatch.setitem(versions.TESTED, "fakelib", ("1.2", "1.4"))
    monkeypatch.setattr(versions, "installed", lambda dist: version)
    monkeypatch.delenv(versions.ALLOW_ENV, raising=False)
    with pytest.raises(ConfigError) as e:
        versions.require_tested("fakelib", door="TheDoor")
    message = str(e.value)
    assert "\n" not in message and message.startswith("TheDoor: fakelib") and "fakelib>=1.2,<1.4" in message


def _torch(version, changed=None):
    lo, hi = versions.TESTED["torch"]
    asked = []

    def check():
        asked.append(1)
        return changed
    line, refused = versions.torch_problem(version, "omnilearn.setup", check)
    return line, refused, len(asked), lo, hi


def test_torch_inside_the_range_is_not_checked_further():
    line, refused, asked, _, _ = _torch(f"{versions.TESTED['torch'][0]}.0")
    assert (line, refused, asked) == ("", False, 0)


@pytest.mark.parametrize("version", ["9.0.0", "1!2.12.0", "unknown", "", None])
def test_a_newer_or_unreadable_torch_runs_with_one_line_when_the_private_names_hold(version):
    line, refused, asked, lo, hi = _torch(version)
    assert not refused and asked == 1 and "\n" not in line and line.startswith("omnilearn.setup: torch")
    assert "private names of torch it relies on hold, so it runs" in line
    assert (f"newer than the releases OmniLearn was tested with (torch>={lo},<{hi})" in line) == (version in
                                                                                                 ("9.0.0", "1!2.12.0"))


@pytest.mark.parametrize("version", ["9.0.0", "unknown"])
def test_a_newer_or_unreadable_torch_whose_private_name_changed_is_refused_naming_it(version):
    line, refused, asked, lo, hi = _torch(version, ("FSDPParamGroup.reduce_grads", "bsp/sharded.py"))
    assert refused and asked == 1 and "\n" not in line
    assert "changed FSDPParamGroup.reduce_grads, which OmniLearn relies on (bsp/sharded.py)" in line
    assert f"pip install 'torch>={lo},<{hi}'" in line and versions.ALLOW_ENV in line


def test_an_older_torch_is_refused_by_its_number_without_the_check():
    line, refused, asked, lo, hi = _torch("2.0.1")
    assert refused and asked == 0 and "torch 2.0.1 is outside the versions" in line
