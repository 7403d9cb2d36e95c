"""A user's object named in the config: ``package.module:attr`` or ``path/file.py:attr``.

Owns: importing the module (an importable module, or a ``.py`` file by its path, relative
to the working directory), walking a dotted ``attr`` into it, and the one-line
:class:`ConfigError` on the config field that named it (the form, a module that is not
found or raises on import, a missing file, a missing attribute). ``rollout.env`` and
``reward.fns`` load through here.

Leaves out: what the object must be and what is done with it (the callers check:
``colocate.rollout.environments`` an environment, ``colocate.rollout.named_rewards`` a
reward function).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from colocate.errors import ConfigError, first_line

FORMS = "package.module:attr or path/file.py:attr"


def load_attribute(spec: str, field: str, what: str) -> Any:
    """The object ``spec`` names (``package.module:attr`` or ``path/file.py:attr``; a dotted
    ``attr`` reaches into the module); ``what`` ends a missing attribute's message (what to
    name instead). Every failure is one line starting with ``field``."""
    name = spec.strip() if isinstance(spec, str) else ""
    source, _, attr = name.rpartition(":")
    source, attr = source.strip(), attr.strip()
    if not source or not attr:
        raise ConfigError(f"{field}: {name!r} is not {FORMS}")
    module = _module(source, field, name)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(f"{field}={name}: module {source!r} has no attribute {attr!r}; {what}") from None
    return obj


def _module(source: str, field: str, name: str) -> ModuleType:
    """The module ``source`` names: imported by name, or executed from a ``.py`` file."""
    try:
        if not source.endswith(".py"):
            return importlib.import_module(source)
        return _file_module(Path(source), field, name)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
        raise ConfigError(
            f"{field}={name}: cannot import module {source!r} ({first_line(exc)}); "
            "check the module path and that it imports on its own"
        ) from None


def _file_module(path: Path, field: str, name: str) -> ModuleType:
    """``path`` executed as a module, once per process (registered under a name made from
    its absolute path, so dataclasses and pickling inside it find their module)."""
    if not path.is_file():
        raise ConfigError(f"{field}={name}: no file {str(path)!r} (a path is relative to the working directory)")
    resolved = path.resolve()
    key = "_colocate_file_" + re.sub(r"\W", "_", str(resolved))
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[key]
        raise
    return module
