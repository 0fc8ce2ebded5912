"""``torchrun`` for the fault tests, without an interpreter start per rank: the agent forks its workers.

:func:`torchrun` takes torchrun's command line (``--standalone --nproc-per-node 3 --max-restarts 1 SCRIPT
ARGS``), adds torchrun's own ``--run-path --start-method fork`` (the script run by ``runpy`` in a worker forked
from the agent), parses it with torchrun's parser and ``config_from_args``, and runs torchrun's agent
(``elastic_launch``: the ``LocalElasticAgent`` with its c10d rendezvous, monitor and restarts) in a process
forked from the tests' preloaded fork server (torch, OmniLearn, Lightning and transformers imported once per
xdist worker, tests/conftest.py). So each worker, and each restart's, starts as a fork of the agent with the
imports done, where plain torchrun starts ``python SCRIPT`` and imports everything again. A worker first gets
a fresh process's signal handling and random state (:mod:`omnilearn.experiments.launch.freshchild`). Real
processes, a real gloo group, a real SIGKILL and the agent's real restart; the script's imports cost nothing.

What stays with the real ``python -m torch.distributed.run``: the tests that signal the launcher or run one
agent per network namespace, and tests/dist/test_bsp.py's ``test_torchrun_joins_the_group_unchanged``.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

from omnilearn.experiments.launch import freshchild
from omnilearn.experiments.launch.supervise import _leave_the_fork_servers_clients, start_context


def _worker(script: str, *args: str) -> None:
    """One rank: torchrun's ``run_script_path`` (``--run-path``) after a fresh process's signals and random state,
    with the script's directory first on ``sys.path`` and an uncaught exception given to ``sys.excepthook``, as
    ``python SCRIPT`` has them (multiprocessing's worker would print it and exit without the hook)."""
    freshchild.become_fresh()
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:  # what ``python SCRIPT`` does with an uncaught exception (the survivors' save hooks it)
        sys.excepthook(*sys.exc_info())
        sys.exit(1)


def _agent(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """torchrun's ``run`` with the workers forked: exit 0 when every worker of the last attempt did, else 1."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args, run_script_path

    freshchild.become_fresh()
    _leave_the_fork_servers_clients()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for path, fd in ((stdout, 1), (stderr, 2)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    args = parse_args(["--run-path", "--start-method", "fork", *argv])
    assert args.standalone, "the forked agent runs --standalone jobs"
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", f"forked-{os.getpid()}"
    config, entrypoint, script_args = config_from_args(args)
    assert entrypoint is run_script_path and config.start_method == "fork", "torchrun's --run-path changed"
    try:
        elastic_launch(config=config, entrypoint=_worker)(*script_args)
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun(*argv: str, env: dict[str, str] | None = None, timeout: float = 300,
             cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run ARGV`` as above, in ``cwd`` (default: here); its exit code, stdout and
    stderr (text)."""
    with tempfile.TemporaryDirectory(prefix="agent-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        where = str(cwd or os.getcwd())
        agent = start_context().Process(target=_agent, args=(list(argv), dict(env or os.environ), where, str(out),
                                                             str(err)))
        agent.start()
        agent.join(timeout)
        if agent.is_alive():  # a hang guard, not a deadline
            agent.kill()
            agent.join()
        return subprocess.CompletedProcess(["torchrun", *argv], agent.exitcode, out.read_text(), err.read_text())
