"""The private and undocumented names of multiprocessing and torch the launchers lean on are still there, as used.

A Python or PyTorch upgrade that renames one would otherwise break the launchers quietly: a fork server's client pipe
left open (ranks outliving a SIGKILLed launcher), a ``TMPDIR`` check measuring the wrong socket path, a preload
skipped (multiprocessing ignores a preload that fails to import: every rank pays the import). Each test names what
uses it; fix the user when one fails.

- ``multiprocessing.forkserver._forkserver._forkserver_alive_fd`` (``supervise._leave_the_fork_servers_clients``),
  set in each fork-server child by ``_serve_one``;
- ``multiprocessing.util.get_temp_dir()`` and the ``listener-XXXXXXXX`` socket name of
  ``multiprocessing.connection.arbitrary_address`` (``supervise._fork_server_address_fits``);
- ``util.get_temp_dir()`` making ``pymp-*`` in the temp dir, removed at a normal exit only (``mptemp``: the
  launcher marks it as its own, a later run sweeps it after a SIGKILL);
- ``multiprocessing.reduction.DupFd(fd)`` and its ``detach()`` (``supervise._Fd``);
- ``torch._dynamo`` and the rest of ``supervise.PRELOAD``, and ``set_forkserver_preload(module_names)``
  (``supervise.start_context``).

Run: ``python -m pytest -q tests/unit/test_launch_private_names.py``
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import tempfile
from multiprocessing import connection, forkserver, reduction, util

import torch.multiprocessing as mp

from omnilearn.experiments.launch import supervise


def _parameters(f) -> list[str]:
    return list(inspect.signature(f).parameters)


def test_the_fork_servers_alive_fd_is_where_the_rank_closes_it():
    assert isinstance(forkserver._forkserver, forkserver.ForkServer)
    assert hasattr(forkserver.ForkServer(), "_forkserver_alive_fd")
    assert "_forkserver._forkserver_alive_fd" in inspect.getsource(forkserver._serve_one), \
        "fork-server children no longer get the alive fd there: review supervise._leave_the_fork_servers_clients"


def test_the_fork_servers_socket_path_is_measured_as_it_is_made():
    assert _parameters(util.get_temp_dir) == []
    assert _parameters(connection.arbitrary_address) == ["family"]
    address = connection.arbitrary_address("AF_UNIX")
    assert os.path.dirname(address) == util.get_temp_dir()
    assert re.fullmatch(r"listener-\w{8}", os.path.basename(address)), address
    assert len(os.fsencode(address)) == len(os.fsencode(util.get_temp_dir())) + len("/listener-XXXXXXXX")


def test_multiprocessings_temp_dir_is_named_as_the_sweep_finds_it():
    from omnilearn.experiments.launch import mptemp

    folder = util.get_temp_dir()
    assert os.path.dirname(folder) == tempfile.gettempdir(), folder
    assert os.path.basename(folder).startswith(mptemp.PREFIX), \
        "multiprocessing renamed its temp dir: review omnilearn.experiments.launch.mptemp.PREFIX"


def test_dupfd_passes_a_descriptor_as_supervise_uses_it():
    assert _parameters(reduction.DupFd) == ["fd"]
    read, write = os.pipe()
    try:
        dup = reduction.DupFd(write)
        assert _parameters(dup.detach) == []
        received = dup.detach()
        assert isinstance(received, int) and received not in (read, write)
        os.close(received)
    finally:
        os.close(read)
        os.close(write)


def test_the_preloaded_modules_import_and_the_preload_is_set_as_called():
    for name in supervise.PRELOAD:
        importlib.import_module(name)  # torch._dynamo among them: a private module
    context = mp.get_context("forkserver")
    assert _parameters(context.set_forkserver_preload) == ["module_names"]
