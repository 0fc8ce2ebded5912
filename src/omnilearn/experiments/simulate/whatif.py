"""``omnilearn simulate``: what would each controller do on a cluster like this? The library's loop, modelled workers.

The same :class:`~omnilearn.balance.loop.ControlLoop` and controllers that
``omnilearn train`` runs decide on modelled workers (speed mixes, noise, speed
changes, affine compute, a ring all-reduce, memory caps: :mod:`whatif_model`),
every controller on the same random draws, 2 to 10,000 workers::

    omnilearn simulate --workers 4096 --mix a100:0.25,v100:0.5,t4:0.25 --noise 0.1 --change 150:0-99:2.0
    omnilearn simulate --speeds 8,1,1,1 --model-bytes 4.5e7 --bandwidth-gbps 10 --plot sim.png --json sim.json
    omnilearn simulate --from-bench runs/bench-quick --setting HL8     # predicted vs measured
    omnilearn simulate --scenario churn                                # the loop's churn/follow table

Prints per controller: mean step ms, ideal ms (balanced split of the true
speeds under the same noise, plus sync), balance efficiency (ideal / step),
speed-up over uniform and static, batch changes, reaction steps after each
speed change (to within 10% of the ideal), median decision ms. The
integrator wires ``omnilearn simulate`` to :func:`add_arguments` and :func:`run`.
See docs/simulate.md.

Run: ``python -m omnilearn.experiments.simulate.whatif --workers 64 --noise 0.1 --change 150:0:2``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from omnilearn.config import ConfigError
from omnilearn.experiments.simulate.args import add_arguments, parse_controllers, scenario_from_args
from omnilearn.experiments.simulate.model import Scenario
from omnilearn.experiments.simulate.run import run_all, watched

__all__ = ["add_arguments", "main", "run"]


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def steps_list(values: Sequence[int | None]) -> str:
    return ",".join(">end" if v is None else str(v) for v in values) or "-"


def describe(sc: Scenario) -> str:
    speed = 1.0 / sc.beta_s
    return (f"{sc.workers} workers, speeds {speed.min() / speed.max():.3g}..1 of the fastest, global batch "
            f"{sc.global_batch}, {sc.steps} steps, {sc.interval}-step windows, "
            + (f"noise {sc.noise:g}" + (f" with {sc.spike_p:g} spikes x{sc.spike:g}" if sc.spike_p else "")
               if sc.residuals is None else "measured noise")
            + f", sync {1e3 * sc.sync_s:.3g} ms, speed changes at {list(sc.change_steps) or 'none'}")


def whatif_table(rows: list[dict]) -> str:
    head = (f"{'controller':<10} {'step ms':>9} {'ideal ms':>9} {'eff':>6} {'vs unif':>8} {'vs static':>9} "
            f"{'changes':>7} {'reaction steps':>15} {'decide ms':>9}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['controller']:<10} {r['step_ms']:>9.2f} {r['ideal_ms']:>9.2f} "
                     f"{r['balance_efficiency']:>6.3f} "
                     f"{fmt(r['speedup_uniform']):>8} {fmt(r['speedup_static']):>9} {r['changes']:>7} "
                     f"{steps_list(r['reaction_steps']):>15} {r['decision_ms']:>9.2f}")
    return "\n".join(lines)


def validation_table(rows: list[dict]) -> str:
    cols = (("step_ms", "step ms", ".1f"), ("speedup", "speed-up", ".2f"), ("balance_efficiency", "balance eff", ".3f"))
    head = f"{'arm':<10} {'role':<11}" + "".join(f" {name + ' pred/meas (err)':>30}" for _, name, _ in cols)
    lines = [head]
    for r in rows:
        cells = []
        for key, _, spec in cols:
            c = r[key]
            err = "" if c["error"] is None else f" ({100 * c['error']:+.1f}%)"
            cells.append(f" {fmt(c['predicted'], spec) + ' / ' + fmt(c['measured'], spec) + err:>30}")
        lines.append(f"{r['arm']:<10} {r['role']:<11}" + "".join(cells))
    return "\n".join(lines)


def run_whatif(args: argparse.Namespace) -> dict:
    names = parse_controllers(args.controllers)
    sc = scenario_from_args(args)
    if not 0 <= args.from_step < sc.steps:
        raise ConfigError(f"--from-step {args.from_step} must be within 0..{sc.steps - 1} (--steps {sc.steps})")
    begin = time.perf_counter()
    rows, traces, ideal_s = run_all(sc, names, args.from_step)
    print(f"omnilearn simulate: {describe(sc)}")
    print(whatif_table(rows))
    print(f"({len(names)} controllers in {time.perf_counter() - begin:.1f} s; ideal: the balanced split of the true "
          "speeds under the same noise draws, plus sync; reaction: steps after a change until within 10% of it)")
    if args.plot:
        from omnilearn.experiments.simulate.plot import plot

        plot(args.plot, traces, ideal_s, watched(sc), sc.change_steps)
        print(f"plot: {args.plot}")
    return {"scenario": describe(sc), "workers": sc.workers, "global_batch": sc.global_batch, "steps": sc.steps,
            "control_interval": sc.interval, "from_step": args.from_step, "change_steps": list(sc.change_steps),
            "results": rows}


def run_from_bench(args: argparse.Namespace) -> dict:
    from omnilearn.experiments.simulate.bench import calibrate, predict

    if args.seeds < 1:
        raise ConfigError(f"--seeds {args.seeds} must be at least 1")
    sc, facts = calibrate(Path(args.from_bench), args.setting, args.seed)
    rows = predict(sc, facts, args.seeds)
    print(f"omnilearn simulate --from-bench {args.from_bench}: {facts['setting']}, calibrated on "
          f"{facts['calibration_runs']} uniform/static runs; figures from step {facts['first_step']} of {sc.steps}, "
          f"{args.seeds} simulated repeats per arm")
    print("fit per worker: " + ", ".join(f"w{i} {1e3 * a:.2f} ms + {1e3 * b:.4f} ms/sample"
                                         for i, (a, b) in enumerate(zip(sc.alpha_s, sc.beta_s)))
          + f"; sync median {1e3 * float(sorted(sc.sync_samples)[len(sc.sync_samples) // 2]):.2f} ms, "
          f"outside the step {1e3 * sc.gap_s:.2f} ms")
    print(validation_table(rows))
    return {"from_bench": str(args.from_bench), "setting": facts["setting"], "first_step": facts["first_step"],
            "alpha_s": sc.alpha_s.tolist(), "beta_s": sc.beta_s.tolist(), "gap_s": sc.gap_s, "validation": rows}


def run(args: argparse.Namespace) -> int:
    """``omnilearn simulate``: 0 on success; bad input raises :class:`ConfigError`."""
    if args.scenario == "churn":
        from omnilearn.experiments.simulate import churn as simulate

        simulate.main(["--workers", str(args.workers)] if args.workers else [])
        return 0
    figures = run_from_bench(args) if args.from_bench else run_whatif(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
        print(f"json: {args.json}")
    return 0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, as the omnilearn CLI
        raise ConfigError(f"{message} (see `{self.prog} --help`)")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="omnilearn simulate", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ConfigError as e:
        print(f"omnilearn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
