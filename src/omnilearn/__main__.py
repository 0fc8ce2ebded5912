"""``python -m omnilearn ...``: the same CLI, e.g. under ``torchrun -m omnilearn train``."""

import sys

from omnilearn.cli import main

sys.exit(main())
