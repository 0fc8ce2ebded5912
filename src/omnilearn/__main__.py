"""``python -m omnilearn ...``: the experiment CLI, e.g. under ``torchrun -m omnilearn train``.

An entry point, not part of the library: it needs the ``[experiments]`` extra.
"""

import sys

from omnilearn.experiments.cli import entry

sys.exit(entry())
