"""``omnilearn bench``: the BSP bench (:mod:`~omnilearn.experiments.bench.bsp`) or, with ``--mode asp``, the ASP
bench (:mod:`~omnilearn.experiments.bench.asp`): flags checked, every arm planned before anything runs.

Run: ``python -m pytest -q tests/dist/test_bench.py``
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from omnilearn.distributed.group import launched_by_torchrun
from omnilearn.experiments.args import config_from_args, write_plots
from omnilearn.experiments.config import ConfigError

def bench(args: argparse.Namespace) -> int:
    from omnilearn.experiments.bench import bsp as bench_mod
    from omnilearn.experiments.bench.summary import markdown_table

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
        from omnilearn.experiments.bench import asp as aspbench

        if arms_text is not None:
            raise ConfigError("--arms picks the controllers of a BSP bench; --mode asp runs uniform, omnilearn, bsp")
        return aspbench.command(args, config_from_args, write_plots, budget_s, repeats or aspbench.REPEATS[mode], target)
    if budget_s is not None:
        raise ConfigError("--time-budget-s is only used with --mode asp; a BSP bench runs --steps per arm")
    settings = bench_mod.parse_settings(getattr(args, "speeds", ",".join(bench_mod.SETTINGS)))
    base = config_from_args(args, speeds=None, out=None, quiet=True)
    if base.framework != "pytorch":
        raise ConfigError(f"a BSP bench compares PyTorch runs (framework {base.framework!r}); benchmark TensorFlow "
                          "with omnilearn bench --mode asp --framework tensorflow")
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
    from omnilearn.experiments.train import workload
    from omnilearn.experiments.train.workload import resolve

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
            write_plots(path)
    return 0
