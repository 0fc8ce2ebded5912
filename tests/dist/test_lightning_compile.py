"""``trainer.fit(torch.compile(model))`` under ``OmniLearnStrategy``: Lightning's compiled steps, balanced, exact.

Lightning unwraps the compiled ``LightningModule`` and compiles its steps
itself (``from_compiled``); the strategy then wraps it in OmniLearn's DDP.
2 gloo ranks, float64, ``accumulate_grad_batches=2`` (``ol.backward`` per
micro-batch), scripted timings that move the split at the first control
interval end (30/30 -> 45/15): the weights equal one eager process of plain
SGD on the global batches (relative < 1e-12; about 2e-16 measured), and the
training step is compiled at most twice (``unique_graphs``: its first shape,
then one dynamic batch). No validation loader: its own recompiles (the test
module's counters, ``self.log``) are Lightning's and the user's, not OmniLearn's.
Backend ``aot_eager`` (dynamo and AOTAutograd, without inductor's compile time).

Run: ``python -m pytest -q tests/dist/test_lightning_compile.py`` (about 20 seconds on 2 cores).
"""

from __future__ import annotations

import warnings

import pytest
from ranks import start_ranks
import torch
import torch.distributed as dist

from omnilearn.decisions import SCRIPTED_ENV

pl = pytest.importorskip("lightning.pytorch")
from test_lightning_exact import (EXACT_F64, STEPS, Net, _join, diff, fresh_port, loaders,  # noqa: E402,F401
                                  reference, trainer)

pytestmark = pytest.mark.dist


def _worker(rank: int, store: str, out: str) -> None:
    from torch._dynamo.utils import counters

    _join(rank, 2, store)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, t = Net(), trainer(2, STEPS, "3,1")
        t.fit(torch.compile(model, backend="aot_eager"), loaders()[0])
    session = t.strategy.session
    torch.save({"weights": {k: v.detach().clone() for k, v in model.net.state_dict().items()},
                "plans": [list(session.schedule.peek(s)) for s in range(STEPS)], "step": t.global_step,
                "graphs": counters["stats"]["unique_graphs"]}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_a_compiled_lightning_module_trains_balanced_and_exact(tmp_path, monkeypatch):
    monkeypatch.setenv(SCRIPTED_ENV, "0.0001,0.0003")  # as speeds 3,1
    start_ranks(_worker, (str(tmp_path / "store"), str(tmp_path)), 2)
    expected = reference(STEPS)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert got["plans"][0] != got["plans"][-1], got["plans"]  # the split moved
        assert got["step"] == STEPS
        assert diff(got["weights"], expected) < EXACT_F64, f"rank {rank}: {diff(got['weights'], expected):.2e}"
        assert 1 <= got["graphs"] <= 2, f"rank {rank}: {got['graphs']} graphs"
