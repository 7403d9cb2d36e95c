"""The trained actor of a checkpoint as a Hugging Face folder.

Owns: finding a run's checkpoint and its base actor model, and writing the checkpoint's
actor weights over that model as ``config.json`` + ``model.safetensors`` + tokenizer
files, which ``transformers`` and SGLang load with ``from_pretrained`` / ``model_path``.
Written into a temporary sibling and renamed into place, like the checkpoints.

Leaves out: the checkpoint format (``colocate.checkpoint``), sampling from the folder
(``colocate.sample``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from colocate import checkpoint
from colocate.errors import ConfigError


def run_dir_of(ckpt: Path) -> Path:
    """The run folder of a ``<run>/checkpoints/step_*`` checkpoint (or of a checkpoint
    copied elsewhere: its parent)."""
    parent = ckpt.parent
    return parent.parent if parent.name == "checkpoints" else parent


def base_actor(run_dir: Path) -> str:
    """``models.actor`` of the run, from the ``config.json`` the run wrote (an alias is
    prepared on demand, as in training)."""
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"export: no config.json in run folder '{run_dir}' (it names the base actor model); "
                          "pass the run folder that `colocate train` wrote")
    from colocate.model_aliases import resolve_model

    return resolve_model(json.loads(path.read_text())["models"]["actor"], f"models.actor in {path}")


def default_out(ckpt: Path) -> Path:
    """Where an export of ``ckpt`` goes unless told: ``<run>/export/actor_step_XXXXXXXX``."""
    return run_dir_of(ckpt) / "export" / f"actor_{ckpt.name}"


def export_actor(run_or_checkpoint: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 *, reuse: bool = True) -> Path:
    """Write the newest (or the given) checkpoint's actor as an HF folder -> its path.

    ``run_or_checkpoint``: a run folder or one ``step_*`` checkpoint. ``out``: default
    `default_out`. With ``reuse`` a complete export there, newer than the checkpoint, is
    returned as is.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoint.latest(Path(run_or_checkpoint), what="export")
    target = Path(out) if out is not None else default_out(ckpt)
    if reuse and _fresh(target, ckpt):
        return target
    base = base_actor(run_dir_of(ckpt))
    _, parts = checkpoint.load(ckpt, only=("trainer",), what="export")
    state = parts["trainer"]["actor"]["model"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    own = model.state_dict()
    missing = sorted(set(own) - set(state) - _tied_names(model))
    unexpected = sorted(set(state) - set(own))
    resized = sorted(k for k in set(state) & set(own) if state[k].shape != own[k].shape)
    if missing or unexpected or resized:
        raise ConfigError(f"export: checkpoint '{ckpt}' does not fit the base actor '{base}' (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]}, other shape {resized[:3]}); "
                          "was models.actor changed after training?")
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    tmp = target.parent / f".tmp_{target.name}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    if target.exists():
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, target)
    return target


def _fresh(target: Path, ckpt: Path) -> bool:
    """A complete export written after the checkpoint (a run restarted into the same folder
    rewrites its checkpoints; its old exports are then stale)."""
    weights = target / "model.safetensors"
    return ((target / "config.json").is_file() and weights.is_file()
            and weights.stat().st_mtime_ns >= (ckpt / checkpoint.MANIFEST).stat().st_mtime_ns)


def _tied_names(model) -> set[str]:  # noqa: ANN001 - a transformers PreTrainedModel
    """Parameter names that share storage with another (tied embeddings): the checkpoint
    keeps one of each pair."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.data_ptr() in seen:
            tied |= {name, seen[p.data_ptr()]}
        seen.setdefault(p.data_ptr(), name)
    return tied
