"""The door cells of the exactness matrix, one test id each: exact to the one-process reference, or refused in one line.

The launches (:data:`exactness.doors.LAUNCHES`: Hugging Face, Lightning,
TensorFlow) start together, once for the module, and only those that a
selected test needs (``-k lightning`` starts one); each runs all its cells in
one set of rank processes (:mod:`exactness.door_torch`, :mod:`exactness.door_tf`).
Each test reads its cell's results on every rank: a relative error of at
most :data:`~exactness.matrix.EXACT_F64` with every rank's batch the split at
every step (and, for TensorFlow, the ranks' indices the plan's global
batches, float64 weights), or, for a row with ``refusal``, every rank raised
one line containing it; a ``control`` row's cell must be inexact. A row with ``known`` (a defect, exactness/doors.py
says which, with its numbers) is ``xfail(strict=True)``: it passes once
refused as the row asks, or exact.

Run: ``python -m pytest -q tests/exactness/test_doors.py`` (``-p no:randomly``: in table order).
"""

from __future__ import annotations

import json
import time

import pytest

from exactness.doors import DOOR_SHAPES, LAUNCHES, DoorCell, door_cells
from exactness.matrix import EXACT_F64, STEPS

pytestmark = pytest.mark.dist

CELLS = door_cells()
LAUNCH_TIMEOUT_S = 300  # generous: a hung launch ends here, and its remaining cells fail with "no result"
NEEDS = {"hf": ("transformers", "accelerate"), "lightning": ("lightning",), "tf": ("tensorflow", "keras")}


def _available(launch: str) -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in NEEDS[launch])


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory) -> dict[str, list[dict]]:
    """The selected cells' launches, run together: each cell id's results, one per rank."""
    from exactness import door_tf, door_torch
    from exactness.runner import _join

    wanted = {item.callspec.params["cell"].launch for item in request.session.items
              if hasattr(item, "callspec") and isinstance(item.callspec.params.get("cell"), DoorCell)}
    tmp, deadline_s = tmp_path_factory.mktemp("doors"), time.monotonic() + LAUNCH_TIMEOUT_S
    todo = {name: door_cells(name) for name in LAUNCHES if name in wanted and _available(name)}
    tf = door_tf.start(todo.pop("tf"), tmp) if "tf" in todo else None
    torch_launches = {name: door_torch.start(name, cells, tmp) for name, cells in todo.items()}
    for name, context in torch_launches.items():
        _join(context, name, deadline_s)
    results: dict[str, list[dict]] = {}
    if tf is not None:
        door_tf.join(tf, deadline_s)
        results.update(door_tf.results(tmp))
    for path in sorted(tmp.glob("*-rank*.jsonl")):
        if not path.name.startswith("tf-"):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                results.setdefault(row["id"], []).append(row)
    return results


def _marks(cell: DoorCell):
    return [pytest.mark.xfail(strict=True, reason=cell.row.known)] if cell.row.known else []


@pytest.mark.parametrize("cell", [pytest.param(c, id=c.id, marks=_marks(c)) for c in CELLS])
def test_door_cell(cell, launched):
    """Exact within 1e-12 on every rank at the declared split; or refused in one line, on every rank."""
    if not _available(cell.launch):
        pytest.skip(f"{' and '.join(NEEDS[cell.launch])} not installed")
    rows = launched.get(cell.id, [])
    assert len(rows) == cell.world, f"no result from {cell.world - len(rows)} rank(s): the launch ended before"
    raised = [r["raised"] for r in rows if "raised" in r]
    refused = bool(cell.row.refusal) and len(raised) == cell.world and all(
        cell.row.refusal.lower() in m.lower() and "\n" not in m.strip() for m in raised)
    if cell.row.known and (refused or not raised and max(r.get("rel", 1.0) for r in rows) <= EXACT_F64):
        return  # fixed, one way or the other: an XPASS, which strict makes a failure asking for the row's update
    if cell.row.refusal:
        rel = max((r.get("rel", 0.0) for r in rows), default=0.0)
        assert raised, f"not refused: trained, relative error {rel:.2e} to the plain process"
        assert refused, f"refused, but not in one line naming {cell.row.refusal!r}: {raised[0]}"
        return
    assert not raised, f"raised: {raised[0]}"
    for r in rows:
        assert r["sizes"] and len(r["sizes"]) == STEPS and all(tuple(step) == cell.split for step in r["sizes"]), \
            f"rank {r['rank']}: batches {r['sizes']}, not {cell.split} at each of {STEPS} steps"
        if "plan" in r:  # TensorFlow: the ranks' samples are the plan's global batches, in float64
            assert r["global"] == r["plan"], "the workers' samples are not the plan's global batches"
            assert r["dtypes"] == ["float64"], f"weights in {r['dtypes']}: the bound needs float64"
    assert len(set(cell.split)) > 1
    rel = max(r.get("rel", float("inf")) for r in rows)  # none: the reference failed (the worker's log says)
    print(f"{cell.id}: relative error {rel:.1e}")
    if cell.row.control:
        assert rel > EXACT_F64, f"a control cell came out exact ({rel:.2e})"
    else:
        assert rel <= EXACT_F64, f"relative error {rel:.2e} > {EXACT_F64:.0e}"


def test_every_door_has_its_shapes_and_the_tf_worker_the_matrix_constants():
    """At least 3 shapes a door; unique cell ids; the TensorFlow worker's constants (it does not import the
    matrix, which imports torch) are the matrix's."""
    from exactness import door_tf
    from exactness.matrix import GLOBAL_BATCH, LR

    doors = {d for ds in LAUNCHES.values() for d in ds}
    for door in doors:
        assert len([r for r in DOOR_SHAPES if r.door == door]) >= 3, door
    assert (door_tf.STEPS, door_tf.GLOBAL_BATCH, door_tf.LR) == (STEPS, GLOBAL_BATCH, LR)
    assert len({c.id for c in CELLS}) == len(CELLS)
