"""How a model's compute time grows with batch size on this machine (forward + backward + SGD step).

    python examples/batch_time.py --model resnet18 --input-shape 3x32x32 --threads 1

Prints milliseconds per step and samples/s for a range of batch sizes, and
the straight line ``t = alpha + beta * b`` fitted through them: ``alpha`` is
the fixed per-step cost that makes time not proportional to batch on CPUs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from omnilearn.experiments.zoo import models


def step_ms(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return float(np.median(times[1:]) * 1e3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet18", choices=models.MODELS)
    p.add_argument("--input-shape", default="3x32x32", help="one sample's shape, e.g. 3x32x32 or 64 (tokens)")
    p.add_argument("--classes", type=int, default=10, help="classes (vocabulary for gpt models)")
    p.add_argument("--batches", default="8,16,32,64,128")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads, as one worker of several has")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    shape = tuple(int(d) for d in args.input_shape.split("x"))
    model = models.build(args.model, shape, args.classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [int(b) for b in args.batches.split(",")]
    times = []
    print(f"{args.model} {args.input_shape}, {args.threads} thread(s)\n{'batch':>6} {'ms/step':>9} {'samples/s':>10}")
    for b in batches:
        if models.is_language_model(args.model):
            x = torch.randint(args.classes, (b, *shape))
            y = torch.randint(args.classes, (b, *shape))
        else:
            x, y = torch.randn(b, *shape), torch.randint(args.classes, (b,))
        times.append(step_ms(model, opt, x, y, args.repeats))
        print(f"{b:>6} {times[-1]:>9.1f} {b / times[-1] * 1e3:>10.0f}")
    beta, alpha = np.polyfit(batches, times, 1)
    print(f"fit: t = {alpha:.1f} ms + {beta:.2f} ms x batch")


if __name__ == "__main__":
    main()
