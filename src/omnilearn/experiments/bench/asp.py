"""``omnilearn bench --mode asp``: asynchronous training, uniform vs OmniLearn, at equal time and epochs.

Per setting (a heterogeneity level, or one speed per worker written ``1:2:4:8``, any worker count) and
repeat, three arms, each given the same budget of training time (evaluation excluded):

- ``uniform``: ASP, equal batches, no learning-rate scaling (the usual asynchronous baseline);
- ``omnilearn``: ASP, batches re-tuned by the controller, linear learning-rate scaling;
- ``bsp``: OmniLearn BSP (synchronous, controller omnilearn) with the BSP defaults
  (SGD lr 0.05, momentum 0.9 for a step of B samples), as ``omnilearn train`` runs it.

ASP arms use the paper's ASP HL table, ``bsp`` its BSP table. An ASP job needs
a parameter server besides the workers, so all ASP arms run in one launch
(arm order rotating per repeat) and the ``bsp`` arms in a second one. ASP
arms stop at the budget (``max_time_s``); BSP has no time limit, so its
``max_steps`` is estimated from the omnilearn ASP arm's throughput
(x ``BSP_MARGIN``; ``--steps`` overrides). Two accuracies compare the arms:
"at budget", the mean of the last ``SMOOTH_EVALS`` (3) evaluations (one per
epoch of data, and one at the end) at or before the budget (``accuracy_at_budget_s``: the training
time of the latest one counted; an arm with none by then, e.g. a bsp arm whose first epoch ended past
the budget on a slow host, gets its first evaluation instead, marked late); "at equal epochs",
of each arm's last 3 up to the largest number of whole epochs of data that
every arm of the setting reached in that repeat (a single evaluation moves by
2-4 points from epoch to epoch: docs/asp.md) (:func:`~omnilearn.experiments.bench.stats.epoch_accuracies`),
so an arm is not credited for getting through more data in the time.
Repeat k runs every arm with seed ``--seed + k`` (default 3 repeats, ``--quick``
1); figures are the mean and min–max over repeats. Unless ``--lr-schedule``
is given all arms use a constant rate: a step-based schedule would anneal
arms that progress at different speeds differently by the budget.

``--framework tensorflow``: the two ASP arms on TensorFlow's parameter server (:mod:`omnilearn.experiments.train.
tfasp`, one cluster per arm in turn), no ``bsp`` arm; the same record is read: its table reads beside PyTorch's.

Writes ``OUT/<setting>-<arm>[-r<k>]/`` run directories, ``OUT/bench.json``,
``OUT/bench.md`` and the table on stdout.

    omnilearn bench --mode asp --quick --out runs/asp-quick   # HL8, 1 seed, 20 s per arm: ~2-3 minutes on 2 cores
    omnilearn bench --mode asp --out runs/asp                 # HL1..HL8, 3 seeds, 30 s per arm: ~20 minutes
    omnilearn bench --mode asp --framework tensorflow --speeds HL8 --out runs/asp-tf   # HL8, 3 seeds: ~5 minutes
    omnilearn bench --mode asp --workers 8 --speeds 1:2:3:4:5:6:7:8 --out runs/asp-8   # 8 workers: ~9 minutes
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Callable

from omnilearn.experiments.launch import local as launch
from omnilearn.experiments.bench.bsp import Arm
from omnilearn.experiments.bench.bsp import parse_settings as parse_any_setting
from omnilearn.experiments.bench.aspresults import ARMS, add_equal_epochs, measure, merge
from omnilearn.experiments.bench.asptable import asp_markdown_table
from omnilearn.experiments.config import ConfigError, TrainConfig, dump_toml
from omnilearn.observe.rundir import RunDirError, prepare, write_json

SETTINGS = ("HL1", "HL2", "HL4", "HL8")
QUICK_SETTINGS = ("HL8",)
BSP_LR, BSP_MOMENTUM = TrainConfig.lr, TrainConfig.momentum  # the bsp arm's optimizer: the BSP defaults
BUDGET_S = {"full": 30.0, "quick": 20.0}  # training seconds per arm
REPEATS = {"full": 3, "quick": 1}  # seeds --seed, --seed + 1, ...
ASP_MAX_STEPS = 10**6  # ASP arms stop on time, long before this (and --epochs is lifted to match)
BSP_MARGIN = 1.3  # bsp steps: this many times what the ASP throughput would do in the budget


def parse_settings(text: str) -> tuple[str, ...]:
    """Levels (``HL8``) and explicit speeds, one per worker, colon-separated (``1:2:4:8``: a comma separates
    settings), in the order given."""
    items = [s.strip() for s in text.split(",") if s.strip()] or parse_any_setting(text)  # none: its one-line error
    settings = tuple(_speeds(s) if ":" in s else parse_any_setting(s)[0] for s in items)
    if "paper" in settings:
        raise ConfigError("bench --mode asp runs fixed levels (HL1,HL2,HL4,HL8) or speeds (1:2:4:8); the "
                          "step-based 'paper' routine has no equal-time meaning here")
    if len(set(settings)) != len(settings):
        raise ConfigError(f"--speeds {text!r} names a setting twice; use --repeats to run arms more than once")
    return settings


def _speeds(text: str) -> str:
    """``1:2:4:8`` checked: each a positive number."""
    for part in text.split(":"):
        try:
            ok = math.isfinite(float(part)) and float(part) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"--speeds setting {text!r}: {part!r} is not a positive speed; write one speed per "
                              "worker separated by colons, e.g. 1:2:4:8 (a comma separates settings)")
    return text


def speeds_of(setting: str) -> str:
    """The run's ``speeds`` for a bench setting: a level as it is, ``1:2:4:8`` as ``1,2,4,8``."""
    return setting.replace(":", ",")


