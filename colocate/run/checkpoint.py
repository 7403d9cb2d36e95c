"""Checkpoints: atomic, verifiable, world-size independent.

Owns: writing a checkpoint folder (trainer state, run state incl. KL controller, data
position, RNG and the deferred buffer) so that a crash mid-write never damages the last
good one: everything is written into a temporary sibling, a manifest with SHA-256
checksums (and a JSON ``meta``: the models the run trains) is added, and the folder is
renamed into place; a write the disk refuses (full, a quota, a file size limit) is one
line naming the newest checkpoint kept, its partial folder removed. Loading verifies the
manifest and reads tensors and plain data only (``torch.load(weights_only=True)``): a part
that pickles any other object is refused in one line, never executed.

Leaves out: what the states contain (the trainer and the loop produce them).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from colocate.errors import ColocateError

MANIFEST = "manifest.json"
PARTIAL = re.compile(r"\.tmp_step_\d+_(\d+)")  # a write in progress (or cut short): its writer's pid last


class CheckpointError(ColocateError):
    """A checkpoint is missing, incomplete or corrupt."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(root: Path, step: int, parts: dict[str, Any], keep: int = 2, meta: dict[str, Any] | None = None,
         before_commit: Callable[[], None] | None = None) -> Path:
    """Write ``parts`` (name → torch-serialisable object) as ``root/step_XXXXXXXX``; ``meta``
    (JSON: e.g. the models the run trains) goes into the manifest, readable without torch.
    ``before_commit``: called once the parts are written, before the manifest (a test hook:
    ``run.fault_at``'s ``checkpoint`` point)."""
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}_{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        files = {name + ".pt": _write_part(tmp / f"{name}.pt", obj) for name, obj in parts.items()}
        if before_commit is not None:
            before_commit()
        record = {"step": step, "files": files} | ({"meta": meta} if meta else {})
        (tmp / MANIFEST).write_text(json.dumps(record, indent=1))
    except OSError as exc:  # a full disk, a quota, a file size limit: one line, the earlier ones kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(_not_written(root, step, exc)) from None
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _prune(root, keep)
    return final


def _write_part(path: Path, obj: Any) -> str:
    """``obj`` saved at ``path`` -> its SHA-256. Through a Python file, so a failed write is
    the OSError it is: torch's own file writer reports ENOSPC as "unexpected pos …", and its
    zip writer, closing after a failed write, raises that RuntimeError over the OSError."""
    try:
        with path.open("wb") as f:
            torch.save(obj, f)
    except RuntimeError as exc:
        cause = exc.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause from None
    return _sha256(path)


def _not_written(root: Path, step: int, exc: OSError) -> str:
    """The one line of a checkpoint the disk refused: why, where, and the newest one kept."""
    why = exc.strerror or str(exc) or type(exc).__name__
    try:
        kept = f"the earlier checkpoints are intact, the newest is '{latest(root)}'"
    except CheckpointError:
        kept = "no earlier checkpoint exists"
    return (f"checkpoint of step {step} not written to '{root}': {why[:1].lower()}{why[1:]} (its partial files "
            f"removed); {kept}; free space there, then continue with --resume {root.parent}")


def partial_writes(root: Path) -> list[tuple[Path, int]]:
    """The temporary folders of checkpoint writes under ``root`` (in progress, or left by a
    writer that was killed) and each writer's pid."""
    found = [(path, PARTIAL.fullmatch(path.name)) for path in Path(root).glob(".tmp_step_*")]
    return [(path, int(m.group(1))) for path, m in found if m]


def _prune(root: Path, keep: int) -> None:
    for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def latest(path: Path, what: str = "--resume") -> Path:
    """``path`` itself if it is a checkpoint, else its newest valid ``step_*`` child
    (``what``: the option or command named in the error)."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    for cand in sorted(root.glob("step_*"), reverse=True):
        if (cand / MANIFEST).is_file():
            return cand
    raise CheckpointError(f"{what}: no checkpoint under '{path}' (expected step_*/manifest.json)")


def manifest(path: Path, what: str = "--resume") -> dict[str, Any]:
    """A checkpoint folder's manifest: ``step``, ``files`` (name -> SHA-256) and ``meta``
    (``{}`` where none was recorded); one that is not what :func:`save` writes (a
    hand-edited or damaged file) is one line naming the checkpoint before it."""
    path = Path(path)
    try:
        record = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{what}: checkpoint '{path}' has an unreadable {MANIFEST} ({exc}); "
                              f"{_earlier(path, what)}") from None
    files = record.get("files") if isinstance(record, dict) else None
    if not (isinstance(record, dict) and type(record.get("step")) is int and record["step"] >= 0
            and isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
            and isinstance(record.get("meta", {}), dict)):
        raise CheckpointError(f"{what}: checkpoint '{path}' has a damaged {MANIFEST} (not the step, files and "
                              f"meta colocate writes); {_earlier(path, what)}")
    return {"meta": {}} | record


def check_complete(path: Path, what: str = "--resume") -> dict[str, Any]:
    """The manifest (:func:`manifest`), every file it lists there (cheap: no checksum, which
    :func:`load` takes): a part deleted since is one line before anything starts."""
    record = manifest(path, what)
    missing = [name for name in record["files"] if not (Path(path) / name).is_file()]
    if missing:
        raise CheckpointError(f"{what}: checkpoint '{path}' is incomplete ({', '.join(missing)} missing); "
                              f"{_earlier(path, what)}")
    return record


def _earlier(path: Path, what: str) -> str:
    """How to go on from a damaged checkpoint: the newest one before it, if any."""
    path = Path(path)
    before = [c for c in sorted(path.parent.glob("step_*")) if c.name < path.name and (c / MANIFEST).is_file()]
    if not before:
        return "no earlier checkpoint is there"
    return f"the one before it: {what} {before[-1]}" if what == "--resume" else f"the one before it: {before[-1]}"


def load(path: Path, only: tuple[str, ...] | None = None, what: str = "--resume") -> tuple[int, dict[str, Any]]:
    """Verify and load a checkpoint folder (``only``: just these parts) -> (step, parts)."""
    path = Path(path)
    record = manifest(path, what)
    parts = {}
    for fname, digest in record["files"].items():
        if only is not None and fname[: -len(".pt")] not in only:
            continue
        fpath = path / fname
        if not fpath.is_file():
            raise CheckpointError(f"{what}: checkpoint '{path}' is incomplete ({fname} missing); "
                                  f"{_earlier(path, what)}")
        if _sha256(fpath) != digest:
            raise CheckpointError(f"{what}: checkpoint '{path}' is corrupt ({fname} fails its checksum); "
                                  f"{_earlier(path, what)}")
        parts[fname[: -len(".pt")]] = _load_data(fpath, path, fname, what)
    return record["step"], parts


def _load_data(fpath: Path, path: Path, fname: str, what: str) -> Any:
    """A part's tensors and plain data (dicts, lists, numbers, strings), never objects: a
    checkpoint from elsewhere whose pickle carries code (its checksums rewritten, as anyone
    who can write the folder can) is refused in one line, not run (torch's weights_only)."""
    try:
        return torch.load(fpath, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        holds = f" ({found.group(1)})" if found else ""
        raise CheckpointError(
            f"{what}: checkpoint '{path}' refused: {fname} holds an object that is not a tensor or plain "
            f"data{holds}, and loading it would run code it carries; use checkpoints written by colocate "
            "from a source you trust") from None
