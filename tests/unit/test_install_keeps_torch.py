"""Installing OmniLearn beside any supported torch never changes that torch (issue 51).

pip's own resolver, on OmniLearn's own metadata (a wheel built from this tree), decides what an install into an
environment holding torch X would change: a virtual environment carrying torch X's and numpy's installed metadata,
``pip install --dry-run --no-index --report``. For every release of the declared range's ends and the ones the
suite ran on (2.13.0, 2.14.1, 2.15.0) and a newer one (the dependency has no upper bound: a release past the
tested range is checked at setup by its private names, never replaced at install), pip installs OmniLearn alone;
for a release below the floor it would replace torch (the check fails, as the old ``<2.14`` pin failed on 2.14.1).
The venv holds metadata, not the multi-GB builds: the real installs (a venv with the real 2.14.1 and 2.15.0, the README's test
command) are ``tools/torch_release_check.sh``, which checks the same thing on them.

Run: ``python -m pytest -q tests/unit/test_install_keeps_torch.py``
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """OmniLearn's wheel, built from a copy of the tree (the build leaves nothing in the checkout)."""
    tree = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    out = tree / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(tree)], check=True, capture_output=True, env=_pip_env())
    return next(out.glob("*.whl"))


def _pip_env() -> dict:
    """pip with no index, no find-links and no machine-wide constraints: only what the venv holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def _would_install(wheel: Path, venv: Path, torch_version: str) -> tuple[int, list[tuple[str, str]], str]:
    """What ``pip install WHEEL`` into a venv holding torch ``torch_version`` would install: (exit code, the
    (name, version) it would install, pip's output)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    for name, version in (("torch", torch_version), ("numpy", "2.1.0"), ("tomli", "2.0.1")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "INSTALLER").write_text("pip\n")
        (info / "RECORD").write_text("")
    report = venv / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                           "--dry-run", "--no-index", "--report", str(report), str(wheel)],
                          capture_output=True, text=True, env=_pip_env())
    installs = []
    if done.returncode == 0:
        installs = [(i["metadata"]["name"], i["metadata"]["version"])
                    for i in json.loads(report.read_text())["install"]]
    return done.returncode, installs, done.stdout + done.stderr


@pytest.mark.parametrize("torch_version", ["2.11.0", "2.13.0", "2.14.1", "2.15.0", "2.15.0+cu130",
                                           "2.16.0"])
def test_an_install_beside_a_supported_torch_installs_omnilearn_alone(wheel, tmp_path, torch_version):
    code, installs, said = _would_install(wheel, tmp_path / "venv", torch_version)
    assert code == 0 and [name for name, _ in installs] == ["omnilearn-hetero"], said


def test_an_install_beside_a_torch_below_the_floor_would_change_it(wheel, tmp_path):
    """The check can fail: a torch the declared range excludes is one pip would replace (here, with no index, it
    cannot, and says so)."""
    code, installs, said = _would_install(wheel, tmp_path / "venv", "2.10.0")
    assert code != 0 or any(name == "torch" for name, _ in installs), said
    assert "torch" in said
