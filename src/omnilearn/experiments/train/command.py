"""``omnilearn train``: local workers (PyTorch or TensorFlow), one rank under torchrun, or a worker of a TF_CONFIG cluster.

Run: ``python -m pytest -q tests/dist/test_cli.py tests/tf/test_tf_train.py``
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from pathlib import Path

from omnilearn.config import dump_toml
from omnilearn.distributed.group import launched_by_torchrun
from omnilearn.experiments.args import config_from_args, write_plots
from omnilearn.experiments.config import ConfigError, TrainConfig
from omnilearn.experiments.train import preflight, restarts
from omnilearn.observe import samejob
from omnilearn.observe.rundir import prepare

def train(args: argparse.Namespace) -> int:
    from omnilearn.experiments.train import workload

    cfg = config_from_args(args)
    if restarts.torchrun_restart(cfg.out):  # a restarted or re-formed torchrun job continues the run in --out
        if not samejob.restarted() and os.environ.get("RANK") == "0":
            samejob.say_again(cfg.out, "resuming it from its newest checkpoint")
        cfg = dataclasses.replace(cfg, resume=True)
        for check in (preflight.check_processes, preflight.check_emulator, preflight.check_data):
            check(cfg)
    else:
        preflight.check(cfg)  # data layout, emulator, --out, process count: before anything is written or started
    if not launched_by_torchrun() and not os.environ.get("TF_CONFIG"):  # this command starts the workers
        from omnilearn.experiments.launch.supervise import start_method

        start_method()  # a bad OMNILEARN_START_METHOD: one line, before the run directory is made
    if cfg.framework == "tensorflow":
        return train_tensorflow(cfg, args)
    steps = workload.look(cfg)  # fail fast (data, model, run length) before any process starts
    if launched_by_torchrun():
        return train_torchrun(cfg, args)
    if cfg.resume:
        run_dir = Path(cfg.out)
    else:
        run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    announce(cfg, steps, run_dir)
    restarts.run_local_with_restarts(cfg, run_dir)
    if getattr(args, "plots", True):
        write_plots(run_dir)
    return 0


def announce(cfg: TrainConfig, steps: int, run_dir: Path, runtime: str = "") -> None:
    server = " + a parameter server (asp)" if cfg.mode == "asp" else ""
    speeds = f"speed schedule {cfg.speed_schedule}" if cfg.speed_schedule else f"speeds {cfg.speeds}"
    workers = f"{cfg.workers}{runtime} worker{'s' if cfg.workers > 1 else ''}{server}"
    print(f"omnilearn: {workers}, {speeds}, controller {cfg.controller}, global batch {cfg.global_batch}, "
          f"{steps} steps, run directory {run_dir}", flush=True)


def train_tensorflow(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """``--framework tensorflow``: local workers with TF_CONFIG each, or this process as one worker of TF_CONFIG's."""
    from omnilearn.experiments.train import workload

    if launched_by_torchrun():
        raise ConfigError("--framework tensorflow starts its own workers (or runs as one worker of TF_CONFIG), "
                          "not under torchrun")
    if importlib.util.find_spec("tensorflow") is None:
        raise ConfigError("--framework tensorflow needs TensorFlow: pip install 'omnilearn-hetero[tensorflow]'")
    if cfg.mode == "asp":
        return train_tensorflow_asp(cfg, args)
    if os.environ.get("TF_CONFIG"):  # one worker of a cluster started by hand (each machine its own TF_CONFIG)
        from omnilearn.experiments.train import tfjob

        main_worker = preflight.writes_run_dir(cfg)
        run_dir = Path(cfg.out) if cfg.resume else prepare(cfg.out, cfg.overwrite, dump_toml(cfg)) if main_worker \
            else None
        tfjob.train(cfg, run_dir)
        if main_worker and getattr(args, "plots", True):
            write_plots(run_dir)
        return 0
    from omnilearn.experiments.launch import tfworkers as tflaunch

    steps = workload.look(cfg)  # fail fast (data, model, run length) before any process starts
    run_dir = Path(cfg.out) if cfg.resume else prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    announce(cfg, steps, run_dir, " TensorFlow")
    tflaunch.run_local(cfg, run_dir)
    if getattr(args, "plots", True):
        write_plots(run_dir)
    return 0


def train_tensorflow_asp(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """``--framework tensorflow --mode asp``: a local parameter server, workers and chief (:mod:`.tfasp`)."""
    from omnilearn.experiments.train import tfasp, workload

    if os.environ.get("TF_CONFIG"):
        raise ConfigError("--framework tensorflow --mode asp starts its own local cluster (parameter server, "
                          "workers, chief); several machines (TF_CONFIG) are not supported yet")
    steps = workload.look(cfg)
    run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
    announce(cfg, steps, run_dir, " TensorFlow")
    print("omnilearn: TensorFlow ASP writes no checkpoints yet (--checkpoint-every is not used); a worker that "
          "gives no answer within --heartbeat-s is dropped as a dead one is", flush=True)
    tfasp.run_local(cfg, run_dir)
    return 0


def train_torchrun(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """One rank of a torchrun job; after a restart (``TORCHELASTIC_RESTART_COUNT`` > 0) it resumes the run."""
    from omnilearn.experiments.launch import local as launch

    restart = restarts.torchrun_restart(cfg.out)
    if cfg.max_restarts:
        raise ConfigError(f"--max-restarts {cfg.max_restarts} restarts local runs; under torchrun use torchrun's "
                          "own --max-restarts")
    if cfg.out is None and (restart or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)):
        raise ConfigError("torchrun --max-restarts needs --out: a restarted rank resumes the run found there")
    main_rank = os.environ["RANK"] == "0"
    if main_rank and not cfg.resume:
        run_dir = prepare(cfg.out, cfg.overwrite, dump_toml(cfg))
        samejob.mark(run_dir)  # a re-formed job (a node joined) continues this run
    else:
        run_dir = Path(cfg.out or ".")
    launch.run_torchrun([launch.Job(cfg, run_dir)], run_dir if main_rank else None)
    if main_rank and getattr(args, "plots", True):
        write_plots(run_dir)
    return 0
