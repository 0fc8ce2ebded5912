"""What a failure costs: work lost, time to resume, checkpoint size and save time. Real runs, one at a time.

    python -m omnilearn.experiments.bench.faults            # ~3 minutes on 2 cores
    python -m omnilearn.experiments.bench.faults --steps 400 --every 100 --kill-at 330

Three runs of ``omnilearn train`` in sequence (never run it beside other jobs):

1. the default job (cnn1d on MNIST-1D, 4 workers at HL8, dynamic controller)
   for ``--steps`` steps with ``--checkpoint-every``: checkpoint bytes and
   seconds per save (every rank waits for it), and its wall time;
2. the same with worker rank 2 SIGKILLed at step ``--kill-at``
   (``OMNILEARN_FAULT_KILL_AT``) and ``--max-restarts 1``: steps lost (the
   kill step minus the checkpoint resumed from), seconds from the kill to the
   resumed run's first step (the launcher notices, stops the others, spawns
   new workers, they load data, model and checkpoint), the extra wall time
   over run 1, and how far its weights are from run 1's (the dynamic
   controller's splits follow measured timings, so only float rounding of
   different splits separates them);
3. resnet18 (11.2 M parameters) on synthetic 3x32x32 data, 2 workers: checkpoint
   bytes and seconds per save.

Prints a Markdown table and writes ``faultbench.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from omnilearn.experiments.report.records import read_jsonl

DEFAULT_JOB = ("--workers", "4", "--speeds", "HL8")
RESNET = ("--model", "resnet18", "--dataset", "synthetic", "--input-shape", "3x32x32", "--global-batch", "64",
          "--workers", "2", "--max-steps", "12", "--checkpoint-every", "4", "--control-interval", "4")


def train(out: Path, *flags: str, env: dict | None = None) -> float:
    """Run ``omnilearn train`` to completion; its wall seconds."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "omnilearn", "train", "--out", str(out), "--no-plots", *flags],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"faultbench: omnilearn train {' '.join(flags)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def checkpoint_cost(run: Path) -> dict:
    saves = [r for r in read_jsonl(run / "metrics.jsonl") if r["event"] == "checkpoint"]
    return {"saves": len(saves), "bytes": saves[-1]["bytes"] if saves else None,
            "mean_save_s": sum(r["save_s"] for r in saves) / len(saves) if saves else None}


def rel_diff(a: Path, b: Path) -> float:
    wa, wb = (torch.load(p / "model.pt", weights_only=True) for p in (a, b))
    num = sum(((wa[k].double() - wb[k].double()) ** 2).sum() for k in wa) ** 0.5
    return float(num / sum((wa[k].double() ** 2).sum() for k in wa) ** 0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omnilearn.experiments.bench.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="steps of the default job (default 300)")
    p.add_argument("--every", type=int, default=100, help="--checkpoint-every (default 100)")
    p.add_argument("--kill-at", type=int, default=250, help="step at which worker rank 2 is killed (default 250)")
    p.add_argument("--out", default=None, help="directory for the runs (default runs/faultbench-<timestamp>)")
    args = p.parse_args(argv)
    if not 0 < args.kill_at < args.steps or args.every < 1:
        p.error(f"need 0 < --kill-at ({args.kill_at}) < --steps ({args.steps}) and --every >= 1")
    out = Path(args.out or Path("runs") / time.strftime("faultbench-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=False)
    job = (*DEFAULT_JOB, "--max-steps", str(args.steps), "--checkpoint-every", str(args.every))

    whole_s = train(out / "uninterrupted", *job)
    stamp = out / "killed-at.txt"
    killed_s = train(out / "killed", *job, "--max-restarts", "1",
                     env={"OMNILEARN_FAULT_KILL_AT": f"2:{args.kill_at}", "OMNILEARN_FAULT_STAMP": str(stamp)})
    resume = next(r for r in read_jsonl(out / "killed" / "metrics.jsonl") if r["event"] == "resume")
    resnet_s = train(out / "resnet18", *RESNET)

    result = {
        "default_job": {"steps": args.steps, "checkpoint_every": args.every, "wall_s": whole_s,
                        **checkpoint_cost(out / "uninterrupted")},
        "kill9": {"kill_at": args.kill_at, "resumed_at": resume["step"], "steps_lost": args.kill_at - resume["step"],
                  "kill_to_resume_s": resume["at"] - float(stamp.read_text()),
                  "wall_s": killed_s, "extra_wall_s": killed_s - whole_s,
                  "weights_rel_diff": rel_diff(out / "uninterrupted", out / "killed")},
        "resnet18": {"wall_s": resnet_s, **checkpoint_cost(out / "resnet18")},
    }
    (out / "faultbench.json").write_text(json.dumps(result, indent=2) + "\n")
    d, k, r = result["default_job"], result["kill9"], result["resnet18"]
    print("| measure | default job (cnn1d, 4 workers HL8) | resnet18 (2 workers) |\n|---|---|---|")
    print(f"| checkpoint size | {d['bytes'] / 1e6:.2f} MB | {r['bytes'] / 1e6:.1f} MB |")
    print(f"| time per save (all ranks wait) | {d['mean_save_s'] * 1e3:.0f} ms | {r['mean_save_s'] * 1e3:.0f} ms |")
    print(f"| steps lost to a kill -9 at step {k['kill_at']} (checkpoint every {args.every}) | "
          f"{k['steps_lost']} (resumed at {k['resumed_at']}) | |")
    print(f"| kill -9 to resumed training | {k['kill_to_resume_s']:.1f} s | |")
    print(f"| extra wall time of the killed run | {k['extra_wall_s']:.1f} s of {d['wall_s']:.1f} s | |")
    print(f"| final weights vs uninterrupted (relative) | {k['weights_rel_diff']:.2g} | |")
    print(f"faultbench: {out / 'faultbench.json'}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
