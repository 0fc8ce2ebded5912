"""``OmniLearnTrainer`` with ``torch_compile=True``: accelerate compiles OmniLearn's DDP model; 3 ranks stay exact.

The run of tests/dist/test_hf_exact.py (a 1-layer GPT-2 in float64, padded
labels, ``gradient_accumulation_steps=2``, the split moving at the first
control interval) with ``torch_compile=True, torch_compile_backend="aot_eager"``:
accelerate's ``prepare_model`` compiles the wrapped model last
(``torch.compile(ol.wrap_model(model))``). 3 heterogeneous ranks equal one
compiled process and one eager process (max abs diff < 1e-12, the eager
test's bound; 1.6e-13 measured against either, where the eager ranks
measure about 1e-16: compiled kernels on each rank's shapes round
differently and AdamW amplifies it; the SGD runs of tests/dist/test_compile.py
stay at 1e-16 compiled). A rank whose micro-batch
reaches 1 sample compiles once more (dynamo specialises size 1): at most 3
graphs per rank.

Run: ``python -m pytest -q tests/dist/test_hf_compile.py`` (about 40 seconds on 2 cores).
"""

from __future__ import annotations

import os

import pytest
from needs import needs
from ranks import scripted_rank_results
import torch


pytestmark = [pytest.mark.dist, needs("transformers", "hf"), needs("accelerate", "hf")]
COMPILED = dict(torch_compile=True, torch_compile_backend="aot_eager")


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from torch._dynamo.utils import counters

    from test_hf_exact import STEPS, trainer, weights

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    t = trainer(f"{out}/compiled", **COMPILED)
    t.train()
    torch.save({"weights": weights(t), "plans": [list(t.session.schedule.peek(s)) for s in range(STEPS)],
                "compiled": type(t.model_wrapped).__name__, "graphs": counters["stats"]["unique_graphs"]},
               f"{out}/rank{rank}.pt")
    from omnilearn.distributed import group
    group.destroy()


def test_three_compiled_ranks_equal_one_compiled_and_one_eager_process(tmp_path):
    from test_hf_exact import EXACT_F64, free_port, max_diff, trainer, weights

    ranks = scripted_rank_results(_worker, (3, free_port(), str(tmp_path)), tmp_path)
    references = {}
    for name, arguments in (("compiled", COMPILED), ("eager", {})):
        one = trainer(str(tmp_path / f"one_{name}"), **arguments)
        one.train()
        references[name] = weights(one)
    assert len({tuple(p) for p in ranks[0]["plans"]}) > 1, ranks[0]["plans"]  # the split moved
    for r, got in enumerate(ranks):
        assert got["compiled"] == "OptimizedModule"
        assert 1 <= got["graphs"] <= 3, f"rank {r}: {got['graphs']} graphs"
        for name, expected in references.items():
            print(f"rank {r} vs one {name} process: max abs diff {max_diff(got['weights'], expected):.1e}")
            assert max_diff(got["weights"], expected) < EXACT_F64, \
                f"rank {r} vs one {name} process: {max_diff(got['weights'], expected):.2e}"
