"""A stop signal to a PyTorch command that starts processes leaves nothing behind: no process, no listening socket,
no temporary file. One test per command and signal (tests/signalcase.py says what each checks); the cases other
files do not run already: ``omnilearn train`` on PyTorch BSP with SIGINT, SIGTERM and SIGKILL is
tests/faults/test_stops.py; TensorFlow is tests/tf/test_tf_signal_matrix.py, ``omnilearn launch``
tests/tf/test_launch_signal_matrix.py.

Run: ``python -m pytest -q tests/faults/test_signal_matrix.py``
"""

from __future__ import annotations

import signal

import pytest
import signalcase

pytestmark = pytest.mark.dist
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
CASES = [(command, signum) for command in ("train-pytorch-asp", "bench-pytorch", "bench-pytorch-asp")
         for signum in SIGNALS]


@pytest.mark.parametrize("command, signum", signalcase.params(CASES))
def test_a_signal_to_the_command_leaves_no_process_socket_or_temporary_file(tmp_path, command, signum):
    signalcase.check(tmp_path, command, signum)
