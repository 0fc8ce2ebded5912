"""``omnilearn`` command line: ``omnilearn train|bench|report|simulate|launch [flags]``.

Examples::

    omnilearn train                                   # 4 local workers at HL8 on MNIST-1D
    omnilearn train --speeds 4,2,1 --max-steps 120   # 3 workers: one per speed
    omnilearn train --controller uniform --speeds HL8 # the plain data-parallel baseline
    torchrun --standalone --nproc-per-node 2 -m omnilearn train --speeds 2,1
    omnilearn bench --quick                           # uniform vs static vs omnilearn per HL
    omnilearn report runs/<timestamp>                 # PNG plots of a run or a bench
    omnilearn simulate --workers 1024 --noise 0.1     # the same controllers against modelled workers
    omnilearn launch --workers 2 --speeds 3,1 train.py # your own TensorFlow script as local workers

Settings come from defaults, then ``--config FILE.toml``, then flags. Bad input
ends with one ``omnilearn: error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import signal
import sys
import time
from pathlib import Path
from typing import Sequence

from omnilearn import __version__
from omnilearn.experiments.config import (ASP_DEFAULTS, DEVICES, EMULATORS, FRAMEWORKS, LANGUAGE_MODEL_DEFAULTS, LR_SCHEDULES, MODES, OPTIMIZERS, ConfigError, TrainConfig, build,
                              dump_toml, load_toml, workers_from_speeds)
from omnilearn.experiments.datasets.core import DATASETS
from omnilearn.experiments.zoo.models import MODELS, is_language_model
from omnilearn.experiments import preflight, restarts, userlaunch, whatif
from omnilearn.experiments.presets import load_preset, preset_names
from omnilearn.asp.rules import LR_SCALINGS
from omnilearn.balance.controllers import CONTROLLERS
from omnilearn.distributed.group import device_problem, launched_by_torchrun, torchrun_world_size
from omnilearn.emulation.speeds import speed_count
from omnilearn.observe.rundir import RunDirError, prepare

EXIT_USAGE, EXIT_FAILED = 2, 1
HARNESS_MODULES = ("matplotlib", "mnist1d", "PIL")  # what the [experiments] extra installs
NEEDS_EXTRA = "the experiment harness needs the [experiments] extra: pip install 'omnilearn-hetero[experiments]'"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def _workload_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``train`` and ``bench``: the workload and the controller's knobs."""
    d = TrainConfig.__dataclass_fields__
    add = p.add_argument
    add("--config", help="TOML file with settings (flags override it)")
    add("--preset", help=f"a paper workload's settings ({', '.join(preset_names())}) or a preset TOML file; "
        "--config and flags override it")
    add("--workers", type=int, help=f"local worker processes (default {d['workers'].default}; under torchrun: WORLD_SIZE)")
    add("--model", help=f"{', '.join(MODELS)} (default {d['model'].default}); language models start from "
        f"{', '.join(f'{k} {v}' for k, v in LANGUAGE_MODEL_DEFAULTS.items())}")
    add("--dataset", help=f"{', '.join(DATASETS)} (default {d['dataset'].default}, generated locally)")
    add("--data-dir", help="cifar10/cifar100/imagefolder: where the data is; text: a file or folder (default: "
        "Python's own standard library sources)")
    add("--input-shape", help="synthetic: sample shape, e.g. 40 (default) or 3x32x32")
    add("--num-classes", type=int, help="synthetic: number of classes (default 10)")
    add("--image-size", type=int, help=f"imagefolder: images resized to this square (default {d['image_size'].default})")
    add("--seq-len", type=int, help=f"text: bytes per sample (default {d['seq_len'].default})")
    add("--no-augment", dest="augment", action="store_false", help="image datasets: no random crop/flip in training")
    add("--global-batch", type=int, help=f"samples per step over all workers (default {d['global_batch'].default})")
    add("--epochs", type=int, help=f"passes over the training set (default {d['epochs'].default})")
    add("--optimizer", choices=OPTIMIZERS, help="sgd (default, with --momentum) or adamw")
    add("--lr", type=float, help=f"learning rate (default {d['lr'].default}; asp: the rate of a push of B/n "
        f"samples, default {ASP_DEFAULTS['lr']})")
    add("--lr-schedule", choices=LR_SCHEDULES, help="cosine (default) over the run, multistep (--milestones), constant")
    add("--milestones", help="multistep: epochs at which the rate is multiplied by --gamma, e.g. 15,30,45")
    add("--gamma", type=float, help=f"multistep decay factor (default {d['gamma'].default})")
    add("--momentum", type=float, help=f"SGD momentum (default {d['momentum'].default}; asp: "
        f"{ASP_DEFAULTS['momentum']}, on the server)")
    add("--weight-decay", type=float, help="weight decay (default 0)")
    add("--seed", type=int, help="seed for model init and data order (default 0)")
    add("--emulator", choices=EMULATORS, help="how slower workers are emulated: delay (default, portable), "
        "cgroup (CPU quota), affinity (CPU sets), docker (docker update per container), none")
    add("--containers", help="with --emulator docker: the workers' container names, comma-separated")
    add("--throttle-cpus", type=float, help="with cgroup/docker: CPUs of the fastest worker (default: cores / workers)")
    add("--deadband", type=float, help="change batches only if the predicted step time improves by more than this "
        "fraction (default 0.05) and by more than the measurement noise")
    add("--min-batch", type=int, help="smallest per-worker batch (default: a quarter of the even share, at most 8)")
    add("--max-batch", help="largest per-worker batch: one number, one per worker (256,64,64,64), or auto "
        "(CUDA: from a probe of free memory); default: the global batch")
    add("--batch-multiple", type=int, help="keep adaptive batches in multiples of this (fewer torch.compile "
        "recompiles; default 1)")
    add("--accumulation-steps", type=int, help="micro-batches per optimizer step on every worker (default 1); "
        "the global batch is per optimizer step")
    add("--control-interval", type=int, help=f"steps between controller decisions (default {d['control_interval'].default})")
    add("--overwrite", action="store_true", help="replace a previous run in --out")
    add("--device", choices=DEVICES, help="auto (default: CUDA if present), cpu or cuda")
    add("--loader-workers", type=int, help="DataLoader worker processes per worker (default 0)")
    add("--timeout-s", type=float, help="seconds before a collective waiting on a dead peer fails (default 300)")
    add("--heartbeat-s", type=float, help=f"a worker silent this long is named as hung and the run stops; in "
        f"--mode asp the server drops it and goes on (default {d['heartbeat_s'].default:g})")
    add("--oversubscribe", action="store_true", help="allow more local processes than 8 per core")
    add("--mode", choices=MODES, help="bsp (default: synchronous, DDP) or asp (asynchronous: a parameter server "
        "besides the --workers)")
    add("--lr-scaling", choices=LR_SCALINGS, help="asp: scale each push's rate by its batch / (B / n) (linear, "
        "default) or not (none)")
    add("--staleness-lr", action="store_true", help="asp: also divide each push's rate by its staleness")
    add("--max-staleness", type=int, help="asp: refuse a push more than this many versions old, once per batch: the "
        "worker recomputes it on fresh weights (default: no bound)")


