"""A stop signal to a TensorFlow command that starts processes leaves nothing behind: no process, no listening
socket, no temporary file. One test per command and signal (tests/signalcase.py says what
each checks); the cases other files do not run already: TensorFlow BSP and ASP with SIGTERM is
tests/tf/test_tf_faults.py; ``omnilearn launch`` is tests/tf/test_launch_signal_matrix.py; PyTorch is
tests/faults/test_signal_matrix.py and tests/faults/test_stops.py.

Run: ``python -m pytest -q tests/tf/test_tf_signal_matrix.py``
"""

from __future__ import annotations

import signal

import pytest
import signalcase
from needs import needs

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]
CASES = [("train-tensorflow", signal.SIGINT), ("train-tensorflow", signal.SIGKILL),
         ("train-tensorflow-asp", signal.SIGINT), ("train-tensorflow-asp", signal.SIGKILL),
         ("bench-tensorflow-asp", signal.SIGTERM), ("bench-tensorflow-asp", signal.SIGINT),
         ("bench-tensorflow-asp", signal.SIGKILL)]


@pytest.mark.parametrize("command, signum", signalcase.params(CASES))
def test_a_signal_to_the_command_leaves_no_process_socket_or_temporary_file(tmp_path, command, signum):
    signalcase.check(tmp_path, command, signum)
