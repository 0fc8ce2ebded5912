"""Run an example as ``__main__`` with float64 as torch's default dtype (exactness tests).

    python tests/examples/float64_run.py hf_transformers.py --epochs 1 --out DIR
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    example = Path(__file__).resolve().parents[2] / "examples" / sys.argv[1]
    sys.argv = [str(example), *sys.argv[2:]]
    sys.path.insert(0, str(example.parent))
    runpy.run_path(str(example), run_name="__main__")
