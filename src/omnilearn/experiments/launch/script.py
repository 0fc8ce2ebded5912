"""``omnilearn launch``: start your own TensorFlow script as local workers, watched like ``omnilearn train``.

    omnilearn launch --framework tensorflow --workers 2 --speeds 3,1 --out runs/keras train.py --epochs 3

Each worker is ``python script.py [args]`` with its own ``TF_CONFIG`` (the
localhost cluster's addresses and its index), as a TensorFlow user would
start one per machine. ``--speeds`` and ``--out`` reach the script's
``omnilearn.tf.setup()`` through :data:`~omnilearn.keywords.LAUNCH_ENV` (a
script that gives them itself must agree). Worker 0's output is the
console; every worker's standard error goes to ``OUT/tf-worker<R>.log``.
The supervision is ``omnilearn train --framework tensorflow``'s
(:func:`omnilearn.experiments.launch.tfworkers.supervise`): a worker that exits
badly stops the others and is named in one line with the last line of its
log (exit 1); SIGINT/SIGTERM stop every worker (exit 128 + the signal). A
worker silent for ``--heartbeat-s`` is named as hung and every worker
stopped; one that has not joined the cluster after ``--timeout-s`` is named
by its peers (:mod:`omnilearn.tf.liveness`). ``--checkpoint-every``,
``--keep-checkpoints`` and ``--resume`` reach the script's ``setup()``
(:mod:`omnilearn.tf.checkpointing`); ``--max-restarts K`` starts every
worker again after a failure, resuming (:func:`omnilearn.experiments.train.restarts.with_restarts`).

Multi-node: start ``python script.py`` on each machine with its own
``TF_CONFIG`` (docs/tensorflow.md). A PyTorch script is started by
``torchrun`` (OmniLearn joins its group): ``--framework pytorch`` says so.

Run its tests: ``python -m pytest -q tests/tf/test_tf_launch.py``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from omnilearn.config import MAX_TIMEOUT_S, BalanceConfig
from omnilearn.emulation.speeds import BSP_LEVELS, SpeedError, parse_speeds, speed_count
from omnilearn.experiments.config import ConfigError
from omnilearn.keywords import LAUNCH_ENV
from omnilearn.experiments.train.newrun import check_new_out
from omnilearn.observe.rundir import clear_run


def add_parser(sub) -> None:
    p = sub.add_parser("launch", help="start your own TensorFlow script as local workers (TF_CONFIG each)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("tensorflow", "pytorch"), default="tensorflow",
                   help="tensorflow (default); pytorch scripts are started by torchrun")
    p.add_argument("--workers", type=int, help="local worker processes (default: one per --speeds entry, else 2)")
    p.add_argument("--speeds", help="emulated relative speeds, e.g. 3,1, or a level HL1..HL8 (default: all equal)")
    p.add_argument("--out", help="the run directory (default runs/<time>): the script's records and worker logs")
    p.add_argument("--overwrite", action="store_true", help="reuse an --out that already holds a run")
    p.add_argument("--device", choices=("cpu", "auto"), default="cpu", help="cpu (default) hides GPUs from workers")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="checkpoint every N steps into OUT/checkpoints (default 0: only at a stop asked for)")
    p.add_argument("--keep-checkpoints", type=int, default=3, metavar="K", help="checkpoints kept (default 3)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint "
                   "(another --workers too)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="after a worker fails or hangs, start every worker again from the newest checkpoint, up to "
                   "K times (default 0)")
    p.add_argument("--heartbeat-s", type=float, default=BalanceConfig.heartbeat_s, metavar="S",
                   help=f"a worker silent this long is hung: named, every worker stopped (default "
                   f"{BalanceConfig.heartbeat_s:g})")
    p.add_argument("--timeout-s", type=float, metavar="S",
                   help=f"a worker that has not joined the cluster by then is named, and a collective waits this "
                   f"long (default {BalanceConfig.timeout_s:g})")
    p.add_argument("--network", choices=("private", "host"), default="private",
                   help="private (default): TensorFlow workers see loopback only, so their servers, which bind "
                   "every interface, are not reachable from the network; host: the machine's network (a script "
                   "that downloads while it runs), said in one line")
    p.add_argument("script", help="your training script (it calls omnilearn.tf.setup())")
    p.add_argument("args", nargs=argparse.REMAINDER, default=[], help="the script's own arguments")


def run(args: argparse.Namespace) -> int:
    from omnilearn.experiments.launch import tfworkers as tflaunch
    from omnilearn.experiments.train import restarts

    script = Path(args.script)
    if args.framework == "pytorch":
        raise ConfigError(f"a PyTorch script is started by torchrun: torchrun --standalone --nproc-per-node N "
                          f"{script} (omnilearn.setup() joins its group; speeds=... in setup())")
    if not script.is_file():
        raise ConfigError(f"script {str(script)!r} is not a file; give the path of your training script")
    if importlib.util.find_spec("tensorflow") is None:
        raise ConfigError("omnilearn launch --framework tensorflow needs TensorFlow: pip install "
                          "'omnilearn-hetero[tensorflow]'")
    workers = _workers(args.workers, args.speeds)
    _check_numbers(args)
    tflaunch.start_method()  # a bad OMNILEARN_START_METHOD is refused before the run directory is made
    if args.resume:
        if args.out is None:
            raise ConfigError("--resume needs --out: the run directory to continue")
        out = Path(args.out)
        if not (out / "config.toml").is_file():
            raise ConfigError(f"--resume: --out {args.out!r} holds no run (no config.toml); give the run's directory, "
                              "or start a new run without --resume")
    else:
        out = check_new_out(args.out, args.overwrite)
        out.mkdir(parents=True, exist_ok=True)
        if args.overwrite:  # the script's setup() then finds no run here
            clear_run(out)
    given = {"out": str(out), **({"timeout_s": args.timeout_s} if args.timeout_s else {}),
             **({"speeds": args.speeds} if args.speeds else {}),
             **({"checkpoint_every": args.checkpoint_every, "keep_checkpoints": args.keep_checkpoints}
                if args.checkpoint_every else {})}
    print(f"omnilearn: {workers} TensorFlow workers of {script}{' ' + ' '.join(args.args) if args.args else ''}; "
          f"run directory {out}", flush=True)

    command = [sys.executable, str(script), *args.args]

    def where() -> str:  # the launcher's own checkpoints, else whatever the script keeps (BackupAndRestore)
        return tflaunch.tf_checkpoint(out) if args.checkpoint_every else "the script's own checkpoints, if any"

    with tflaunch.fork_server(workers, args.device, out, command, args.network) as server:
        def attempt(resume: bool) -> None:
            resume = resume and (out / "config.toml").is_file()  # a failure before worker 0's setup(): start afresh
            tflaunch.supervise(workers, args.device, out, command, {LAUNCH_ENV: json.dumps({**given, "resume": resume})},
                               heartbeat_s=args.heartbeat_s, server=server)

        restarts.with_restarts(attempt, out, args.max_restarts, args.resume, "tf-worker*.log", where)
    return 0


def _check_numbers(args: argparse.Namespace) -> None:
    for flag, value, low in (("--checkpoint-every", args.checkpoint_every, 0), ("--keep-checkpoints",
                             args.keep_checkpoints, 1), ("--max-restarts", args.max_restarts, 0)):
        if value < low:
            raise ConfigError(f"{flag} {value}: give at least {low}")
    for flag, value in (("--heartbeat-s", args.heartbeat_s), ("--timeout-s", args.timeout_s)):
        if value is not None and not 0 < value <= MAX_TIMEOUT_S:
            raise ConfigError(f"{flag} {value:g}: give seconds in (0, {MAX_TIMEOUT_S:g}]")


def _workers(workers: int | None, speeds: str | None) -> int:
    count = speed_count(speeds) if speeds else None
    if speeds and speeds.strip().upper() in BSP_LEVELS:  # a level names its worker count too
        count = len(BSP_LEVELS[speeds.strip().upper()])
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers {workers}: give at least 1")
    if workers is not None and count is not None and count != workers:
        raise ConfigError(f"--speeds {speeds} has {count} entries for --workers {workers}: give one per worker")
    workers = workers or count or 2
    if speeds:  # checked here, before any worker starts (the script's setup() would only say so after)
        try:
            parse_speeds(speeds, workers, workers_said=f"--workers is {workers}")
        except SpeedError as e:
            raise ConfigError(f"--speeds {speeds}: {e}") from None
    return workers
