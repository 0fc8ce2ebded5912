"""``omnilearn bench``: uniform vs static vs balancing controllers (and plain DDP at HL1), side by side.

How it measures (so a table can be trusted on a shared, noisy host):

- all runs go into one launch of the worker processes; the first job is a
  short unmeasured warm-up (``OUT/warmup``, discarded);
- repeats are interleaved short blocks: repeat 0 runs every arm of the first
  setting back to back, then every arm of the next setting..., then repeat 1
  (arm order rotated per repeat), so machine drift hits every arm alike;
- every step-time figure comes from the same steady range of steps
  (:func:`omnilearn.experiments.bench.stats.steady_range_start`: the first epoch
  boundary at or after half the run, where the controller has settled;
  ``paper``: the whole run); plain DDP takes its clock at the same step;
- speed-ups are paired (per repeat, against that repeat's uniform arm) and
  every figure is reported as mean (min–max) over repeats, with a verdict
  ("faster", "slower", "same (within spread)") only where the repeats agree
  (:mod:`omnilearn.experiments.bench.summary`).

``--arms`` picks the controllers (default ``uniform,static`` and ``--controller``,
itself ``omnilearn`` by default), e.g. ``--arms uniform,static,omnilearn,model``.
Same workload, seed and step count per arm; checkpoints off. Writes
``OUT/<setting>-<arm>[-r<k>]/`` run directories, ``OUT/bench.json`` (one
object per setting x arm), ``OUT/bench.md``, the table on stdout and PNG plots.

    omnilearn bench --quick --out runs/bench-quick     # 2 repeats, about 3-4 minutes on 2 cores
    omnilearn bench --out runs/bench                   # 3 repeats, about 10-14 minutes on 2 cores
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from omnilearn.balance.controllers import CONTROLLERS
from omnilearn.experiments.launch import local as launch
from omnilearn.experiments.bench.stats import (arm_figures, fidelity_error, reaction_steps, rows_from_records,
                                              settle_steps, steady_range_start, steady_wall_step_s, steps_per_epoch,
                                              time_to_accuracy)
from omnilearn.experiments.bench.summary import add_floor, add_paired, markdown_table, merge
from omnilearn.experiments.config import ConfigError, TrainConfig, dump_toml
from omnilearn.observe.metrics import read_metrics
from omnilearn.observe.rundir import RunDirError, prepare, write_json

SETTINGS = ("HL1", "HL2", "HL4", "HL8", "paper")
FIXED_ARMS = ("uniform", "static")  # always run unless --arms says otherwise; --controller comes on top
STEPS = {"full": 200, "quick": 100}  # per arm and repeat at a fixed setting (figures from about half on)
PAPER_BLOCK_STEPS = {"full": 60, "quick": 30}  # per block of the 8-block paper routine (measured whole)
REPEATS = {"full": 3, "quick": 2}
WARMUP_INTERVALS = 4  # control intervals of the unmeasured warm-up job (step times settle in about 30 steps)


@dataclasses.dataclass(frozen=True)
class Arm:
    setting: str
    arm: str
    repeat: int
    job: launch.Job


def parse_settings(text: str) -> tuple[str, ...]:
    settings = tuple(s.strip() for s in text.split(",") if s.strip())
    for s in settings:
        if s.upper() not in SETTINGS[:-1] and s.lower() != "paper":
            raise ConfigError(f"unknown bench setting {s!r}; choose from {', '.join(SETTINGS)}")
    if not settings:
        raise ConfigError("--speeds names no setting; e.g. --speeds HL1,HL8,paper")
    settings = tuple(s.lower() if s.lower() == "paper" else s.upper() for s in settings)
    if len(set(settings)) != len(settings):
        raise ConfigError(f"--speeds {text!r} names a setting twice; use --repeats to run arms more than once")
    return settings


def parse_arms(text: str | None, controller: str) -> tuple[str, ...]:
    """``--arms`` (comma list of controller names); default ``uniform,static`` plus ``controller``."""
    if text is None:
        return tuple(dict.fromkeys((*FIXED_ARMS, controller)))
    arms = tuple(a.strip().lower() for a in text.split(",") if a.strip())
    for a in arms:
        if a not in CONTROLLERS:
            hint = " (plain DDP runs at HL1 by itself)" if a == "ddp" else ""
            raise ConfigError(f"--arms names {a!r}, not a controller{hint}; choose from {', '.join(CONTROLLERS)}")
    if not arms:
        raise ConfigError("--arms names no controller; e.g. --arms uniform,static,omnilearn,model")
    if len(set(arms)) != len(arms):
        raise ConfigError(f"--arms {text!r} names a controller twice")
    return arms


def plan(base: TrainConfig, settings: tuple[str, ...], steps: int, block_steps: int, repeats: int,
         out: Path, arms: tuple[str, ...] = ("uniform", "static", "omnilearn")) -> list[Arm]:
    """Every measured run, in launch order: repeat by repeat, setting by setting, arms rotated per repeat."""
    planned: list[Arm] = []
    for rep in range(repeats):
        for setting in settings:
            names = list(arms) + (["ddp"] if setting == "HL1" else [])
            names = names[rep % len(names):] + names[: rep % len(names)]
            for name in names:
                paper = setting == "paper"
                cfg = dataclasses.replace(
                    base, controller="uniform" if name == "ddp" else name, speeds=None if paper else setting,
                    speed_schedule="paper" if paper else None, max_steps=8 * block_steps if paper else steps,
                    out=str(out / f"{setting}-{name}" if repeats == 1 else out / f"{setting}-{name}-r{rep}"),
                    overwrite=True, checkpoint_every=0,
                )
                kind = "ddp" if name == "ddp" else "omnilearn"
                planned.append(Arm(setting, name, rep, launch.Job(cfg, Path(cfg.out), kind)))
    return planned


def warmup(base: TrainConfig, settings: tuple[str, ...], arms: tuple[str, ...], out: Path) -> Arm:
    """The unmeasured first job: a balancing arm (if any) at the first fixed setting, a few control intervals."""
    fixed = [s for s in settings if s != "paper"]
    name = next((a for a in arms if a not in FIXED_ARMS), arms[0])
    cfg = dataclasses.replace(base, controller=name, speeds=fixed[0] if fixed else "HL8", speed_schedule=None,
                              max_steps=WARMUP_INTERVALS * base.control_interval, out=str(out / "warmup"),
                              overwrite=True, checkpoint_every=0)
    return Arm("warmup", name, -1, launch.Job(cfg, Path(cfg.out)))


def measure(arm: Arm, target_accuracy: float | None) -> dict:
    """The figures of one finished arm and repeat, over its steady range of steps, read back from its run directory."""
    cfg, run_dir = arm.job.cfg, arm.job.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {"setting": arm.setting, "arm": arm.arm, "repeat": arm.repeat, "steps": summary["steps"],
           "run_dir": str(run_dir), "test_accuracy": summary.get("test_accuracy"), "run_step_s": summary["wall_step_s"]}
    if arm.arm == "ddp":
        step_s = summary.get("steady_step_s") or summary["wall_step_s"]
        return {**out, "mean_step_s": step_s, "samples_per_s": cfg.global_batch / step_s, "ideal_step_s": None,
                "balance_efficiency": None, "figures_from_step": summary.get("steady_from_step", 0),
                "step_clock": "wall"}
    records = read_metrics(run_dir)
    rows = rows_from_records(records)
    paper, total = arm.setting == "paper", summary["steps"]
    first = steady_range_start(total, steps_per_epoch(records, total), dynamic=paper)
    evals = [r for r in records if r["event"] == "eval"]
    wall = steady_wall_step_s(evals, first, total, summary["train_s"])
    figures = arm_figures(rows, cfg.global_batch, wall or 1.0, first)
    if wall is None:  # no clock reading at the range's start: the time inside the steps stands in
        figures.update(mean_step_s=figures["in_step_s"], samples_per_s=cfg.global_batch / figures["in_step_s"])
    out.update(figures, figures_from_step=first, step_clock="wall" if wall is not None else "in-step")
    out["time_to_accuracy_s"] = time_to_accuracy(evals, target_accuracy)
    changes = [r["step"] for r in records if r["event"] == "speeds" and r["step"] > 0]
    out["reaction_steps"] = reaction_steps(rows, changes, total) if paper else None
    out["settle_steps"] = settle_steps(rows, changes, total) if paper else None
    out["speed_change_steps"] = changes if paper else None
    if arm.arm == "uniform" and not paper:
        out["fidelity_error"] = fidelity_error(rows, cfg.declared_speeds, first)
    return out


def summarise(per_repeat: list[dict], control_interval: int) -> list[dict]:
    """Paired speed-ups per repeat, then one row per setting x arm with spread, verdicts and the HL1 floor."""
    add_paired(per_repeat)
    rows = merge(per_repeat, control_interval)
    add_floor(rows)
    return rows


def run(base: TrainConfig, settings: tuple[str, ...], length: tuple[str, int, int], repeats: int,
        target_accuracy: float | None, out: Path, overwrite: bool,
        arms: tuple[str, ...] = ("uniform", "static", "omnilearn")) -> dict:
    """``length``: (mode name, steps per arm at a fixed setting, steps per paper-routine block)."""
    mode, steps, block_steps = length
    if (out / "bench.json").exists() and not overwrite:
        raise RunDirError(f"--out {str(out)!r} already holds a bench (bench.json); choose another --out or pass --overwrite")
    planned = plan(base, settings, steps, block_steps, repeats, out, arms)
    first = warmup(base, settings, arms, out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("error-rank*.log"):
        stale.unlink()
    for a in [first, *planned]:
        prepare(str(a.job.run_dir), True, dump_toml(a.job.cfg))
    print(f"omnilearn bench: {len(planned)} runs ({mode}: {repeats} repeat{'s' if repeats != 1 else ''} of arms "
          f"{','.join(arms)}) of {base.workers} workers after a warm-up, settings {','.join(settings)}, into {out}",
          flush=True)
    launch.run_local([first.job] + [a.job for a in planned], out)
    results = summarise([measure(a, target_accuracy) for a in planned], base.control_interval)
    bench = {"mode": mode, "steps": steps, "block_steps": block_steps, "repeats": repeats, "arms": list(arms),
             "settings": list(settings), "workers": base.workers, "global_batch": base.global_batch,
             "control_interval": base.control_interval, "warmup_steps": first.job.cfg.max_steps,
             "target_accuracy": target_accuracy, "results": results}
    write_json(out / "bench.json", bench)
    (out / "bench.md").write_text(markdown_table(results, base.control_interval) + "\n")
    return bench