def _out(out: Path, setting: str, arm: str, rep: int, repeats: int) -> str:
    return str(out / (f"{setting}-{arm}" if repeats == 1 else f"{setting}-{arm}-r{rep}"))


def plan_asp(base: TrainConfig, settings: tuple[str, ...], repeats: int, budget_s: float, out: Path) -> list[Arm]:
    arms = []
    for rep in range(repeats):
        for setting in settings:
            names = ARMS[:2] if rep % 2 == 0 else ARMS[1::-1]
            for name in names:
                cfg = dataclasses.replace(
                    base, mode="asp", controller=name, lr_scaling="none" if name == "uniform" else "linear",
                    speeds=speeds_of(setting), speed_schedule=None, seed=base.seed + rep, max_time_s=budget_s,
                    max_steps=ASP_MAX_STEPS, epochs=ASP_MAX_STEPS, out=_out(out, setting, name, rep, repeats),
                    overwrite=True)
                arms.append(Arm(setting, name, rep, launch.Job(cfg, Path(cfg.out))))
    return arms


def plan_bsp(base: TrainConfig, settings: tuple[str, ...], repeats: int, steps: dict[str, int], out: Path) -> list[Arm]:
    arms = []
    for rep in range(repeats):
        for setting in settings:
            cfg = dataclasses.replace(
                base, mode="bsp", controller="omnilearn", lr=BSP_LR, momentum=BSP_MOMENTUM, lr_scaling="linear",
                staleness_lr=False, max_time_s=None, speeds=speeds_of(setting), speed_schedule=None,
                seed=base.seed + rep,
                max_steps=steps[setting], epochs=steps[setting], out=_out(out, setting, "bsp", rep, repeats),
                overwrite=True)  # epochs: no cap below max_steps
            arms.append(Arm(setting, "bsp", rep, launch.Job(cfg, Path(cfg.out))))
    return arms


