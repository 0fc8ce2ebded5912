"""TensorFlow workers forked from one process that imported TensorFlow once (the local launcher's default on Linux).

A TensorFlow worker spends about 3.5 s of CPU importing TensorFlow and Keras before it runs a line of its own; three
workers on a 2-core machine took about 6 s to start, and every restart paid it again. The launcher of ``omnilearn
train --framework tensorflow`` and ``omnilearn launch`` (:mod:`omnilearn.experiments.launch.tfworkers`) instead starts
this module once per run (:class:`ForkServer`), with the workers' common environment: it imports TensorFlow, Keras
and OmniLearn's TensorFlow runtime, then forks one child per worker when asked. The child becomes what ``python -m
MODULE ARGS`` or ``python SCRIPT ARGS`` would be: its own session, its own environment (``TF_CONFIG``), its working
directory, standard error into its log, standard output the console (worker 0), ``/dev/null`` or a file,
``sys.argv`` and ``sys.path[0]`` as the interpreter sets them, the script run as ``__main__``, and an ordinary
interpreter exit (``atexit``, threads joined; a traceback and exit 1 for an uncaught exception). A restart of the
run forks again: no import.

Who sends what. The launcher writes one JSON line per worker to the server's standard input (``rank``, ``argv``
without the interpreter, ``env``, ``cwd``, ``log``, ``console``); the server answers on a pipe (its descriptor is
its first argument): ``started RANK PID`` once forked, ``exited PID CODE`` once it has reaped a child (``CODE`` as
``subprocess.Popen.returncode``: ``-N`` killed by signal N). The launcher signals the workers by pid (:class:`Forked`
looks like a ``Popen``). Closing the standard input ends the server. Each child dies with the server and the server
with the launcher (parent-death signals), so a SIGKILLed launcher leaves no worker; a server that ends before it has
reported a child's exit reports it killed by SIGKILL (it was, by that signal). The server's own standard error (what
an import that fails says) goes to worker 0's log, so the run names worker 0 with that line.

Why forking is safe here: importing TensorFlow and Keras starts no thread (numpy's OpenBLAS thread aside, which
handles fork) and no runtime. The eager context, gRPC, the strategy and CUDA start at the first op, in the child.
What they read at import (``TF_CPP_MIN_LOG_LEVEL``, ``KERAS_HOME``'s ``keras.json``, ``KERAS_BACKEND``) is the
server's environment, which is the launch's. ``OMNILEARN_START_METHOD=spawn`` starts each worker as a fresh
interpreter instead (a script that changes Keras' settings before it imports Keras needs that).
A forked child gets a fresh interpreter's signal handling (SIGPIPE ignored, SIGINT KeyboardInterrupt, ...) and its
own random state (numpy's global ``RandomState``, ``random``), not the server's copy
(:mod:`omnilearn.experiments.launch.freshchild`).

Every worker's command line (``ps``, ``pgrep -f``) is the server's, which ends with the worker's command.

Run: ``python -m pytest -q tests/unit/test_tfforks.py tests/tf``
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from omnilearn.experiments.launch import freshchild  # first: its snapshot is the server's signals at start
from omnilearn.experiments.launch import netns

POLL_S = 0.02
PRELOAD = ("tensorflow", "keras", "omnilearn.tf.api", "omnilearn.tf.session", "omnilearn.tf.fit")


def die_with_parent() -> None:
    """SIGKILL this process when its parent goes (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _in_the_child(why: int | None) -> None:
    """Between the fork and the exec of the server: die with the launcher; with ``why`` (a pipe), move into a
    network namespace of loopback only and write there why not, if not."""
    die_with_parent()
    if why is not None:
        os.write(why, (netns.isolate() or "").encode())


# ------------------------------------------------------------------ the launcher's side
class ForkServer:
    """The fork server of one run: started with ``env`` (the workers' common environment), its standard error into
    ``log``, preloading ``preload``; ``command`` (the workers' command) only names it in ``ps``. ``isolate``: the
    server, and every process it forks, in a network namespace of its own with loopback only
    (:func:`omnilearn.experiments.launch.netns.isolate`, made in the forked child before it runs Python's
    startup, while it has one thread); :attr:`exposed` says why not, where it could not be made."""

    def __init__(self, env: dict[str, str], log: Path, command: list[str], preload: tuple[str, ...] = PRELOAD,
                 isolate: bool = False) -> None:
        read, write = os.pipe()
        said, why = os.pipe()
        try:
            with open(log, "ab") as err:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(write), ",".join(preload), *command[1:]], env=env,
                    stdin=subprocess.PIPE, stdout=None, stderr=err, pass_fds=(write,), start_new_session=True,
                    preexec_fn=functools.partial(_in_the_child, why if isolate else None))
        finally:
            os.close(write)
            os.close(why)
        with os.fdopen(said, "rb") as answer:  # written before the exec, so complete once Popen returned
            text = answer.read().decode(errors="replace")
        self.exposed: str | None = None if isolate and not text else (text or "not asked for")
        os.set_blocking(read, False)
        self._reports, self._partial = read, b""
        self.pids: dict[int, int] = {}  # rank -> pid
        self.codes: dict[int, int] = {}  # pid -> exit code, once reaped
        self.ended = False

    def start(self, rank: int, argv: list[str], env: dict[str, str], log: Path, console: bool | Path,
              give_up: Callable[[], bool] = lambda: False) -> Forked:
        """Fork worker ``rank`` running ``argv`` (``["-m", module, ...]`` or ``[script, ...]``); wait for its pid (the
        first waits for the server's imports). Its standard output: the server's (``console`` True), ``/dev/null``
        (False) or appended to the file ``console``. Once ``give_up()`` says so (the launcher was told to stop) the
        server is killed instead, and the worker reads as killed."""
        task = {"rank": rank, "argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log),
                "console": console if isinstance(console, bool) else str(console)}
        self.pids.pop(rank, None)  # a restart's worker: a new pid
        try:
            self.proc.stdin.write(json.dumps(task).encode() + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._end()
        while rank not in self.pids and not self.ended:
            if give_up():
                self.proc.kill()
            self.pump(wait_s=POLL_S)
        return Forked(self, rank)

    def pump(self, wait_s: float = 0.0) -> None:
        """Read what the server has reported (waiting up to ``wait_s`` for something)."""
        if self.ended:
            return
        if wait_s:
            select.select([self._reports], [], [], wait_s)
        while True:
            try:
                chunk = os.read(self._reports, 65536)
            except BlockingIOError:
                return
            if not chunk:  # the server ended: its children died with it
                self._end()
                return
            *lines, self._partial = (self._partial + chunk).split(b"\n")
            for line in lines:
                word, a, b = line.decode().split()
                if word == "started":
                    self.pids[int(a)] = int(b)
                    self.codes.pop(int(b), None)  # a pid of an earlier run's reaped worker, used again
                else:
                    self.codes[int(a)] = int(b)

    def _end(self) -> None:
        self.ended = True
        self.proc.wait()
        for pid in self.pids.values():
            self.codes.setdefault(pid, -signal.SIGKILL)  # died with the server

    def close(self) -> None:
        """End the server (its children, if any are left, die with it)."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._reports)

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Forked:
    """One forked worker, with the part of ``subprocess.Popen`` the supervisor uses."""

    def __init__(self, server: ForkServer, rank: int) -> None:
        self.server, self.rank = server, rank
        self.pid = server.pids.get(rank, 0)  # 0: the server ended before it forked this one
        self._unstarted = None if self.pid else (server.proc.returncode or 1)

    @property
    def returncode(self) -> int | None:
        return self._unstarted if not self.pid else self.server.codes.get(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.pump()
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None and self.pid > 0:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        while self.poll() is None:
            self.server.pump(wait_s=POLL_S)
        return self.returncode


# ------------------------------------------------------------------ the server (python -m this module)
def serve(reports: int) -> dict | None:
    """Fork a child per task read from standard input, report it and reap it; return a task in the child, ``None``
    in the server once standard input closes (and its children have been reaped or left to die with it)."""
    commands, pending, children = sys.stdin.fileno(), b"", set()
    while True:
        ready, _, _ = select.select([commands], [], [], POLL_S)
        _reap(reports, children)
        if not ready:
            continue
        chunk = os.read(commands, 65536)
        if not chunk:
            return None
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            task = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                os.close(reports)  # standard input: /dev/null, in become()
                return task
            children.add(pid)
            os.write(reports, f"started {task['rank']} {pid}\n".encode())


def _reap(reports: int, children: set[int]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            children.discard(pid)
            os.write(reports, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def become(task: dict, server: int) -> None:
    """In the child of ``server``: the worker's session, descriptors, environment, directory, signal handlers and
    random state (:mod:`omnilearn.experiments.launch.freshchild`)."""
    os.setsid()
    die_with_parent()
    if os.getppid() != server:  # the server ended before the parent-death signal was set
        os._exit(128 + signal.SIGKILL)
    console, append = task["console"], os.O_WRONLY | os.O_APPEND | os.O_CREAT
    for path, fd, flags in ((os.devnull, 0, os.O_RDONLY), (task["log"], 2, append),
                            *([] if console is True else [(os.devnull, 1, os.O_WRONLY) if console is False
                                                          else (console, 1, append)])):
        opened = os.open(path, flags, 0o644)
        if opened != fd:
            os.dup2(opened, fd)
            os.close(opened)
    os.environ.clear()
    os.environ.update(task["env"])
    os.chdir(task["cwd"])
    freshchild.become_fresh()  # a spawned interpreter's signal handling (SIGPIPE ignored...) and random state


def run(argv: list[str]) -> None:
    """Run ``argv`` as the interpreter would run ``python ARGV``: ``-m MODULE ARGS`` or ``SCRIPT ARGS``."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    reports, preload = int(sys.argv[1]), [name for name in sys.argv[2].split(",") if name]
    sys.argv = sys.argv[:1]
    for name in preload:
        importlib.import_module(name)
    server = os.getpid()
    task = serve(reports)
    if task is None:  # the launcher closed our input: done (TensorFlow's interpreter teardown would take a second)
        sys.stderr.flush()
        os._exit(0)
    become(task, server)
    run(task["argv"])


if __name__ == "__main__":
    main()
