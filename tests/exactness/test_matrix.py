"""The exactness matrix's cells, one test id each: exact to the one-process reference, or refused in one line.

One launch per world size (2 and 3 ranks) runs all of that world size's
cells in the same processes (:func:`exactness.runner.launch`, a
module-scoped fixture, started when a test of that world size first asks);
each test reads its cell's results on every rank. The cells left out of
the matrix (:func:`exactness.matrix.not_generated`) are listed by
:func:`test_left_out_cells_say_why`.

Run: ``python -m pytest -q tests/exactness`` (``-p no:randomly``: in table order).
"""

from __future__ import annotations

import pytest

from exactness.matrix import cells, drawn_splits
from exactness.runner import launch

pytestmark = pytest.mark.dist

CELLS, LEFT_OUT = cells(drawn_splits())
LAUNCH_TIMEOUT_S = 600  # generous: a hung launch ends here, and its remaining cells fail with "no result"


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, list[dict]]:
    """Every cell run once: its results (one per rank), by cell id."""
    return launch(CELLS, tmp_path_factory.mktemp("exactness"), LAUNCH_TIMEOUT_S)


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(cell, launched):
    """Exact within the cell's tolerance on every rank; a control inexact; a refusal one line, on every rank."""
    rows = launched.get(cell.id, [])
    assert len(rows) == cell.world, f"no result from {cell.world - len(rows)} rank(s): the launch ended before"
    raised = [r["raised"] for r in rows if "raised" in r]
    if cell.expected != "refused":
        assert not raised, f"raised: {raised[0]}"
        rel = max(r["rel"] for r in rows)
        if cell.expected == "inexact":
            assert rel > cell.tolerance, f"a control cell came out exact ({rel:.2e})"
        else:
            assert rel <= cell.tolerance, f"relative error {rel:.2e} > {cell.tolerance:.0e}"
        return
    assert len(raised) == cell.world, f"not refused (relative error {max(r.get('rel', 0) for r in rows):.2e})"
    for message in raised:
        assert cell.refusal.lower() in message.lower() and "\n" not in message.strip(), message


def test_left_out_cells_say_why():
    """Every combination the generator skips has its reason; none of them is also a generated cell."""
    assert LEFT_OUT and all(why.strip() for why in LEFT_OUT.values())
    assert not {c.id for c in CELLS} & set(LEFT_OUT)
