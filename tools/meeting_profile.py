"""Where OmniLearn's per-window work goes: the training thread's CPU time in each part of a window meeting.

Runs OmniLearn's API loop alone (tools/hl1_breakdown.py's workload: MNIST-1D, ``--model``, SGD, global batch 256,
controller ``uniform``) for ``--steps`` steps with the session's window functions wrapped in a timer of the
calling thread's CPU time (``time.thread_time``: what that thread itself spent, waits excluded), and prints rank
0's per-call and per-step microseconds, largest first. A window meeting starts at a window's last step
(``_end_interval``, or ``_check`` at each third of the interval where checks pay for their meeting) and is read
at the next (``_read_meeting``, which waits for the table and runs the control loop, ``_decide``: ``update`` at an
interval's end, ``shifted`` at a check, and closes the window, ``_close_window``). A profile, not a benchmark:
wrapping adds a microsecond or so per call.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/meeting_profile.py [--steps 3000]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import hl1_breakdown as hb  # noqa: E402  (the same workload and loop)

from omnilearn.balance.loop import ControlLoop  # noqa: E402
from omnilearn.bsp import interval, steppers, steps  # noqa: E402
from omnilearn.distributed.collect import RowGathering  # noqa: E402
from omnilearn.experiments.config import TrainConfig  # noqa: E402
from omnilearn.experiments.train import workload  # noqa: E402
from omnilearn.observe.rankrows import RankRows, Totals  # noqa: E402
from omnilearn.observe.recorder import Telemetry  # noqa: E402

PARTS = [(steppers.IntervalEnds, "_end_interval"), (steppers.IntervalEnds, "_check"),
         (steppers.IntervalEnds, "_read_meeting"), (steppers.IntervalEnds, "_decide"),
         (steppers.IntervalEnds, "_close_window"), (interval.Meeting, "__init__"), (interval.Meeting, "table"),
         (RowGathering, "__init__"), (ControlLoop, "update"), (ControlLoop, "shifted"), (Telemetry, "window"),
         (steps.StepLedger, "rows"), (RankRows, "add"), (Totals, "of_table")]


def timed(seconds: dict, calls: dict, cls: type, name: str) -> None:
    fn = getattr(cls, name)
    label = f"{cls.__name__}.{name}"

    def wrapper(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[label] += time.thread_time() - start
            calls[label] += 1

    setattr(cls, name, wrapper)  # a classmethod comes out of getattr bound already: the wrapper passes args on


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--control-interval", type=int, default=TrainConfig.control_interval)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = TrainConfig(workers=dist.get_world_size(), global_batch=256, device="cpu", model=args.model,
                      control_interval=args.control_interval)
    ol, loop = hb.omni_loop(cfg, workload.load_data(cfg), args.steps * 2)
    loop.block(300)  # warm-up
    seconds: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for cls, name in PARTS:
        if hasattr(cls, name):
            timed(seconds, calls, cls, name)
    start = time.thread_time()
    loop.block(args.steps)
    total = time.thread_time() - start
    ol.release()
    if dist.get_rank() == 0:
        print(f"rank 0 of {dist.get_world_size()}, {args.steps} steps, control interval {args.control_interval}: "
              f"training thread {total / args.steps * 1e6:.0f} us CPU per step")
        for label in sorted(seconds, key=lambda k: -seconds[k]):
            print(f"{label:30s} calls {calls[label]:5d}  us/call {seconds[label] / calls[label] * 1e6:7.1f}  "
                  f"us/step {seconds[label] / args.steps * 1e6:6.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
