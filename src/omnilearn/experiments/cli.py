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
import importlib.util
import signal
import sys
from pathlib import Path
from typing import Sequence

from omnilearn import __version__
from omnilearn.experiments.config import (ASP_DEFAULTS, DEVICES, EMULATORS, FRAMEWORKS, LANGUAGE_MODEL_DEFAULTS, LR_SCHEDULES, MODES, OPTIMIZERS, ConfigError, TrainConfig)
from omnilearn.experiments.catalog import DATASETS, MODELS
from omnilearn.experiments.bench import command as bench_command
from omnilearn.experiments.launch import script as userlaunch
from omnilearn.experiments.simulate import whatif
from omnilearn.experiments.train import command as train_command
from omnilearn.experiments.presets import preset_names
from omnilearn.asp.rules import LR_SCALINGS
from omnilearn.balance.controllers import CONTROLLERS
from omnilearn.observe.rundir import RunDirError

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
    add("--memory", help="each worker's memory, one size or one per worker (4GiB,16GiB), or auto (CUDA): caps "
        "counted from what the first step holds (docs/memory.md)")
    add("--batch-multiple", type=int, help="keep adaptive batches in multiples of this (fewer torch.compile "
        "recompiles; default 1)")
    add("--accumulation-steps", type=int, help="micro-batches per optimizer step on every worker (default 1); "
        "the global batch is per optimizer step")
    add("--control-interval", type=int, help=f"steps between controller decisions (default {d['control_interval'].default})")
    add("--min-window-s", type=float, help="a control window shorter than this many seconds is stretched to whole "
        f"intervals, at most 8 (short steps: fewer meetings); 0: never (default {d['min_window_s'].default:g})")
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
        "tf.distribute, the default workload, BSP or --mode asp on a parameter server; needs the [tensorflow] extra)")


def _bench_parser(sub) -> None:
    from omnilearn.experiments.bench import asp as aspbench
    from omnilearn.experiments.bench.bsp import FIXED_ARMS, PAPER_BLOCK_STEPS, REPEATS, SETTINGS, STEPS

    p = sub.add_parser("bench", help="uniform vs static vs omnilearn (and plain DDP at HL1), side by side, over "
                       "interleaved repeats; --mode asp: asynchronous uniform vs omnilearn (and omnilearn BSP) at "
                       "equal training time and equal epochs", argument_default=argparse.SUPPRESS)
    _workload_args(p)
    add = p.add_argument
    add("--speeds", help=f"settings to run, comma-separated (default {','.join(SETTINGS)}; --mode asp: "
        f"{','.join(aspbench.SETTINGS)}, --quick {','.join(aspbench.QUICK_SETTINGS)}; --mode asp also takes one "
        "speed per worker, colon-separated: --workers 8 --speeds 1:2:3:4:5:6:7:8)")
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
    add("--framework", choices=FRAMEWORKS, help="pytorch (default) or tensorflow (--mode asp only: the asp arms on "
        "TensorFlow's parameter-server runtime, no bsp arm)")
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


COMMANDS = {"train": train_command.train, "bench": bench_command.bench, "report": report, "simulate": whatif.run, "launch": userlaunch.run}


def missing_harness_modules() -> list[str]:
    """The harness's own dependencies that are not installed (looked up, not imported)."""
    return [m for m in HARNESS_MODULES if importlib.util.find_spec(m) is None]


def entry() -> int:
    """The console script and ``python -m omnilearn``: :func:`main`, then a quick exit. The command has closed what
    it wrote; Python's last garbage collections at exit would go over every object torch (or TensorFlow) made, a
    second of CPU, so the objects alive now are left out of them (``gc.freeze``, but where triton is loaded:
    :func:`omnilearn.experiments.launch.quickexit.freeze`): the process ends at once."""
    from omnilearn.experiments.launch import quickexit

    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    quickexit.freeze()
    return code


def main(argv: Sequence[str] | None = None) -> int:
    from omnilearn.experiments.launch.local import Interrupted, WorkerFailed
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
