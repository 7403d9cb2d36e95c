"""Start-up guards: checks that stop a run with one line before it trains on garbage.

Owns: the batch/world-size agreement, and that the user's script guards its entry point
(SGLang spawns its scheduler processes, which re-import the script, so it must be a
file). Pure functions over plain Python values (the guard check reads the script's source).

Leaves out: the weight-version agreement of every step's tokens
(``colocate.rollout.rollouts.check_weight_versions``), non-finite rewards, advantages,
losses and grads (the loop and ``trainer.optim`` skip those updates with a logged reason),
engine liveness (``engine.runtime``).
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

from colocate.errors import ConfigError


def check_world_size(batch_size: int, minibatches: int, world_size: int) -> None:
    """Each rank trains an equal share of every minibatch: B/minibatches rows split over ranks."""
    if batch_size < world_size:
        raise ConfigError(
            f"rollout.batch_size: {batch_size} is smaller than the world size {world_size}; "
            f"use at least {world_size} (one row per rank) or fewer processes")
    rows = batch_size // minibatches
    if rows % world_size:
        raise ConfigError(
            f"rollout.batch_size: {batch_size} / ppo.minibatches {minibatches} = {rows} rows per "
            f"minibatch do not split over {world_size} ranks; make rollout.batch_size a multiple "
            f"of {minibatches * world_size}")


def _is_main_guard(node: ast.stmt) -> bool:
    """``if __name__ == "__main__":`` (either operand order)."""
    if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
            and isinstance(node.test.ops[0], ast.Eq)):
        return False
    sides = [node.test.left, *node.test.comparators]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def check_main_file(main: ModuleType, entry: str = "colocate.api.train") -> None:
    """Exit with one line when the spawned engine processes could not re-import ``main``.

    ``multiprocessing.spawn`` re-runs the parent's ``__main__`` in every child: by module
    name when it has a ``__spec__`` (``python -m``), else from its ``__file__``, else not at
    all (``python -c``, a notebook, the REPL: those work). A script read from standard input
    (``python - < script.py``, a here-document) has ``__file__`` ``'<stdin>'``, no file, so
    every SGLang scheduler would die while starting with ``FileNotFoundError``."""
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is not None or path is None or Path(path).is_file():
        return
    raise SystemExit(
        f"error: {entry} cannot start SGLang's engines from a script read from {path} (standard input or a "
        "here-document): their spawned processes re-import the main script from its file, and there is none; "
        "save it to a file and run `python script.py` (with the `if __name__ == \"__main__\":` guard), "
        "or pass it as `python -c \"$(cat script.py)\"`")


def check_main_guard(main: ModuleType, entry: str = "colocate.api.train") -> None:
    """Exit with one line (SystemExit, no traceback) when the running script has no
    ``if __name__ == "__main__":`` guard.

    SGLang starts each engine's scheduler with the ``spawn`` method, which re-imports the
    script that started Python; without the guard that re-import runs the training code
    again inside the child, which dies while starting, and the user would see a traceback
    about a failed scheduler. The script cannot work as written, so this is an exit with the
fix, not an exception to handle. An interactive session or notebook (no source file) passes."""
    if main.__dict__.get("__name__") == "__mp_main__":  # we are the spawned re-import itself
        source_ok = False
    else:
        check_main_file(main, entry)
        path = getattr(main, "__file__", None)
        if not path or not str(path).endswith(".py") or not Path(path).is_file():
            return
        try:
            tree = ast.parse(Path(path).read_text(), str(path))
        except (SyntaxError, UnicodeDecodeError, OSError):
            return
        source_ok = any(_is_main_guard(node) for node in tree.body)
    if not source_ok:
        where = getattr(main, "__file__", "your script")
        raise SystemExit(
            f"error: {where} calls {entry} at import time: SGLang starts its engine processes with "
            "the spawn method, which re-imports the script; put the calls under "
            "`if __name__ == \"__main__\":`")
