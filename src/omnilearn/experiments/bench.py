"""``omnilearn bench``: uniform vs static vs OmniLearn (and plain DDP at HL1), side by side.

All arms run in one launch, in the same worker processes, one after the
other and interleaved per setting (with ``--repeats`` the arm order rotates),
so machine drift hits every arm alike. Same workload, seed and step count per
arm. Writes ``OUT/<setting>-<arm>/`` run directories, ``OUT/bench.json`` (one
object per setting x arm), a Markdown table on stdout and PNG plots.

    omnilearn bench --quick --out runs/bench-quick     # a few minutes on 2 cores
    omnilearn bench --out runs/bench                   # the table quoted in README.md
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from statistics import fmean

from omnilearn.experiments import launch
from omnilearn.experiments.benchstats import (add_speedups, arm_figures, fidelity_error, markdown_table, reaction_steps,
                                  rows_from_records, settle_steps, time_to_accuracy)
from omnilearn.experiments.config import ConfigError, TrainConfig, dump_toml
from omnilearn.observe.metrics import read_metrics
from omnilearn.observe.rundir import RunDirError, prepare, write_json

SETTINGS = ("HL1", "HL2", "HL4", "HL8", "paper")
ARMS = ("uniform", "static", "omnilearn")
STEPS = {"full": 300, "quick": 90}  # per arm at a fixed setting
PAPER_BLOCK_STEPS = {"full": 60, "quick": 40}  # per block of the 8-block paper routine


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


def plan(base: TrainConfig, settings: tuple[str, ...], steps: int, block_steps: int, repeats: int,
         out: Path) -> list[Arm]:
    arms: list[Arm] = []
    for rep in range(repeats):
        for setting in settings:
            names = list(ARMS) + (["ddp"] if setting == "HL1" else [])
            names = names[rep % len(names):] + names[: rep % len(names)]
            for name in names:
                paper = setting == "paper"
                cfg = dataclasses.replace(
                    base, controller="uniform" if name == "ddp" else name, speeds=None if paper else setting,
                    speed_schedule="paper" if paper else None, max_steps=8 * block_steps if paper else steps,
                    out=str(out / f"{setting}-{name}" if repeats == 1 else out / f"{setting}-{name}-r{rep}"),
                    overwrite=True,
                )
                arms.append(Arm(setting, name, rep, launch.Job(cfg, Path(cfg.out), "ddp" if name == "ddp" else "omnilearn")))
    return arms


def measure(arm: Arm, target_accuracy: float | None) -> dict:
    """The figures of one finished arm, read back from its run directory."""
    cfg, run_dir = arm.job.cfg, arm.job.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {"setting": arm.setting, "arm": arm.arm, "repeat": arm.repeat, "steps": summary["steps"],
           "run_dir": str(run_dir), "test_accuracy": summary.get("test_accuracy")}
    if arm.arm == "ddp":
        return {**out, "mean_step_s": summary["wall_step_s"], "samples_per_s": summary["samples_per_s"],
                "ideal_step_s": None, "balance_efficiency": None}
    records = read_metrics(run_dir)
    rows = rows_from_records(records)
    paper = arm.setting == "paper"
    first = 1 if paper else summary["steps"] // 2
    out.update(arm_figures(rows, cfg.global_batch, summary["wall_step_s"], first))
    out["figures_from_step"] = first
    evals = [r for r in records if r["event"] == "eval"]
    out["time_to_accuracy_s"] = time_to_accuracy(evals, target_accuracy)
    changes = [r["step"] for r in records if r["event"] == "speeds" and r["step"] > 0]
    out["reaction_steps"] = reaction_steps(rows, changes, summary["steps"]) if paper else None
    out["settle_steps"] = settle_steps(rows, changes, summary["steps"]) if paper else None
    out["speed_change_steps"] = changes if paper else None
    if arm.arm == "uniform" and not paper:
        out["fidelity_error"] = fidelity_error(rows, cfg.declared_speeds, first)
    return out


def _merge(values: list):
    """Repeats of one figure: floats averaged, lists element-wise, step counts by their worst case."""
    first = values[0]
    if isinstance(first, float) and all(isinstance(v, float) for v in values):
        return fmean(values)
    if isinstance(first, list) and all(isinstance(v, list) and len(v) == len(first) for v in values):
        return [_merge(list(col)) for col in zip(*values)]
    if isinstance(first, int) and not isinstance(first, bool) and all(isinstance(v, int) for v in values):
        return max(values)  # reaction/settle steps: the slowest repeat
    if any(v is None for v in values):
        return None  # e.g. a repeat that never reached the target accuracy, or never settled
    return first


def average(results: list[dict]) -> list[dict]:
    """One row per setting x arm, repeats merged (see :func:`_merge`); ``run_dirs`` lists them all."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["setting"], r["arm"]), []).append(r)
    merged = []
    for rs in groups.values():
        row = {key: _merge([r.get(key) for r in rs]) for key in rs[0] if key not in ("run_dir", "repeat")}
        row.update(steps=rs[0]["steps"], repeats=len(rs), run_dirs=[r["run_dir"] for r in rs])
        merged.append(row)
    return merged


def run(base: TrainConfig, settings: tuple[str, ...], length: tuple[str, int, int], repeats: int,
        target_accuracy: float | None, out: Path, overwrite: bool) -> dict:
    """``length``: (mode name, steps per arm at a fixed setting, steps per paper-routine block)."""
    mode, steps, block_steps = length
    if (out / "bench.json").exists() and not overwrite:
        raise RunDirError(f"--out {str(out)!r} already holds a bench (bench.json); choose another --out or pass --overwrite")
    arms = plan(base, settings, steps, block_steps, repeats, out)
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("error-rank*.log"):
        stale.unlink()
    for a in arms:
        prepare(str(a.job.run_dir), True, dump_toml(a.job.cfg))
    print(f"omnilearn bench: {len(arms)} runs ({mode}) of {base.workers} workers, settings {','.join(settings)}, "
          f"into {out}", flush=True)
    launch.run_local([a.job for a in arms], out)
    results = average([measure(a, target_accuracy) for a in arms])
    add_speedups(results)
    bench = {"mode": mode, "steps": steps, "block_steps": block_steps, "settings": list(settings), "workers": base.workers, "global_batch": base.global_batch,
             "control_interval": base.control_interval, "target_accuracy": target_accuracy, "results": results}
    write_json(out / "bench.json", bench)
    (out / "bench.md").write_text(markdown_table(results) + "\n")
    return bench
