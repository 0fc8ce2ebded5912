#!/usr/bin/env bash
# OmniLearn against another torch release, in a virtual environment of its own (docs/versions.md):
#   bash tools/torch_release_check.sh 2.15.0           # the private-name guards and the exactness tests (minutes)
#   bash tools/torch_release_check.sh 2.15.0 --whole   # the whole suite, as the README's test command runs it
# It installs torch==RELEASE, then OmniLearn with its test extras beside it, and stops if that install changed the
# torch (OmniLearn must never replace a supported torch). OMNILEARN_CHECK_VENV picks the venv (default
# /tmp/omnilearn-torch-RELEASE; an existing one is reused). Run from the repository's root.
set -euo pipefail
release=${1:?usage: bash tools/torch_release_check.sh TORCH_RELEASE [--whole]}
mode=${2:-}
venv=${OMNILEARN_CHECK_VENV:-/tmp/omnilearn-torch-$release}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$release"
"$venv/bin/pip" install -q -e ".[test]"
"$venv/bin/python" - "$release" <<'PY'
import sys
from importlib.metadata import version

import torch

kept = version("torch")
build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
gpu = "a GPU" if torch.cuda.is_available() else "no GPU: the CPU"
print(f"torch {kept} ({build}, running on {gpu})")
if kept.split("+")[0] != sys.argv[1]:
    sys.exit(f"torch_release_check: installing OmniLearn changed torch {sys.argv[1]} to {kept}")
PY
if [ "$mode" = --whole ]; then
    exec "$venv/bin/python" -m pytest -q -n 3 --dist loadfile
fi
exec "$venv/bin/python" -m pytest -q -n 3 --dist loadfile \
    tests/unit/test_torch_private_names.py tests/unit/test_torch_policy.py tests/unit/test_sharded_versions.py \
    tests/unit/test_launch_private_names.py tests/exactness tests/dist/test_bsp.py tests/dist/test_accumulation.py \
    tests/dist/test_hooks.py tests/dist/test_compile.py tests/dist/test_fsdp.py tests/dist/test_replicas.py \
    tests/faults/test_resume.py
