"""Layers import downward only (DESIGN.md): engine/ and trainer/ use neither each other nor
colocate/ (nor bench/), trainer/ never imports SGLang, nothing at train time imports bench/,
and colocate/'s own modules form no import cycle. Lazy imports inside functions count."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# folder -> top-level import names (absolute) it must not use
FORBIDDEN = {
    "engine": ("colocate", "trainer", "bench", "engine"),  # its own modules: relative imports
    "trainer": ("colocate", "engine", "bench", "sglang", "sgl_kernel", "trainer"),
    "colocate": ("engine", "trainer", "bench", "colocate.bench"),
}


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``; relative ones resolved
    against the module's own package as installed (``colocate.<folder>...``)."""
    rel = path.relative_to(root).with_suffix("")
    pkg = list(rel.parts[:-1])
    if pkg and pkg[0] != "colocate":
        pkg = ["colocate", *pkg]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module or ""))
    return out


def violations(root: Path = ROOT) -> list[str]:
    bad = []
    for folder, names in FORBIDDEN.items():
        for path in sorted((root / folder).rglob("*.py")):
            if "cpu_kernel" in path.parts:
                continue
            for line, mod in imports_of(path, root):
                if _allowed(folder, path.name, mod):
                    continue
                if any(mod == name or mod.startswith(name + ".") for name in names):
                    bad.append(f"{path.relative_to(root)}:{line} imports {mod}")
    return bad


def _allowed(folder: str, filename: str, mod: str) -> bool:
    own = f"colocate.{folder}"
    if folder in ("engine", "trainer") and (mod == own or mod.startswith(own + ".")):
        return True  # a relative import of its own layer, resolved
    # the CLI is the one entry point above everything: `colocate bench` runs the suite
    return folder == "colocate" and filename == "cli.py" and mod.startswith("colocate.bench")


def colocate_cycles() -> list[list[str]]:
    """Import cycles among colocate/'s own modules (every import, lazy ones included)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "colocate").glob("*.py"):
        name = f"colocate.{path.stem}"
        graph[name] = {m for _, m in imports_of(path) if m.startswith("colocate.") and m.count(".") == 1}
    for path in (ROOT / "colocate").glob("*.py"):  # `from colocate import api` names a module
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "colocate" and not node.level:
                graph[f"colocate.{path.stem}"] |= {f"colocate.{a.name}" for a in node.names}
    cycles, seen = [], set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cyc = stack[stack.index(node):]
            key = frozenset(cyc)
            if key not in seen:
                seen.add(key)
                cycles.append(cyc + [node])
            return
        for nxt in sorted(graph.get(node, ())):
            if nxt in graph:
                visit(nxt, stack + [node])

    for start in sorted(graph):
        visit(start, [])
    return cycles


def test_layers_import_downward_only():
    assert violations() == []


def test_layer_check_catches_an_upward_import(tmp_path):
    for folder in ("engine", "trainer", "colocate"):
        (tmp_path / folder).mkdir()
    (tmp_path / "engine" / "ok.py").write_text("from .errors import EngineError\nimport asyncio\n")
    (tmp_path / "engine" / "up.py").write_text("def f():\n    from colocate.session import Session\n")
    (tmp_path / "trainer" / "side.py").write_text("import sglang\nfrom colocate.engine import rollout\n")
    (tmp_path / "colocate" / "top.py").write_text("from colocate.engine.rollout import Sample\nimport bench.suite\n")
    found = violations(tmp_path)
    assert found == ["engine/up.py:2 imports colocate.session", "trainer/side.py:1 imports sglang",
                     "trainer/side.py:2 imports colocate.engine", "colocate/top.py:2 imports bench.suite"]


def test_colocate_modules_have_no_import_cycle():
    assert colocate_cycles() == []
