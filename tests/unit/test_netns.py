"""A private network namespace of loopback only: what a local TensorFlow run's processes live in.

In a forked child, :func:`omnilearn.experiments.launch.netns.isolate` leaves one interface (``lo``, up): a
server bound to every interface is reached on ``localhost`` and the machine's network is unreachable. The fork
server started with ``isolate=True`` forks its children into such a namespace (made between its fork and its
exec), and says why not where it cannot be made (here: always made; a system that refuses namespaces is
simulated). Real processes, no TensorFlow (the fork server preloads nothing here).

Run: ``python -m pytest -q tests/unit/test_netns.py``
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

import listeners
import pytest

from omnilearn.experiments.launch import netns, tfforks

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")


def _in_a_child(body) -> dict:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            result = body()
        except BaseException as e:  # the test reads what went wrong
            result = {"error": repr(e)}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    return json.loads(text)


def test_isolate_leaves_loopback_only_and_a_server_on_every_interface_is_reached_on_localhost():
    host_ns = os.readlink("/proc/self/ns/net")

    def body() -> dict:
        why = netns.isolate()
        server = socket.socket(socket.AF_INET6)
        server.bind(("::", 0))  # every interface, as TensorFlow's gRPC server binds
        server.listen()
        reached = socket.create_connection(("localhost", server.getsockname()[1]), timeout=5).getpeername()[0]
        try:
            socket.create_connection(("192.0.2.1", 9), timeout=2)  # TEST-NET-1: any route out would try it
            outside = "reached"
        except OSError as e:
            outside = e.strerror or repr(e)
        return {"why": why, "ns": os.readlink("/proc/self/ns/net"), "interfaces": netns.interfaces(),
                "reached": reached, "outside": outside,
                "exposed": listeners.exposed([os.getpid()]), "heard": listeners.listening([os.getpid()])}

    got = _in_a_child(body)
    assert "error" not in got, got
    assert got["why"] is None and got["ns"] != host_ns and got["interfaces"] == ["lo"], got
    assert got["reached"] in ("127.0.0.1", "::1", "::ffff:127.0.0.1") and got["outside"] == "Network is unreachable"
    assert got["heard"] and got["heard"][0]["address"] == "::" and got["exposed"] == []  # bound to all, reached by none


def test_the_listener_check_sees_a_socket_on_every_interface_of_the_machine():
    before = {s["port"] for s in listeners.exposed([os.getpid()])}  # what this process's earlier tests opened
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen()
    try:
        port = server.getsockname()[1]
        seen = [s["port"] for s in listeners.exposed([os.getpid()]) if s["port"] not in before]
        assert seen == ([] if netns.interfaces() == ["lo"] else [port])  # a machine with a network: it is exposed
    finally:
        server.close()


def _wait_for(path, what: str) -> str:
    for _ in range(6000):  # a hang guard of minutes, polled: the child is forked at once
        if path.exists() and path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"no {what}")


def test_the_fork_server_forks_its_children_into_one_private_namespace(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import os, sys\nfrom omnilearn.experiments.launch import netns\n"
                      "open(sys.argv[1], 'w').write(os.readlink('/proc/self/ns/net') + ' ' + "
                      "','.join(netns.interfaces()))\n")
    env = {**os.environ}
    with tfforks.ForkServer(env, tmp_path / "server.log", [sys.executable], preload=(), isolate=True) as server:
        assert server.exposed is None, server.exposed
        for rank in (0, 1):
            server.start(rank, [str(script), str(tmp_path / f"ns{rank}")], env, tmp_path / f"w{rank}.log",
                         console=False).wait()
        seen = {_wait_for(tmp_path / f"ns{rank}", "namespace") for rank in (0, 1)}
    assert len(seen) == 1 and seen.pop().split()[1] == "lo"  # both children: one namespace, loopback only
    with tfforks.ForkServer(env, tmp_path / "plain.log", [sys.executable], preload=()) as plain:
        assert plain.exposed == "not asked for"


def test_a_system_that_refuses_namespaces_is_said_not_hidden(tmp_path, monkeypatch):
    """A container without ``CAP_SYS_ADMIN`` and with user namespaces off: ``unshare`` fails with EPERM."""
    monkeypatch.setattr(netns, "_unshare", lambda flags: 1)
    got = _in_a_child(lambda: {"why": netns.isolate(), "ns": os.readlink("/proc/self/ns/net")})
    assert got["why"] == "unshare(CLONE_NEWUSER | CLONE_NEWNET) was refused (Operation not permitted)"
    assert got["ns"] == os.readlink("/proc/self/ns/net")
    with tfforks.ForkServer({**os.environ}, tmp_path / "server.log", [sys.executable], preload=(),
                            isolate=True) as server:
        assert server.exposed == "unshare(CLONE_NEWUSER | CLONE_NEWNET) was refused (Operation not permitted)"


def test_a_sigkilled_launchers_temporary_directory_is_swept_by_the_next_run(tmp_path, monkeypatch):
    """A launcher SIGKILLed leaves its run's ``TMPDIR`` (nobody is left to remove it); the next local run removes
    those whose launcher is gone, and never a live one's."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid that no longer runs
    dead, live = tmp_path / f"{netns.TMP_PREFIX}{pid}-abc", tmp_path / f"{netns.TMP_PREFIX}{os.getpid()}-def"
    for d in (dead, live):
        (d / "sub").mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(netns.tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    with netns.private_tmp() as mine:
        assert mine.parent == tmp_path and not dead.exists() and live.exists()
    assert not mine.exists() and live.exists()


def test_a_sigkilled_launchers_fork_server_directory_is_swept_and_no_one_elses(tmp_path):
    """multiprocessing's ``pymp-*`` directory (the fork server's socket) of a SIGKILLed launcher stays; the next
    start of the fork server removes it when the owner file names a process gone, and never a live owner's or one
    without the file (another program's)."""
    from omnilearn.commit import writer_line
    from omnilearn.experiments.launch import mptemp

    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)  # a pid that no longer runs
    host = socket.gethostname()
    folders = {name: tmp_path / f"{mptemp.PREFIX}{name}" for name in ("dead", "live", "foreign")}
    for folder in folders.values():
        (folder / "listener-1").mkdir(parents=True)
    (folders["dead"] / mptemp.OWNER).write_text(f"{host} {pid} 1\n")
    (folders["live"] / mptemp.OWNER).write_text(writer_line())
    mptemp.sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pymp-foreign", "pymp-live"]
