"""What OmniLearn's DDP wrapper and its weighted comm hook cost, apart from the loader and ``ol.step``.

Two ranks on CPU (gloo), one tiny MLP per variant, forward and backward only (no optimizer, no loader), each
variant trained in turn for ``--reps`` rounds of ``--steps`` steps, in the same processes: plain DDP (twice, two
identical instances: the spread between them is this comparison's floor), DDP without buffer sync (as
``ol.wrap_model`` builds it), a trivial subclass that only calls ``super().forward``, OmniLearn's
:class:`~omnilearn.bsp.wrap.BalancedDDP` without its hook, and with it (the weighted sum per bucket, the marks
in the last bucket's call and the engine callbacks, calling no-op session methods). Prints rank 0's median training-thread CPU and wall per step.

A benchmark, not a test: run it alone (``OMP_NUM_THREADS=1``: one core per rank).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 tools/ddp_wrapper_cost.py
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from omnilearn.bsp.backward import HookState, weighted_sum
from omnilearn.bsp.wrap import NO_BUFFER_BROADCAST, BalancedDDP


class Sub(DDP):
    def forward(self, *inputs, **kwargs):
        return super().forward(*inputs, **kwargs)


class Sink:
    """No-op stand-ins for the session's mark methods."""

    def ready(self) -> None:
        pass

    def reduced(self, last: bool) -> None:
        pass


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(40, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def run(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> tuple[float, float]:
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad = None
    return (time.thread_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sink = Sink()
    marked = BalancedDDP(net(), **NO_BUFFER_BROADCAST)
    state = HookState(process_group=marked.process_group, weight=0.5, on_ready=sink.ready, on_reduced=sink.reduced)
    DDP.register_comm_hook(marked, state, weighted_sum)  # equal shares (HL1): each bucket times 1/2, summed
    models = {"plain DDP": DDP(net()), "plain DDP (2nd)": DDP(net()),
              "DDP, no buffer sync": DDP(net(), **NO_BUFFER_BROADCAST), "subclass": Sub(net()),
              "BalancedDDP": BalancedDDP(net(), **NO_BUFFER_BROADCAST), "BalancedDDP + hook": marked}
    x, y = torch.randn(128, 40), torch.randint(0, 10, (128,))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in models}
    for _ in range(args.reps):
        for name, model in models.items():
            times[name].append(run(model, x, y, args.steps))
    if dist.get_rank() == 0:
        for name, t in times.items():
            print(f"{name:20s} cpu {statistics.median(c for c, _ in t) * 1e6:6.0f} us  "
                  f"wall {statistics.median(w for _, w in t) * 1e6:6.0f} us")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
