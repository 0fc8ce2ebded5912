"""A stop signal to PyTorch's ``omnilearn bench --mode asp`` leaves nothing behind: no process, no listening socket,
no temporary file. One test per signal (tests/signalcase.py says what each checks;
the rest of the signal matrix: tests/faults/test_signal_matrix.py).

Run: ``python -m pytest -q tests/faults/test_bench_signal_matrix.py``
"""

from __future__ import annotations

import signal

import pytest
import signalcase

pytestmark = pytest.mark.dist
CASES = [("bench-pytorch-asp", signum) for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)]


@pytest.mark.parametrize("command, signum", signalcase.params(CASES))
def test_a_signal_to_bench_leaves_no_process_socket_or_temporary_file(tmp_path, command, signum):
    signalcase.check(tmp_path, command, signum)
