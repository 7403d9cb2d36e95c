"""docs/structure.md names every module of the tree exactly once, in the table of the room
(sub-package or layer folder) it lives in, and no module that is gone."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "structure.md"


def tree_modules() -> set[str]:
    out = set()
    for folder in ("colocate", "engine", "trainer", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "__init__.py" and "cpu_kernel" not in path.parts:
                out.add(str(path.relative_to(ROOT)))
    return out


def doc_rows() -> list[tuple[str, str]]:
    """(section title, module path) of every table row."""
    rows, title = [], ""
    for line in DOC.read_text().splitlines():
        if line.startswith("### "):
            title = line[4:]
        m = re.match(r"\| `([^`]+\.py)` \|", line)
        if m:
            rows.append((title, m.group(1)))
    return rows


def test_every_module_is_named_once_and_nothing_else():
    named = [path for _, path in doc_rows()]
    assert sorted(p for p in set(named) if named.count(p) > 1) == []
    assert sorted(tree_modules() - set(named)) == []  # a new module gets its row
    assert sorted(set(named) - tree_modules()) == []  # a moved or deleted one loses it


def test_each_row_sits_in_its_rooms_table():
    for title, path in doc_rows():
        parts = Path(path).parts
        room = "/".join(parts[:2]) + "/" if parts[0] == "colocate" and len(parts) == 3 else parts[0] + "/"
        if room == "colocate/":
            assert title.startswith(("Entry points", "Core")), (title, path)
        else:
            assert f"`{room}`" in title, (title, path)