def _train_parser(sub) -> None:
    p = sub.add_parser("train", help="train with heterogeneity-aware BSP", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS)
    _workload_args(p)
    add = p.add_argument
    add("--max-steps", type=int, help="stop after this many steps (default: all epochs; asp: steps x workers pushes)")
    add("--max-time-s", type=float, help="asp: stop after this many seconds of training")
    add("--speeds", help="relative worker speeds, e.g. 4,2,1 (3 workers unless --workers says so), or a level "
        "HL1/HL2/HL4/HL8 (default HL8 for 4 workers)")
    add("--speed-schedule", help="'paper' (HL1>2>4>8>8>4>2>1) or a TOML file of [[change]] at_step/at_epoch + speeds")
    add("--controller", choices=CONTROLLERS, help="model (default: fits t(b) = a + b*c per worker, equal finish "
        "times in one decision), omnilearn (the paper's proportional rule; the --mode asp default), static or uniform")
    add("--out", help="run directory (default runs/<timestamp>)")
    add("--checkpoint-every", type=int, help="steps between checkpoints in RUN_DIR/checkpoints (default "
        f"{TrainConfig.checkpoint_every}; 0: none; saved at the next control-interval end)")
    add("--keep-checkpoints", type=int, help=f"checkpoints kept (default {TrainConfig.keep_checkpoints})")
    add("--resume", action="store_true", help="continue the run in --out from its latest checkpoint, with its "
        "config.toml (flags override: e.g. another --workers); metrics are appended")
    add("--max-restarts", type=int, help="local runs: after a worker fails (asp: the server), restart all from the "
        "latest checkpoint up to this many times (default 0; under torchrun use torchrun --max-restarts)")
    add("--no-plots", dest="plots", action="store_false", help="do not render PNG plots at the end")
    add("--framework", choices=FRAMEWORKS, help="pytorch (default: DDP on torch.distributed) or tensorflow (Keras on "
        "tf.distribute, BSP, the default workload; needs the [tensorflow] extra)")


