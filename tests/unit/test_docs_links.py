"""The documentation holds together: links resolve, the README stays short, its commands are CI's.

Pure file reads, no imports of the package. Over README.md and docs/*.md:
every relative link and image (``[text](path)``, ``![alt](path)``, outside
code) points to a file or folder that exists, and ``file.md#anchor`` (or
``#anchor``) to a heading of that file, by GitHub's slug rule (lowercase,
punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats). The
README is at most 200 lines, and its two commands are those of ``.ci/run``:
the test command verbatim, the train command with the same torch pin. Each
check is shown able to fail on a small tree in ``tmp_path``.

Run:  cd /work/main && python -m pytest -q tests/unit/test_docs_links.py
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`+[^`]*`+")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lowercase, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and image outside code."""
    found = []
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        for match in LINK.finditer(INLINE_CODE.sub("", line)):
            found.append((number, match.group(1)))
    return found


def broken_links(files: list[Path], root: Path = REPO) -> list[str]:
    problems = []
    for path in files:
        for number, target in links(path):
            if SCHEME.match(target):
                continue  # http(s), mailto: not checked here
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def readme_commands(readme: str) -> list[str]:
    """The `pip install ...` lines of the README's "Two commands" section."""
    section = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for _, line in _fenced(section) if line.strip().startswith("pip install")]


def _fenced(text: str) -> list[tuple[int, str]]:
    prose = {number for number, _ in prose_lines(text)}
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if n not in prose and not FENCE.match(line)]


def command_problems(readme: str, ci_run: str) -> list[str]:
    commands = readme_commands(readme)
    train = [c for c in commands if c.endswith("omnilearn train")]
    test = [c for c in commands if "pytest" in c]
    if len(commands) != 2 or len(train) != 1 or len(test) != 1:
        return [f"the README's 'Two commands' section should hold one train and one test command, got {commands}"]
    ci_lines = [line.strip() for line in ci_run.splitlines()]
    problems = []
    if test[0] not in ci_lines:
        problems.append(f".ci/run does not run the README's test command verbatim: {test[0]!r}")
    pins = {re.search(r"torch==\S+", c).group(0) if "torch==" in c else None for c in (train[0], test[0])}
    ci_pins = set(re.findall(r"torch==\S+", ci_run))
    if len(pins) != 1 or pins != ci_pins:
        problems.append(f"torch pins differ: README {sorted(map(str, pins))}, .ci/run {sorted(ci_pins)}")
    if "omnilearn train" in ci_run and train[0] not in ci_lines:
        problems.append(f".ci/run runs a train command other than the README's: {train[0]!r}")
    return problems


# ---------------------------------------------------------------- the repository


def test_every_relative_link_and_image_resolves():
    assert broken_links(doc_files()) == []


def test_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_commands_are_what_ci_runs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert command_problems(readme, (REPO / ".ci" / "run").read_text(encoding="utf-8")) == []


def test_docs_index_lists_every_doc():
    listed = {target.partition("#")[0] for _, target in links(REPO / "docs" / "README.md")}
    missing = [p.name for p in doc_files()[1:] if p.name != "README.md" and p.name not in listed]
    assert missing == [], f"docs/README.md does not link {missing}"


# ---------------------------------------------------------------- the checks can fail


def test_slug_follows_github():
    assert slug("`omnilearn bench`: the four arms side by side, repeated (2026-11-23)") == \
        "omnilearn-bench-the-four-arms-side-by-side-repeated-2026-11-23"
    assert slug("What `omnilearn train` prints") == "what-omnilearn-train-prints"
    assert slug("Limits: a loaded host shrinks the emulated slowdown") == \
        "limits-a-loaded-host-shrinks-the-emulated-slowdown"
    assert slug("4 to 4,096 workers × 2") == "4-to-4096-workers--2"


def test_broken_links_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Same\n\n## Same\n", encoding="utf-8")
    (tmp_path / "README.md").write_text(
        "# R\n\n[ok](docs/a.md#same-1) [ok](#r) ![img](docs/missing.png) [bad](docs/a.md#nope)\n"
        "`[code](not/checked.md)`\n```\n[fenced](not/checked.md)\n```\n[web](https://example.com/x)\n",
        encoding="utf-8")
    problems = broken_links(doc_files(tmp_path), tmp_path)
    assert len(problems) == 2
    assert "docs/missing.png: no such file" in problems[0]
    assert "no heading with anchor #nope" in problems[1]


def test_command_mismatch_is_found():
    readme = ("## Two commands\n\n```bash\npip install torch==2.13.0 -e \".[experiments]\" && omnilearn train\n```\n"
              "```bash\npip install torch==2.13.0 -e \".[test]\" && python -m pytest -q\n```\n## Next\n")
    assert command_problems(readme, 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q\n') == []
    assert len(command_problems(readme, 'pip install torch==2.12.0 -e ".[test]" && python -m pytest\n')) == 2
    assert command_problems(readme.replace("omnilearn train", "omnilearn bench"), "") != []

