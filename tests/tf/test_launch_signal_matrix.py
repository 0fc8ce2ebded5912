"""A stop signal to ``omnilearn launch`` (a script's workers, TensorFlow's cluster set up) leaves nothing behind: no
process, no listening socket, no temporary file. One test per signal (tests/signalcase.py says what each checks;
the script's workers only sleep, so the case costs the launcher, not TensorFlow's training).

Run: ``python -m pytest -q tests/tf/test_launch_signal_matrix.py``
"""

from __future__ import annotations

import signal

import pytest
import signalcase
from needs import needs

pytestmark = [pytest.mark.dist, needs("tensorflow", "tensorflow")]
CASES = [("launch", signal.SIGTERM), ("launch", signal.SIGINT), ("launch", signal.SIGKILL)]


@pytest.mark.parametrize("command, signum", signalcase.params(CASES))
def test_a_signal_to_launch_leaves_no_process_socket_or_temporary_file(tmp_path, command, signum):
    signalcase.check(tmp_path, command, signum)
