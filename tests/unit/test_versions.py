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
