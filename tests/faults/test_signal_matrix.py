"""A stop signal to a PyTorch command that starts processes leaves nothing behind: no process, no listening socket,
no temporary file. One test per command and signal (tests/signalcase.py says what each checks); the cases other
files do not run already: ``omnilearn train`` on PyTorch BSP with SIGINT, SIGTERM and SIGKILL is
tests/faults/test_stops.py; TensorFlow and ``omnilearn launch`` are tests/tf/test_tf_signal_matrix.py.

Run: ``python -m pytest -q tests/faults/test_signal_matrix.py``
"""

from __future__ import annotations

import signal

import pytest
import signalcase

pytestmark = pytest.mark.dist
CASES = [("train-pytorch-asp", signal.SIGTERM), ("train-pytorch-asp", signal.SIGKILL),
         ("bench-pytorch", signal.SIGTERM), ("bench-pytorch", signal.SIGKILL)]


@pytest.mark.parametrize("command, signum", signalcase.params(CASES))
def test_a_signal_to_the_command_leaves_no_process_socket_or_temporary_file(tmp_path, command, signum):
    signalcase.check(tmp_path, command, signum)
