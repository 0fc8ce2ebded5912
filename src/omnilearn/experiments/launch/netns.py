"""A local run's TensorFlow processes kept apart: a network namespace where loopback is the only interface, and a
temporary directory of their own (:func:`private_tmp`).

Why. TensorFlow's gRPC server binds every interface (``0.0.0.0:PORT``, which Linux serves as ``[::]:PORT``)
whatever address the cluster spec gives: the address is hard-coded in TensorFlow's ``GrpcServer::Init`` and no
setting changes it. A TensorFlow server runs any graph a client sends it, so a local run (every task on
``localhost``) must not be reachable from the network. The launcher's TensorFlow fork server
(:mod:`omnilearn.experiments.launch.tfforks`) calls :func:`isolate` first thing, before it imports anything that
starts a thread: it moves into a new network namespace (and a new user namespace when it is not root, which is
what lets an ordinary user make one), brings its loopback up, and forks every worker, server and chief of the
run from there. They reach each other on ``localhost`` as before; nothing outside the namespace can reach them,
and they cannot reach the network either (a script that downloads data at run time, under ``omnilearn launch``,
needs ``--network host``).

Where the system refuses a namespace (a container without ``CAP_SYS_ADMIN``, unprivileged user namespaces turned
off), :func:`isolate` says why and the run goes on with the servers on every interface: the launcher says so in
one line (docs/security.md).

No torch, no TensorFlow. Run: ``python -m pytest -q tests/unit/test_netns.py tests/tf/test_tf_faults.py``
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import shutil
import socket
import struct
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP, IFF_RUNNING = 0x1, 0x40
TMP_PREFIX = "omnilearn-tf-"  # private_tmp's directories: omnilearn-tf-<launcher pid>-...


_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded here: isolate() may run between a fork and an exec


def _unshare(flags: int) -> int:
    """``unshare(2)``: 0, else the errno."""
    return 0 if _LIBC.unshare(flags) == 0 else ctypes.get_errno()


def _map_ids(uid: int, gid: int) -> None:
    """In a new user namespace: this process keeps its own uid and gid (files it writes are the user's)."""
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def loopback_up() -> None:
    """Bring this namespace's ``lo`` up (a new namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        got = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack("16sH14x", got)[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP | IFF_RUNNING))


def isolate() -> str | None:
    """Move this (single-threaded) process into a new network namespace with loopback up; ``None`` when done, else
    why not (one phrase). Children forked afterwards share the namespace."""
    if not Path("/proc/self/ns/net").exists():
        return "this system has no network namespaces (Linux only)"
    uid, gid = os.geteuid(), os.getegid()
    if uid != 0 or _unshare(CLONE_NEWNET) != 0:  # root lacking CAP_SYS_ADMIN (a container) may still make both
        errno = _unshare(CLONE_NEWUSER | CLONE_NEWNET)
        if errno:
            return f"unshare(CLONE_NEWUSER | CLONE_NEWNET) was refused ({os.strerror(errno)})"
        try:
            _map_ids(uid, gid)
        except OSError as e:
            return f"a user namespace was made but its ids could not be mapped ({e.strerror or e})"
    try:
        loopback_up()
    except OSError as e:
        return f"the private namespace's loopback would not come up ({e.strerror or e})"
    return None


def interfaces(pid: int | str = "self") -> list[str]:
    """The network interfaces a process sees (``/proc/PID/net/dev``)."""
    lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return [line.split(":", 1)[0].strip() for line in lines if ":" in line]


@contextlib.contextmanager
def private_tmp() -> Iterator[Path]:
    """``TMPDIR`` of a run's TensorFlow processes while the block runs (they inherit it from the launcher's
    environment): a directory of their own, removed at the end. TensorFlow's autograph writes a module per traced
    function into the temporary directory and a worker that ends with ``os._exit`` never removes them (thousands
    piled up in ``/tmp``). A launcher SIGKILLed cannot remove it: the next run sweeps the directories of
    launchers that are gone (the name holds the launcher's pid)."""
    sweep_gone(Path(tempfile.gettempdir()), TMP_PREFIX)
    path = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{os.getpid()}-"))
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(path)
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        shutil.rmtree(path, ignore_errors=True)


def sweep_gone(parent: Path, prefix: str) -> None:
    """Remove the directories ``<prefix><pid>-*`` in ``parent`` whose launcher (``pid``) no longer runs: a
    SIGKILLed launcher cannot clean up (its workers die with it, its directory stays)."""
    from omnilearn.commit import start_time

    for p in parent.glob(f"{prefix}*-*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and start_time(int(pid)) is None and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def say_exposed(why: str) -> None:
    """The one line of a local run whose TensorFlow servers are not in a private namespace (``why``: the reason)."""
    print(f"omnilearn: this run's TensorFlow servers listen on every interface ({why}): whoever reaches this "
          "machine can send them work; run it on a trusted network (docs/security.md)", file=sys.stderr, flush=True)