def _bench_parser(sub) -> None:
    from omnilearn.experiments import aspbench
    from omnilearn.experiments.bench import FIXED_ARMS, PAPER_BLOCK_STEPS, REPEATS, SETTINGS, STEPS

    p = sub.add_parser("bench", help="uniform vs static vs omnilearn (and plain DDP at HL1), side by side, over "
                       "interleaved repeats; --mode asp: asynchronous uniform vs omnilearn (and omnilearn BSP) at "
                       "equal training time and equal epochs", argument_default=argparse.SUPPRESS)
    _workload_args(p)
    add = p.add_argument
    add("--speeds", help=f"settings to run, comma-separated (default {','.join(SETTINGS)}; --mode asp: "
        f"{','.join(aspbench.SETTINGS)}, --quick {','.join(aspbench.QUICK_SETTINGS)})")
    add("--arms", help=f"controllers to compare, comma-separated, from {', '.join(CONTROLLERS)} (default "
        f"{','.join(FIXED_ARMS)} and --controller, itself model by default; plain DDP runs at HL1 besides)")
    add("--controller", choices=CONTROLLERS, help="the balancing arm beside uniform and static (default model; "
        "--arms overrides)")
    add("--quick", action="store_true", help="shorter: fewer steps and repeats, a few minutes on 2 cores")
    add("--repeats", type=int, help=f"interleaved repeats of every arm, arm order rotating (default "
        f"{REPEATS['full']}, --quick {REPEATS['quick']}; --mode asp: {aspbench.REPEATS['full']}, --quick "
        f"{aspbench.REPEATS['quick']}, repeat k uses --seed + k)")
    add("--steps", type=int, help=f"steps per arm and repeat at a fixed setting (default {STEPS['full']}, --quick "
        f"{STEPS['quick']}; figures from the epoch boundary at half on; --mode asp: steps of the bsp arm, default: "
        "estimated to cover the time budget)")
    add("--block-steps", type=int, help=f"steps per block of the 8-block paper routine (default "
        f"{PAPER_BLOCK_STEPS['full']}, --quick {PAPER_BLOCK_STEPS['quick']})")
    add("--time-budget-s", type=float, help=f"--mode asp: seconds of training per arm (default "
        f"{aspbench.BUDGET_S['full']:g}, --quick {aspbench.BUDGET_S['quick']:g})")
    add("--target-accuracy", type=float, help="also report time to this test accuracy (0-1) per arm")
    add("--out", help="bench directory (default runs/bench-<timestamp>)")
    add("--no-plots", dest="plots", action="store_false", help="do not render PNG plots at the end")


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="render PNG plots of a train run or a bench directory")
    p.add_argument("path", help="a run directory (metrics.jsonl) or a bench directory (bench.json)")
    p.add_argument("--tensorboard", metavar="LOGDIR", help="also write TensorBoard scalars of a run here")


