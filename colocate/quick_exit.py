"""A process's quick exit: the interpreter's last collection skipped.

Owns: :func:`skip_last_collection`. At exit the interpreter's module teardown runs a full
collection over every object torch, SGLang and transformers made (~2 s of a 2-core CPU per
process, measured after `colocate train`'s summary line: 2.1 -> 0.3 s) although nothing
left needs one: engines are down, files closed, checkpoints written by then. Leaves out:
what runs before the exit (each entry point's own hooks, which still all run).
"""

from __future__ import annotations

import atexit
import gc


def skip_last_collection() -> None:
    """Freeze every tracked object at exit, after the exit hooks registered later (they run
    first); a second call moves the freeze after the hooks registered meanwhile."""
    atexit.unregister(gc.freeze)
    atexit.register(gc.freeze)
