"""OmniLearn inside Ray Train: TorchTrainer's workers, each with its balanced share of every global batch.

    python examples/ray_train.py --workers 2                           # a local Ray, or the cluster of RAY_ADDRESS
    python examples/ray_train.py --workers 2:8 --storage /shared/runs  # elastic: 2 to 8 workers, as nodes come and go
    python examples/ray_train.py --workers 4 --every 1                 # a lost worker costs one step (a report a step)

The training function is an ordinary OmniLearn loop (the lines marked ``# OmniLearn``): ``omnilearn.setup()``
joins the process group Ray made, ``ol.wrap_model`` and ``ol.data_loader`` take the place of Ray's
``prepare_model`` and ``prepare_data_loader`` (which OmniLearn refuses: a second DDP, an equal-share sampler), and
two helpers carry the checkpoints through Ray: ``ol_ray.resume`` loads ``ray.train.get_checkpoint()`` at whatever
worker count Ray restarts with, ``ol_ray.report`` hands the session's checkpoint to ``ray.train.report`` every
``--every`` steps. When a worker dies, or a node joins an elastic run, Ray restarts the group from the last report
and the run goes on from that step with the same global batches, re-split over the new workers (docs/ray.md).

Synthetic data (a noisy linear target) and a small MLP: it runs on a laptop's CPUs. OmniLearn lines: 14
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def synthetic(samples: int = 4096, features: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    y = x @ torch.randn(features, 1, generator=g) + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def train_fn(config: dict) -> None:
    import omnilearn  # OmniLearn
    from omnilearn.integrations import ray as ol_ray  # OmniLearn

    ol = omnilearn.setup(global_batch=config["global_batch"], control_interval=10,  # OmniLearn: Ray's group
                         total_steps=config["steps"])
    torch.manual_seed(0)  # the same initial weights everywhere (DDP would copy rank 0's anyway)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model = ol.wrap_model(net)  # OmniLearn: not ray.train.torch.prepare_model
    loader = ol.data_loader(synthetic())  # OmniLearn: this worker's share of every global batch
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ol_ray.resume(ol, model=model, optimizer=optimizer)  # OmniLearn: Ray's last checkpoint, at any worker count
    while ol.next_step < config["steps"]:  # OmniLearn: from a resumed step on
        loader.set_epoch(ol.epoch)  # OmniLearn: a resumed run starts at its checkpoint's epoch and place
        for x, y in loader:
            loss = F.mse_loss(model(x.to(ol.device)), y.to(ol.device))  # OmniLearn: the session's device
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ol.step(loss)  # OmniLearn: times the step; every 10 steps the controller may move batches
            ol_ray.report(ol, {"loss": loss.item()}, model=model, optimizer=optimizer,  # OmniLearn
                          every=config["every"])
            if ol.next_step >= config["steps"]:  # OmniLearn
                break
    ol.finish()  # OmniLearn: the summary on rank 0
    ol.close()  # OmniLearn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="2", help="N, or MIN:MAX for an elastic run (default 2)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--every", type=int, default=50, help="steps between checkpoints reported to Ray (default 50)")
    p.add_argument("--storage", default=os.path.abspath("ray_results"), help="Ray's storage path (shared by nodes)")
    p.add_argument("--max-failures", type=int, default=3)
    args = p.parse_args()

    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if "RAY_ADDRESS" not in os.environ:
        ray.init(include_dashboard=False)  # a local Ray; with RAY_ADDRESS, that cluster's
    low, _, high = args.workers.partition(":")
    workers = (int(low), int(high)) if high else int(low)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={"steps": args.steps, "global_batch": args.global_batch, "every": args.every},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=args.storage, failure_config=FailureConfig(max_failures=args.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),  # Ray keeps every report's otherwise
    )
    result = trainer.fit()
    metrics = result.metrics
    print(f"trained {metrics['step']} steps on {metrics['workers']} workers (batches {metrics['batches']}), "
          f"last loss {metrics['loss']:.4f}; checkpoint {result.checkpoint.path}")
    ray.shutdown()


if __name__ == "__main__":
    main()