def _simulate_parser(sub) -> None:
    p = sub.add_parser("simulate", help="what-if: the same controllers against 2 to 10,000 modelled workers "
                       "(speed mixes, noise, speed changes, sync cost, memory caps); --from-bench DIR validates "
                       "against a bench", description=whatif.__doc__.split("\n\n")[0])
    whatif.add_arguments(p)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="omnilearn", description="Heterogeneity-aware data-parallel training on PyTorch.")
    p.add_argument("--version", action="version", version=f"omnilearn {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    _bench_parser(sub)
    _report_parser(sub)
    _simulate_parser(sub)
    userlaunch.add_parser(sub)
    return p


NOT_CONFIG = ("command", "config", "plots", "quick", "repeats", "target_accuracy", "path", "tensorboard", "steps",
              "block_steps")


def _config(args: argparse.Namespace, **overrides) -> TrainConfig:
    values = {k: v for k, v in vars(args).items() if k not in NOT_CONFIG}
    values.update(overrides)
    resumed = None
    if values.get("resume"):
        resumed = restarts.resumed_run(getattr(args, "config", None), getattr(args, "out", None))
    if resumed is not None and values.get("workers", resumed.get("workers")) != resumed.get("workers"):
        if "speeds" not in values:
            resumed.pop("speeds", None)  # the old run's speeds were for its worker count
    file_values = resumed if resumed is not None else load_toml(args.config) if getattr(args, "config", None) else {}
    preset = values.get("preset", file_values.get("preset"))
    if preset is not None:
        preset_values = load_preset(preset)
        if launched_by_torchrun():
            preset_values.pop("workers", None)  # torchrun's world size decides
        file_values = {**preset_values, **file_values, "preset": preset_values["preset"]}
        values.pop("preset", None)
    if not launched_by_torchrun():  # torchrun's WORLD_SIZE decides: _torchrun_workers
        workers_from_speeds(values, file_values)
    merged = {**file_values, **values}
    if merged.get("lr_schedule", TrainConfig.lr_schedule) != "multistep" and "milestones" not in values:
        file_values.pop("milestones", None)  # a preset's milestones do not outlive its schedule
    if is_language_model(merged.get("model", TrainConfig.model)):
        file_values = {**LANGUAGE_MODEL_DEFAULTS, **file_values}
    if merged.get("speeds") is not None and merged.get("speed_schedule") is not None:
        raise ConfigError("--speeds and --speed-schedule both given; the schedule sets the speeds, drop --speeds")
    schedule = merged.get("speed_schedule")
    if isinstance(schedule, str) and schedule != "paper":
        values["speed_schedule"] = os.path.abspath(schedule)  # config.toml repeats the run from anywhere
    if launched_by_torchrun():
        values["workers"] = _torchrun_workers(values, file_values)
    if values.get("mode", file_values.get("mode")) == "asp":
        file_values = {**ASP_DEFAULTS, **file_values}
    cfg = build(file_values, values)
    if resumed is not None:
        restarts.check_resume(cfg, build(resumed, {}))
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.workers))
    problem = device_problem(cfg.device, local_workers)
    if problem:
        raise ConfigError(problem)
    if cfg.emulator in ("cgroup", "affinity", "docker"):
        from omnilearn.emulation.throttle import ThrottleError, preflight

        try:
            preflight(cfg.emulator, local_workers)
        except ThrottleError as e:
            raise ConfigError(str(e)) from None
    return cfg


def _torchrun_workers(values: dict, file_values: dict) -> int:
    """Workers under torchrun: WORLD_SIZE, less the parameter server in ASP."""
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError(f"RANK and WORLD_SIZE are set but {' and '.join(missing)} not: launch with torchrun, "
                          "or export the address and port of rank 0 (the server in --mode asp)")
    asp = values.get("mode", file_values.get("mode")) == "asp"
    world = torchrun_world_size()
    workers = world - 1 if asp else world
    if workers < 1:
        raise ConfigError(f"--mode asp needs a server and at least one worker: WORLD_SIZE {world} is too small; "
                          "use --nproc-per-node 2 or more")
    given = values.get("workers", file_values.get("workers"))
    if given is not None and given != workers:
        raise ConfigError(f"--workers {given} does not match torchrun's WORLD_SIZE {world}"
                          f"{' (one is the server)' if asp else ''}; drop --workers")
    typed = speed_count(values.get("speeds"))
    if typed is not None and typed != workers:
        raise ConfigError(f"--speeds {values['speeds']} gives {typed} workers but torchrun's WORLD_SIZE {world} "
                          f"gives {workers}{' (one is the server)' if asp else ''}; give one speed per worker")
    return workers


def _plots(path: Path) -> None:
    from omnilearn.experiments.report.records import ReportError
    from omnilearn.experiments.report.runs import render

    try:
        files = render(path)
    except ReportError as e:  # the run itself succeeded; say why there is no picture
        print(f"omnilearn: plots skipped: {e}", file=sys.stderr)
        return
    print(f"plots: {', '.join(str(f) for f in files)}")


