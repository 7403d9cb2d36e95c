"""Layers import downward only (docs/structure.md): engine/ and trainer/ use neither each other nor
colocate/ (nor bench/), trainer/ never imports SGLang, nothing at train time imports bench/,
and the modules of colocate/, engine/ and trainer/ form no import cycle. Lazy imports inside
functions count."""

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


# colocate/'s rooms, top to bottom: a module imports its own room's modules and those of
# lower rooms only (monitor and assets side by side: neither imports the other)
ROOMS = {"entry": 5, "tools": 4, "run": 3, "rollout": 2, "monitor": 1, "assets": 1, "core": 0}
ENTRY = {"cli", "api", "launch"}
LOWER_LAYERS = ("colocate.engine", "colocate.trainer", "colocate.bench")


def colocate_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """colocate/'s modules (``colocate.<room>.<module>``, or ``colocate.<module>`` at the
    top) -> the colocate/ modules each imports (every import, lazy ones included; ``from
    colocate.run import builder`` names the module ``colocate.run.builder``)."""
    graph = module_graph("colocate", root)
    return {name: {m for m in found if not m.startswith(LOWER_LAYERS)} for name, found in graph.items()}


def module_graph(folder: str, root: Path = ROOT) -> dict[str, set[str]]:
    """The modules of ``folder`` (as installed: ``colocate.<folder>...``, colocate/ itself
    ``colocate...``) -> those of the same folder each imports (every import, lazy and
    relative ones included; ``from . import ppo_math`` names ``colocate.trainer.ppo_math``)."""
    base = root / folder
    prefix = ("colocate",) if folder == "colocate" else ("colocate", folder)

    def name_of(path: Path) -> str:
        return ".".join((*prefix, *path.relative_to(base).with_suffix("").parts))

    paths = [p for p in base.rglob("*.py") if "cpu_kernel" not in p.parts]
    names = {name_of(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = name_of(path)
        imported = imports_of(path, root)
        found = {mod for _, mod in imported if mod in names}
        resolved = dict(imported)  # line -> module, for the names a from-import takes
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.lineno in resolved:
                module = resolved[node.lineno]
                found |= {f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in names}
        graph[name] = {m for m in found if m != name}
    return graph


def room_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 3:
        return parts[1]
    return "entry" if parts[-1] in ENTRY else "core"


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for src, targets in sorted(colocate_graph(root).items()):
        if src.endswith("__init__"):
            continue
        for dst in sorted(targets):
            a, b = room_of(src), room_of(dst)
            if a != b and not ROOMS[b] < ROOMS[a] and not dst.endswith("__init__"):
                bad.append(f"{src} ({a}) imports {dst} ({b})")
    return bad


def colocate_cycles() -> list[list[str]]:
    """Import cycles among colocate/'s own modules (every import, lazy ones included)."""
    return cycles_of(colocate_graph())


def cycles_of(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle of ``graph`` (module -> the modules it imports), each once."""
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
    (tmp_path / "engine" / "up.py").write_text("def f():\n    from colocate.run.session import Session\n")
    (tmp_path / "trainer" / "side.py").write_text("import sglang\nfrom colocate.engine import rollout\n")
    (tmp_path / "colocate" / "top.py").write_text("from colocate.rollout.sample import Sample\nimport bench.suite\n")
    found = violations(tmp_path)
    assert found == ["engine/up.py:2 imports colocate.run.session", "trainer/side.py:1 imports sglang",
                     "trainer/side.py:2 imports colocate.engine", "colocate/top.py:2 imports bench.suite"]


def test_colocate_modules_have_no_import_cycle():
    assert colocate_cycles() == []


def test_engine_and_trainer_modules_have_no_import_cycle():
    assert {folder: cycles_of(module_graph(folder)) for folder in ("engine", "trainer")} == \
        {"engine": [], "trainer": []}


def test_cycle_check_catches_a_relative_import_cycle(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "a.py").write_text("from .b import f\n")
    (tmp_path / "trainer" / "b.py").write_text("def g():\n    from . import a\n")
    (tmp_path / "trainer" / "c.py").write_text("from .b import g\n")
    assert cycles_of(module_graph("trainer", tmp_path)) == [
        ["colocate.trainer.a", "colocate.trainer.b", "colocate.trainer.a"]]


def test_colocate_rooms_import_downward_only():
    """entry (cli, api, launch) > tools > run > rollout > monitor | assets > core (config,
    errors, faults, modes): every colocate/ module is in a room the layer order names."""
    assert set(room_of(m) for m in colocate_graph()) <= set(ROOMS)
    assert upward_imports() == []


def test_room_check_catches_an_upward_import(tmp_path):
    for room in ("run", "rollout", "assets", "monitor"):
        (tmp_path / "colocate" / room).mkdir(parents=True)
    (tmp_path / "colocate" / "config.py").write_text("from colocate.rollout import scoring\n")
    (tmp_path / "colocate" / "rollout" / "scoring.py").write_text("def f():\n    from colocate.run.session import S\n")
    (tmp_path / "colocate" / "run" / "session.py").write_text("from colocate.rollout.scoring import f\n")
    (tmp_path / "colocate" / "assets" / "tasks.py").write_text("from colocate.monitor import metrics\n")
    (tmp_path / "colocate" / "monitor" / "metrics.py").write_text("from colocate import config\n")
    assert upward_imports(tmp_path) == [
        "colocate.assets.tasks (assets) imports colocate.monitor.metrics (monitor)",
        "colocate.config (core) imports colocate.rollout.scoring (rollout)",
        "colocate.rollout.scoring (rollout) imports colocate.run.session (run)"]


# the rollout room's bookkeeping: which samples exist, run and wait, in plain Python (tested without an engine)
PLAIN_ROLLOUT = ("colocate/rollout/data_source.py", "colocate/rollout/controllers.py", "colocate/rollout/auto_mode.py")
ENGINE_IO = ("sglang", "sgl_kernel", "colocate.engine.runtime", "colocate.engine.sglang_api", "colocate.rollout.schedule",
             "torch", "zmq")


def engine_io_imports(root: Path = ROOT) -> list[str]:
    """Imports of SGLang, the engine adapter or the schedule over it (and torch, ZeroMQ) in the
    rollout room's plain-Python modules (:data:`PLAIN_ROLLOUT`)."""
    return [f"{rel}:{line} imports {mod}" for rel in PLAIN_ROLLOUT if (root / rel).exists()
            for line, mod in imports_of(root / rel, root)
            if any(mod == name or mod.startswith(name + ".") for name in ENGINE_IO)]


def test_the_rollout_rooms_bookkeeping_is_plain_python():
    """The data source (with the step's plan and select), the overlap's controllers and auto's
    picker: no engine I/O (their tests need none), and the scheduler is no longer in engine/,
    which keeps SGLang's input and output only."""
    assert all((ROOT / rel).exists() for rel in PLAIN_ROLLOUT)
    assert engine_io_imports() == []
    assert not (ROOT / "engine" / "scheduler.py").exists() and not (ROOT / "colocate/run/prompt_stream.py").exists()


def test_plain_python_check_catches_engine_io(tmp_path):
    (tmp_path / "colocate" / "rollout").mkdir(parents=True)
    (tmp_path / "colocate" / "rollout" / "data_source.py").write_text(
        "from colocate.rollout.sample import Sample\nfrom colocate.engine.runtime import run_guarded\n")
    assert engine_io_imports(tmp_path) == ["colocate/rollout/data_source.py:2 imports colocate.engine.runtime"]


# a sample's life (the sample, its status, its generation and the step's schedule) lives in
# colocate's rollout room; engine/ is the SGLang adapter that room calls
SAMPLE_LIFE = {"Sample", "Status", "MultiTurn", "TurnReply", "stream_sample", "run_step", "LiveRequests", "Relay",
               "Timeline"}


def sample_life_in_engine(root: Path = ROOT) -> list[str]:
    """engine/'s top-level classes and functions that belong to a sample's life."""
    found = []
    for path in sorted((root / "engine").rglob("*.py")):
        if "cpu_kernel" in path.parts:
            continue
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in SAMPLE_LIFE:
                found.append(f"{path.relative_to(root)}:{node.lineno} defines {node.name}")
    return found


def test_engine_defines_no_sample_status_or_schedule():
    assert sample_life_in_engine() == []


def test_sample_life_check_catches_a_sample_in_engine(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "rollout.py").write_text("class Sample:\n    pass\n\nasync def run_step():\n    pass\n")
    assert sample_life_in_engine(tmp_path) == ["engine/rollout.py:1 defines Sample", "engine/rollout.py:4 defines run_step"]


def config_fields_named(root: Path = ROOT) -> list[str]:
    """Every ``section.field`` of colocate's config named anywhere in engine/'s text (code,
    strings, comments): the engine layer names its own settings, colocate names its fields
    (``colocate.errors.in_config_terms``)."""
    import re

    from colocate.config import Config

    fields = _fields_of(Config)
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(f) for f in sorted(fields)) + r")(?![\w])")
    found = []
    for path in sorted((root / "engine").rglob("*.py")):
        if "cpu_kernel" in path.parts:
            continue
        for number, text in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(root)}:{number} names {m}" for m in pattern.findall(text)]
    return found


