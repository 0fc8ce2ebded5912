"""OmniLearn's per-step cost over plain DDP in instructions (valgrind's callgrind): a count the host's speed cannot move.

The wall and CPU times of ``tools/hl1_breakdown.py`` move by 10-30% from hour to hour on a shared 2-core host, more
than the few microseconds a change to the hot path saves. This counts instructions instead: both loops of
``hl1_breakdown`` (the tiny ``mlp``, 2 ranks, gloo) are built and warmed in every run, then one of them trains
``--steps`` steps, under ``valgrind --tool=callgrind`` with a fixed ``PYTHONHASHSEED`` (dict layouts, hence lookup
costs, otherwise differ per process). Runs of ``--short`` and ``--steps`` steps per loop give the instructions per
step by difference (start-up cancels); OmniLearn's are taken twice: with ``--control-interval`` (under valgrind a
step is ~50x slower, so windows are not stretched and the checks run: the meetings weigh far more than in a real
run) and with no window end at all (``--control-interval 100000``: the quiet step alone).

    python tools/hl1_icount.py [--src OTHER/src]   # about 17 minutes on 2 cores; run it alone

``--src``: import ``omnilearn`` from another tree (a ``git worktree`` of an older commit) to compare two versions.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RUN = """
import os, sys
sys.path.insert(0, {tools!r})
from hl1_breakdown import TrainConfig, dist, omni_loop, plain_loop, torch, workload
dist.init_process_group("gloo")
torch.set_num_threads(1)
cfg = TrainConfig(workers=dist.get_world_size(), global_batch=256, device="cpu", model="mlp",
                  control_interval=int(os.environ["HL1_INTERVAL"]))
splits = workload.load_data(cfg)
plain = plain_loop(cfg, splits, torch.device("cpu"))
ol, omni = omni_loop(cfg, splits, 100000)
plain.block(20)
omni.block(20)
(omni if os.environ["HL1_LOOP"] == "omni" else plain).block(int(os.environ["HL1_STEPS"]))
ol.release()
dist.destroy_process_group()
"""


def instructions(script: Path, loop: str, steps: int, interval: int, src: str | None) -> float:
    """Instructions of one run, the mean over its two ranks."""
    env = {**os.environ, "HL1_LOOP": loop, "HL1_STEPS": str(steps), "HL1_INTERVAL": str(interval),
           "PYTHONHASHSEED": "7", "OMP_NUM_THREADS": "1"}
    if src:
        env["PYTHONPATH"] = src
    with tempfile.TemporaryDirectory() as out:
        cmd = ["torchrun", "--standalone", "--nproc-per-node", "2", "--no-python", "valgrind", "--tool=callgrind",
               f"--callgrind-out-file={out}/cg.%p", sys.executable, str(script)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    refs = [int(m.replace(",", "")) for m in re.findall(r"I\s+refs:\s+([\d,]+)", done.stderr + done.stdout)]
    if done.returncode != 0 or len(refs) != 2:
        sys.exit(f"hl1_icount: the run ({loop}, {steps} steps) failed:\n{(done.stderr or done.stdout)[-2000:]}")
    return sum(refs) / 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=250, help="steps of the long runs")
    ap.add_argument("--short", type=int, default=50, help="steps of the short runs (the difference is per step)")
    ap.add_argument("--control-interval", type=int, default=15, help="OmniLearn's steps per control interval")
    ap.add_argument("--src", help="import omnilearn from this src directory instead of the installed one")
    args = ap.parse_args()
    if args.short < 1:
        ap.error(f"--short {args.short} must be at least 1 step")
    if args.steps <= args.short:
        ap.error(f"--steps {args.steps} must be above --short {args.short}")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "hl1_run.py"
        script.write_text(RUN.format(tools=str(Path(__file__).resolve().parent)))
        per_step = {}
        for name, loop, interval in (("plain DDP", "plain", args.control_interval),
                                     ("OmniLearn, quiet steps", "omni", 100000),
                                     (f"OmniLearn, interval {args.control_interval}", "omni", args.control_interval)):
            long, short = (instructions(script, loop, n, interval, args.src) for n in (args.steps, args.short))
            per_step[name] = (long - short) / (args.steps - args.short)
            print(f"{name:28s} {per_step[name] / 1e3:8.1f} k instructions a step", flush=True)
    plain = per_step["plain DDP"]
    for name, value in per_step.items():
        if name != "plain DDP":
            print(f"{name:28s} {value / plain - 1:+.1%} over plain DDP ({(value - plain) / 1e3:+.1f} k a step)")


if __name__ == "__main__":
    main()