def train(args: argparse.Namespace) -> int:
    from omnilearn.experiments import workload

    cfg = _config(args)
    if restarts.torchrun_restart():  # a restarted torchrun rank continues the run in --out, whatever it holds
        cfg = dataclasses.replace(cfg, resume=True)
        for check in (preflight.check_processes, preflight.check_emulator, preflight.check_data):
            check(cfg)
    else:
        preflight.check(cfg)  # data layout, emulator, --out, process count: before anything is written or started
    if cfg.framework == "tensorflow":
        return _train_tensorflow(cfg, args)
    steps = workload.look(cfg)  # fail fast (data, model, run length) before any process starts
    if launched_by_torchrun():
        return _train_torchrun(cfg, args)
    if cfg.resume:
        run_dir = Path(cfg.out)
    else:
        run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    _announce(cfg, steps, run_dir)
    restarts.run_local_with_restarts(cfg, run_dir)
    if getattr(args, "plots", True):
        _plots(run_dir)
    return 0


def _announce(cfg: TrainConfig, steps: int, run_dir: Path, runtime: str = "") -> None:
    server = " + a parameter server (asp)" if cfg.mode == "asp" else ""
    speeds = f"speed schedule {cfg.speed_schedule}" if cfg.speed_schedule else f"speeds {cfg.speeds}"
    workers = f"{cfg.workers}{runtime} worker{'s' if cfg.workers > 1 else ''}{server}"
    print(f"omnilearn: {workers}, {speeds}, controller {cfg.controller}, global batch {cfg.global_batch}, "
          f"{steps} steps, run directory {run_dir}", flush=True)


