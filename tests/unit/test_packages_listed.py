"""A non-editable install (``pip install .``, a wheel) ships every package of the source
tree: pyproject.toml lists packages by hand (engine/, trainer/, bench/ are mapped under
``colocate.``), and a package left out of that list is only missed outside an editable install
(``colocate.engine.sglang_models``, which SGLang's schedulers import at start, was)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _source_packages(dirs: dict[str, str]) -> set[str]:
    """Dotted names of every folder holding an ``__init__.py`` under the mapped roots."""
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_every_source_package_is_listed_for_the_wheel():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = {"colocate": "colocate", **tool["package-dir"]}
    data = {f"{pkg}.{Path(pattern).parent.as_posix().replace('/', '.')}"
            for pkg, patterns in tool["package-data"].items() for pattern in patterns if "/" in pattern}
    # a folder shipped as another package's data (engine/cpu_kernel/sgl_kernel: a stand-in put on
    # the import path by its own code) need not be a listed package
    wanted = {p for p in _source_packages(mapped) if not any(p == d or p.startswith(d + ".") for d in data)}
    listed = set(tool["packages"])
    assert not wanted - listed, f"packages missing from pyproject.toml's packages: {sorted(wanted - listed)}"
    assert not listed - _source_packages(mapped), "a listed package has no __init__.py"