def bsp_steps(asp_results: list[dict], settings: tuple[str, ...], budget_s: float, global_batch: int) -> dict[str, int]:
    """Steps for the bsp arm to cover the budget: the omnilearn ASP arm's samples/s, with a margin."""
    out = {}
    for s in settings:
        rates = [r["samples_per_s"] for r in asp_results if r["setting"] == s and r["arm"] == "omnilearn"]
        rate = fmean(rates) if rates else max(r["samples_per_s"] for r in asp_results if r["setting"] == s)
        out[s] = max(1, math.ceil(BSP_MARGIN * budget_s * rate / global_batch))
    return out


def _launch(arms: list[Arm], out: Path) -> list[tuple[Arm, str]]:
    """Run the arms; the TensorFlow arms one cluster each, an arm that fails (a diverged run's non-finite
    gradients) named and left out, the others measured: ``(arm, why)`` per failed one. A signal's stop ends the
    whole bench."""
    for a in arms:
        prepare(str(a.job.run_dir), True, dump_toml(a.job.cfg))
    if not arms or arms[0].job.cfg.framework != "tensorflow":
        launch.run_local([a.job for a in arms], out)
        return []
    from omnilearn.experiments.launch.supervise import Interrupted, WorkerFailed
    from omnilearn.experiments.train import tfasp

    failed = []
    for a in arms:
        print(f"omnilearn bench: {a.setting}-{a.arm} (seed {a.job.cfg.seed}) on TensorFlow", flush=True)
        try:
            tfasp.run_local(a.job.cfg, a.job.run_dir)
        except Interrupted:
            raise  # a stop asked for ends the bench (exit 128 + the signal), as PyTorch's does: no next arm
        except WorkerFailed as e:
            print(f"omnilearn bench: warning: {a.setting}-{a.arm} (seed {a.job.cfg.seed}) failed, left out of its "
                  f"row: {e}", file=sys.stderr, flush=True)
            failed.append((a, str(e)))
    return failed


def run(base: TrainConfig, settings: tuple[str, ...], budget_s: float, repeats: int, bsp_steps_given: int | None,
        target: float | None, out: Path, overwrite: bool, length: str) -> dict:
    if (out / "bench.json").exists() and not overwrite:
        raise RunDirError(f"--out {str(out)!r} already holds a bench (bench.json); choose another --out or pass "
                          "--overwrite")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("error-rank*.log"):
        stale.unlink()
    asp = plan_asp(base, settings, repeats, budget_s, out)
    with_bsp = base.framework == "pytorch"
    print(f"omnilearn bench --mode asp: {len(asp)} asp runs"
          + (f" + {repeats * len(settings)} bsp runs" if with_bsp else f" on {base.framework}")
          + f" ({length}) of {base.workers} workers, {budget_s:g} s of training each, settings {','.join(settings)}, "
          f"into {out}", flush=True)
    failed = _launch(asp, out)
    measured = [measure(a, budget_s, target) for a in asp if a not in [f for f, _ in failed]]
    steps = None
    if with_bsp:
        steps = ({s: bsp_steps_given for s in settings} if bsp_steps_given
                 else bsp_steps(measured, settings, budget_s, base.global_batch))
        bsp = plan_bsp(base, settings, repeats, steps, out)
        _launch(bsp, out)
        measured += [measure(a, budget_s, target) for a in bsp]
    add_equal_epochs(measured)
    rows = merge(measured, settings, budget_s)
    bench = {"train_mode": "asp", "framework": base.framework, "mode": length, "time_budget_s": budget_s,
             "settings": list(settings), "arms": list(ARMS if with_bsp else ARMS[:2]), "workers": base.workers,
             "global_batch": base.global_batch, "control_interval": base.control_interval, "lr": base.lr,
             "bsp_lr": BSP_LR, "bsp_momentum": BSP_MOMENTUM, "lr_schedule": base.lr_schedule, "repeats": repeats,
             "seeds": [base.seed + k for k in range(repeats)], "bsp_steps": steps, "target_accuracy": target,
             "failed": [{"setting": a.setting, "arm": a.arm, "seed": a.job.cfg.seed, "error": why}
                        for a, why in failed],
             "results": rows}
    write_json(out / "bench.json", bench)
    (out / "bench.md").write_text(asp_markdown_table(rows, budget_s, target) + "\n")
    return bench