def _train_tensorflow(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """``--framework tensorflow``: local workers with TF_CONFIG each, or this process as one worker of TF_CONFIG's."""
    from omnilearn.experiments import workload

    if launched_by_torchrun():
        raise ConfigError("--framework tensorflow starts its own workers (or runs as one worker of TF_CONFIG), "
                          "not under torchrun")
    if importlib.util.find_spec("tensorflow") is None:
        raise ConfigError("--framework tensorflow needs TensorFlow: pip install 'omnilearn-hetero[tensorflow]'")
    if os.environ.get("TF_CONFIG"):  # one worker of a cluster started by hand (each machine its own TF_CONFIG)
        from omnilearn.experiments import tfjob

        main_worker = preflight.writes_run_dir(cfg)
        run_dir = Path(cfg.out) if cfg.resume else prepare(cfg.out, cfg.overwrite, dump_toml(cfg)) if main_worker \
            else None
        tfjob.train(cfg, run_dir)
        if main_worker and getattr(args, "plots", True):
            _plots(run_dir)
        return 0
    from omnilearn.experiments import tflaunch

    steps = workload.look(cfg)  # fail fast (data, model, run length) before any process starts
    run_dir = Path(cfg.out) if cfg.resume else prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    _announce(cfg, steps, run_dir, " TensorFlow")
    tflaunch.run_local(cfg, run_dir)
    if getattr(args, "plots", True):
        _plots(run_dir)
    return 0


def _train_torchrun(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """One rank of a torchrun job; after a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) it resumes the run."""
    from omnilearn.experiments import launch

    restart = restarts.torchrun_restart()
    if cfg.max_restarts:
        raise ConfigError(f"--max-restarts {cfg.max_restarts} restarts local runs; under torchrun use torchrun's "
                          "own --max-restarts")
    if cfg.out is None and (restart or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)):
        raise ConfigError("torchrun --max-restarts needs --out: a restarted rank resumes the run found there")
    main_rank = os.environ["RANK"] == "0"
    if main_rank and not cfg.resume:
        run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    else:
        run_dir = Path(cfg.out or ".")
    launch.run_torchrun([launch.Job(cfg, run_dir)], run_dir if main_rank else None)
    if main_rank and getattr(args, "plots", True):
        _plots(run_dir)
    return 0


def bench(args: argparse.Namespace) -> int:
    from omnilearn.experiments import bench as bench_mod
    from omnilearn.experiments.benchsummary import markdown_table

    if launched_by_torchrun():
        raise ConfigError("omnilearn bench launches its own local workers; run it without torchrun")
    budget_s = vars(args).pop("time_budget_s", None)  # not a TrainConfig field
    arms_text = vars(args).pop("arms", None)  # nor this
    repeats = getattr(args, "repeats", None)
    if repeats is not None and repeats < 1:
        raise ConfigError(f"--repeats {repeats} must be at least 1")
    target = getattr(args, "target_accuracy", None)
    if target is not None and not 0 < target <= 1:
        raise ConfigError(f"--target-accuracy {target} must be a fraction in (0, 1], e.g. 0.9")
    mode = "quick" if getattr(args, "quick", False) else "full"
    if getattr(args, "mode", "bsp") == "asp":
        from omnilearn.experiments import aspbench

        if arms_text is not None:
            raise ConfigError("--arms picks the controllers of a BSP bench; --mode asp runs uniform, omnilearn, bsp")
        return aspbench.command(args, _config, _plots, budget_s, repeats or aspbench.REPEATS[mode], target)
    if budget_s is not None:
        raise ConfigError("--time-budget-s is only used with --mode asp; a BSP bench runs --steps per arm")
    settings = bench_mod.parse_settings(getattr(args, "speeds", ",".join(bench_mod.SETTINGS)))
    base = _config(args, speeds=None, out=None, quiet=True)
    if base.framework != "pytorch":
        raise ConfigError(f"omnilearn bench compares PyTorch runs; framework {base.framework!r} trains with "
                          "omnilearn train --framework tensorflow")
    arms = bench_mod.parse_arms(arms_text, base.controller)
    if "HL1" in settings and base.emulator not in ("delay", "none"):
        raise ConfigError(f"the plain-DDP arm at HL1 runs without OS throttles; use --emulator delay or drop HL1 "
                          f"from --speeds (got --emulator {base.emulator})")
    if "HL1" in settings and base.global_batch % base.workers:
        raise ConfigError(f"the plain-DDP arm needs --global-batch {base.global_batch} divisible by --workers "
                          f"{base.workers}")
    out = Path(getattr(args, "out", None) or Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S"))
    steps = getattr(args, "steps", bench_mod.STEPS[mode])
    block = getattr(args, "block_steps", bench_mod.PAPER_BLOCK_STEPS[mode])
    for flag, value in (("--steps", steps), ("--block-steps", block)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be at least 1")
    from omnilearn.experiments import workload
    from omnilearn.experiments.workload import resolve

    n_train = len(workload.check(base).train)
    for arm in bench_mod.plan(base, settings, steps, block, 1, out, arms):  # every arm valid before anything runs
        resolve(arm.job.cfg, n_train)
    result = bench_mod.run(base, settings, (mode, steps, block), repeats or bench_mod.REPEATS[mode], target, out,
                           getattr(args, "overwrite", False), arms)
    print(markdown_table(result["results"], base.control_interval))
    print(f"bench: {out / 'bench.json'}")
    if getattr(args, "plots", True):
        runs = {Path(d) for r in result["results"] if r["arm"] != "ddp" for d in r["run_dirs"]}
        for path in [out, *sorted(runs)]:
            _plots(path)
    return 0


def report(args: argparse.Namespace) -> int:
    from omnilearn.experiments.report.records import ReportError
    from omnilearn.experiments.report.runs import render, write_tensorboard

    path = Path(args.path)
    try:
        if args.tensorboard:
            if (path / "bench.json").exists():
                raise ReportError(f"--tensorboard takes a train run directory; {path} is a bench (bench.json)")
            write_tensorboard(path, Path(args.tensorboard))
        files = render(path)
    except ReportError as e:
        raise ConfigError(str(e)) from None
    print("\n".join(str(f) for f in files))
    return 0


COMMANDS = {"train": train, "bench": bench, "report": report, "simulate": whatif.run, "launch": userlaunch.run}


def missing_harness_modules() -> list[str]:
    """The harness's own dependencies that are not installed (looked up, not imported)."""
    return [m for m in HARNESS_MODULES if importlib.util.find_spec(m) is None]


def main(argv: Sequence[str] | None = None) -> int:
    from omnilearn.experiments.launch import Interrupted, WorkerFailed
    from omnilearn.stopping import Stopped, signal_number

    if missing_harness_modules():
        print(f"omnilearn: error: {NEEDS_EXTRA}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args = parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in HARNESS_MODULES:
            raise
        print(f"omnilearn: error: {NEEDS_EXTRA}", file=sys.stderr)
        return EXIT_USAGE
    except (ConfigError, RunDirError) as e:
        print(f"omnilearn: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as e:  # Ctrl-C or kill: every worker stopped (after a final checkpoint where it could)
        print(f"omnilearn: {e}", file=sys.stderr)
        return e.exit_code
    except WorkerFailed as e:
        print(f"omnilearn: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Stopped as e:  # a torchrun rank told to stop: its final checkpoint is written
        print(f"omnilearn: {e}", file=sys.stderr)
        return 128 + (signal_number() or signal.SIGTERM)
    except KeyboardInterrupt:
        print("omnilearn: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
