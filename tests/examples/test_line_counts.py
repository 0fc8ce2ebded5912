"""Each example says how many of its lines are OmniLearn's ("OmniLearn lines: N"), and that count is true.

A line is OmniLearn's when it ends in a ``# OmniLearn`` comment (what differs from the plain DDP
script it starts from). Honesty check: every code line that touches ``ol`` (the session) or
``omnilearn`` carries the mark. The common-shape example (a DataLoader with a DistributedSampler,
``hf_transformers.py``) needs at most 8, and the README's table states every count.

Run: ``python -m pytest -q tests/examples/test_line_counts.py``
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

import pytest

from runexample import EXAMPLES, ROOT

COMMON_SHAPE = {"hf_transformers.py"}
MARKED = sorted(p for p in EXAMPLES.glob("*.py") if "# OmniLearn" in p.read_text(encoding="utf-8"))


def marked(text: str) -> set[int]:
    """Lines whose comment starts ``# OmniLearn``."""
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT and t.string.startswith("# OmniLearn")}


def touching(text: str) -> set[int]:
    """Lines of code that use the session ``ol`` or the ``omnilearn`` module."""
    lines = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Name) and node.id in ("ol", "omnilearn"):
            lines.add(node.lineno)
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "omnilearn" for a in node.names):
            lines.add(node.lineno)
    return lines


@pytest.mark.parametrize("path", MARKED, ids=lambda p: p.name)
def test_stated_count_is_the_marked_count(path):
    text = path.read_text(encoding="utf-8")
    count = len(marked(text))
    unmarked = sorted(touching(text) - marked(text))
    assert not unmarked, f"{path.name}: lines {unmarked} use OmniLearn but are not marked '# OmniLearn'"
    stated = re.search(r"OmniLearn lines: (\d+)", text)
    assert stated and int(stated.group(1)) == count, f"{path.name} has {count} marked lines; its docstring says " \
                                                     f"{stated.group(1) if stated else 'nothing'}"
    if path.name in COMMON_SHAPE:
        assert count <= 8
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    row = next((line for line in readme.splitlines() if line.startswith("|") and f"examples/{path.name}" in line), "")
    assert row.rstrip(" |").endswith(f"| {count}"), f"README's examples table should say {count} for {path.name}"


def test_every_common_shape_example_is_counted():
    assert COMMON_SHAPE <= {p.name for p in MARKED}