def _fields_of(config_cls) -> set[str]:
    """``section.field`` of every field of a config's sections (read from a default instance)."""
    import dataclasses

    default = config_cls()
    return {f"{s.name}.{f.name}" for s in dataclasses.fields(default)
            for f in dataclasses.fields(getattr(default, s.name)) if dataclasses.is_dataclass(getattr(default, s.name))}


def test_no_engine_text_names_a_config_field():
    assert config_fields_named() == []


def test_config_field_check_catches_a_named_field(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "reward.py").write_text('fix = "lower rollout.max_new_tokens"\nx = self.rollout.max_new_tokens\n')
    assert config_fields_named(tmp_path) == ["engine/reward.py:1 names rollout.max_new_tokens"]


# where a sample's status may change: the step's schedule, and Sample's own derivation of it
STATUS_HOME = "colocate/rollout/schedule.py"


def status_changes(root: Path = ROOT) -> list[str]:
    """Assignments to an attribute ``status`` and calls of ``settle()`` anywhere in colocate/,
    engine/, trainer/ and bench/ but the schedule (``STATUS_HOME``), and in
    colocate/rollout/sample.py but ``Sample.__post_init__`` (a stored value back to its
    member) and ``Sample.settle`` (the rule the schedule applies)."""
    found = []
    for folder in ("colocate", "engine", "trainer", "bench"):
        for path in sorted((root / folder).rglob("*.py")):
            rel = str(path.relative_to(root))
            if rel == STATUS_HOME or "cpu_kernel" in path.parts:
                continue
            tree = ast.parse(path.read_text(), rel)
            allowed = set()
            if rel == "colocate/rollout/sample.py":
                for node in ast.walk(tree):
                    if isinstance(node, ast.FunctionDef) and node.name in ("__post_init__", "settle"):
                        allowed |= {id(n) for n in ast.walk(node)}
            for node in ast.walk(tree):
                if id(node) in allowed:
                    continue
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                if any(isinstance(t, ast.Attribute) and t.attr == "status" for t in targets):
                    found.append(f"{rel}:{node.lineno} sets a status")
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "settle":
                    found.append(f"{rel}:{node.lineno} settles a status")
    return found


def test_every_status_change_happens_in_the_schedule():
    """A sample's status changes in one module (issue 52): running, parked, finished or
    deferred as its stream starts, parks and ends (``colocate/rollout/schedule.py``)."""
    assert status_changes() == []


def test_status_check_catches_a_change_elsewhere(tmp_path):
    (tmp_path / "colocate" / "rollout").mkdir(parents=True)
    (tmp_path / "colocate" / "rollout" / "generation.py").write_text(
        "def go(s):\n    s.status = 1\n    s.settle()\n")
    (tmp_path / "colocate" / "rollout" / "schedule.py").write_text("def go(s):\n    s.status = 1\n    s.settle()\n")
    (tmp_path / "colocate" / "rollout" / "sample.py").write_text(
        "class Sample:\n    def settle(self):\n        self.status = 2\n\n    def other(self):\n        self.status = 3\n")
    assert status_changes(tmp_path) == ["colocate/rollout/generation.py:2 sets a status",
                                        "colocate/rollout/generation.py:3 settles a status",
                                        "colocate/rollout/sample.py:6 sets a status"]
