"""``omnilearn`` command line: ``omnilearn train [flags]``.

Examples::

    omnilearn train                                   # 4 local workers at HL8 on MNIST-1D
    omnilearn train --workers 3 --speeds 4,2,1 --max-steps 120
    omnilearn train --controller uniform --speeds HL8 # the plain data-parallel baseline
    torchrun --standalone --nproc-per-node 2 -m omnilearn train --speeds 2,1

Settings come from defaults, then ``--config FILE.toml``, then flags. Bad input
ends with one ``omnilearn: error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from omnilearn import __version__
from omnilearn.config import DEVICES, EMULATORS, ConfigError, TrainConfig, build, dump_toml, load_toml
from omnilearn.controller import CONTROLLERS
from omnilearn.rundir import RunDirError, prepare

EXIT_USAGE, EXIT_FAILED = 2, 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train with heterogeneity-aware BSP", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS)
    d = TrainConfig.__dataclass_fields__
    add = p.add_argument
    add("--config", help="TOML file with settings (flags override it)")
    add("--workers", type=int, help=f"local worker processes (default {d['workers'].default}; under torchrun: WORLD_SIZE)")
    add("--model", help="cnn1d (default) or mlp")
    add("--dataset", help="mnist1d (default, generated locally) or synthetic")
    add("--global-batch", type=int, help=f"samples per step over all workers (default {d['global_batch'].default})")
    add("--epochs", type=int, help=f"passes over the training set (default {d['epochs'].default})")
    add("--max-steps", type=int, help="stop after this many steps (default: all epochs)")
    add("--lr", type=float, help=f"SGD learning rate, cosine-decayed (default {d['lr'].default})")
    add("--momentum", type=float, help=f"SGD momentum (default {d['momentum'].default})")
    add("--seed", type=int, help="seed for model init and data order (default 0)")
    add("--speeds", help="relative worker speeds, e.g. 4,2,1, or a level HL1/HL2/HL4/HL8 (default HL8 for 4 workers)")
    add("--speed-schedule", help="'paper' (HL1>2>4>8>8>4>2>1) or a TOML file of [[change]] at_step/at_epoch + speeds")
    add("--emulator", choices=EMULATORS, help="how slower workers are emulated: delay (default) or none")
    add("--controller", choices=CONTROLLERS, help="omnilearn (default, dynamic), static or uniform")
    add("--deadband", type=float, help="skip changes smaller than this fraction (default 0.05)")
    add("--min-batch", type=int, help=f"smallest per-worker batch (default {d['min_batch'].default})")
    add("--max-batch", type=int, help="largest per-worker batch (default: the global batch)")
    add("--control-interval", type=int, help=f"steps between controller decisions (default {d['control_interval'].default})")
    add("--out", help="run directory (default runs/<timestamp>)")
    add("--overwrite", action="store_true", help="replace a previous run in --out")
    add("--device", choices=DEVICES, help="auto (default: CUDA if present), cpu or cuda")
    add("--loader-workers", type=int, help="DataLoader worker processes per worker (default 0)")
    add("--timeout-s", type=float, help="seconds before a collective waiting on a dead peer fails (default 300)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omnilearn", description="Heterogeneity-aware data-parallel training on PyTorch.")
    p.add_argument("--version", action="version", version=f"omnilearn {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    return p


def _config(args: argparse.Namespace) -> TrainConfig:
    values = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    file_values = load_toml(args.config) if getattr(args, "config", None) else {}
    merged = {**file_values, **values}
    if merged.get("speeds") is not None and merged.get("speed_schedule") is not None:
        raise ConfigError("--speeds and --speed-schedule both given; the schedule sets the speeds, drop --speeds")
    schedule = merged.get("speed_schedule")
    if isinstance(schedule, str) and schedule != "paper":
        values["speed_schedule"] = os.path.abspath(schedule)  # config.toml repeats the run from anywhere
    from omnilearn.dist.group import launched_by_torchrun, torchrun_world_size

    if launched_by_torchrun():
        world = torchrun_world_size()
        given = values.get("workers", file_values.get("workers"))
        if given is not None and given != world:
            raise ConfigError(f"--workers {given} does not match torchrun's WORLD_SIZE {world}; drop --workers")
        values["workers"] = world
    return build(file_values, values)


def train(args: argparse.Namespace) -> int:
    from omnilearn import data, launch
    from omnilearn.dist.group import device_problem, launched_by_torchrun
    from omnilearn.runplan import resolve

    cfg = _config(args)
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers))
    problem = device_problem(cfg.device, local_workers)
    if problem:
        raise ConfigError(problem)
    resolve(cfg, len(data.load(cfg.dataset).train))  # fail fast, before any process starts
    if launched_by_torchrun():
        run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg)) if os.environ["RANK"] == "0" else None
        launch.run_torchrun(cfg, run_dir)
        return 0
    run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    print(f"omnilearn: {cfg.workers} workers, speeds {cfg.speeds}, controller {cfg.controller}, "
          f"global batch {cfg.global_batch}, run directory {run_dir}", flush=True)
    launch.run_local(cfg, run_dir)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from omnilearn.launch import WorkerFailed

    try:
        args = parser().parse_args(argv)
        return train(args)
    except (ConfigError, RunDirError) as e:
        print(f"omnilearn: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except WorkerFailed as e:
        print(f"omnilearn: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("omnilearn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