def _options(args, budget_s: float | None) -> tuple[str, tuple[str, ...], float, int | None]:
    """(length, settings, budget, bsp steps or None) from the CLI flags, checked."""
    length = "quick" if getattr(args, "quick", False) else "full"
    settings = parse_settings(getattr(args, "speeds", ",".join(QUICK_SETTINGS if length == "quick" else SETTINGS)))
    if hasattr(args, "block_steps"):
        raise ConfigError("--block-steps is for the paper routine of a BSP bench; --mode asp runs --time-budget-s")
    budget_s = BUDGET_S[length] if budget_s is None else budget_s
    if not (math.isfinite(budget_s) and budget_s > 0):
        raise ConfigError(f"--time-budget-s {budget_s:g} must be a positive number of seconds, e.g. 30")
    steps = getattr(args, "steps", None)
    if steps is not None and steps < 1:
        raise ConfigError(f"--steps {steps} (the bsp arm's steps) must be at least 1")
    return length, settings, budget_s, steps


def command(args, make_config: Callable[..., TrainConfig], render: Callable[[Path], None], budget_s: float | None,
            repeats: int, target: float | None) -> int:
    """The CLI's ``bench --mode asp`` (``make_config``/``render``: the CLI's config builder and plotter)."""
    from omnilearn.experiments.train import workload
    from omnilearn.experiments.train.workload import resolve

    length, settings, budget_s, steps = _options(args, budget_s)
    base = make_config(args, speeds=None, out=None, quiet=True)
    if "lr_schedule" not in vars(args) and base.lr_schedule == "cosine":
        base = dataclasses.replace(base, lr_schedule="constant")
    out = Path(getattr(args, "out", None) or Path("runs") / time.strftime("bench-asp-%Y%m%d-%H%M%S"))
    n_train = len(workload.check(base).train)
    bsp_probe = dict.fromkeys(settings, steps or 1)
    if base.framework == "tensorflow" and steps is not None:
        raise ConfigError(f"--steps {steps} sets the bsp arm's steps; --framework tensorflow runs no bsp arm: drop it")
    for arm in plan_asp(base, settings, 1, budget_s, out) + (
            plan_bsp(base, settings, 1, bsp_probe, out) if base.framework == "pytorch" else []):
        resolve(arm.job.cfg, n_train)  # every arm valid before anything runs
    result = run(base, settings, budget_s, repeats, steps, target, out, getattr(args, "overwrite", False), length)
    for r in result["results"]:
        if not r["covers_budget"]:
            print(f"omnilearn bench: warning: {r['setting']}-{r['arm']} trained {r['train_s']['min']:.1f} s, less "
                  f"than the budget {budget_s:g} s" + ("; raise --steps" if r["arm"] == "bsp" else ""), file=sys.stderr)
        late_s = r["accuracy_at_budget_s"]["max"]
        if late_s is not None and late_s > budget_s:
            print(f"omnilearn bench: warning: {r['setting']}-{r['arm']} had no evaluation by the budget "
                  f"{budget_s:g} s; its accuracy at budget is that of its first, after {late_s:.1f} s of training "
                  "(raise --time-budget-s)", file=sys.stderr)
    print(asp_markdown_table(result["results"], budget_s, target))
    for f in result["failed"]:
        print(f"omnilearn bench: warning: {f['setting']}-{f['arm']} seed {f['seed']} failed and is not in its row: "
              f"{f['error']}", file=sys.stderr)
    print(f"bench: {out / 'bench.json'}")
    if getattr(args, "plots", True):
        for path in [out, *sorted({Path(d) for r in result["results"] for d in r["run_dirs"]})]:
            render(path)
    return 0
