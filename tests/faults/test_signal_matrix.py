"""A stop signal to ``omnilearn train --mode asp`` and ``omnilearn bench`` (PyTorch) leaves nothing behind: no
process, no listening socket, no temporary file. One test per command and signal (tests/signalcase.py says what
each checks). The rest of the signal matrix: ``omnilearn train`` on PyTorch BSP is tests/faults/test_stops.py,
PyTorch's ``bench --mode asp`` tests/faults/test_bench_signal_matrix.py, TensorFlow
tests/tf/test_tf_signal_matrix.py, ``omnilearn launch`` tests/tf/test_launch_signal_matrix.py (several files: the
suite's budget of time per file).

Run: ``python -m pytest -q tests/faults/test_signal_matrix.py``
"""

from __future__ import annotations

import signal

import pytest
import signalcase

pytestmark = pytest.mark.dist
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
CASES = [(command, signum) for command in ("train-pytorch-asp", "bench-pytorch") for signum in SIGNALS]


@pytest.mark.parametrize("command, signum", signalcase.params(CASES))
def test_a_signal_to_the_command_leaves_no_process_socket_or_temporary_file(tmp_path, command, signum):
    signalcase.check(tmp_path, command, signum)
