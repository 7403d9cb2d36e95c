"""The trained actor of a checkpoint as a Hugging Face folder (and a LoRA run's adapter).

Owns: finding a run's checkpoint, its base actor model and its ``lora`` section, and
writing the checkpoint's actor over that model as ``config.json`` + ``model.safetensors``
+ tokenizer files, which ``transformers`` and SGLang load with ``from_pretrained`` /
``model_path``. A LoRA checkpoint (the actor's adapters only) is loaded into the base
wrapped as in training and merged into it; on request its adapters are also written as
a PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained(base, folder)`` loads. Each folder is written into a
temporary sibling and renamed into place, like the checkpoints. One line each for the
actor loaded and the folder written (to the caller's ``log``); a run's ``engines.log_level``
(`log_level_of`), for the CLI to decide whether the libraries' own bars show.

Leaves out: the checkpoint format (``colocate.run.checkpoint``), the LoRA wrapper
(``colocate.trainer.lora``), sampling from the folder (``colocate.tools.sample``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from colocate.run import checkpoint
from colocate.config import EnginesConfig, LoraConfig
from colocate.errors import ConfigError, unwritable
from colocate.monitor.quiet import loaded
from colocate.assets.model_aliases import resolve_model
from colocate.trainer.lora import PEFT_PREFIX, add_lora

MODEL_FILES = ("config.json", "model.safetensors")  # a complete HF folder: its config and weights
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # a complete PEFT adapter folder


def run_dir_of(ckpt: Path) -> Path:
    """The run folder of a ``<run>/checkpoints/step_*`` checkpoint (or of a checkpoint
    copied elsewhere: its parent)."""
    parent = ckpt.parent
    return parent.parent if parent.name == "checkpoints" else parent


def _run_config(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"export: no config.json in run folder '{run_dir}' (it names the base actor model); "
                          "pass the run folder that `colocate train` wrote")
    return json.loads(path.read_text())


def base_actor(run_dir: Path) -> str:
    """``models.actor`` of the run, from the ``config.json`` the run wrote (an alias is
    prepared on demand, as in training)."""
    return resolve_model(_run_config(run_dir)["models"]["actor"], f"models.actor in {run_dir / 'config.json'}")


def lora_section(run_dir: Path) -> LoraConfig:
    """The run's ``lora`` section from its ``config.json`` (off for a run without one)."""
    section = _run_config(run_dir).get("lora") or {}
    known = {f.name for f in dataclasses.fields(LoraConfig)}
    return LoraConfig(**{k: v for k, v in section.items() if k in known})


def default_out(ckpt: Path) -> Path:
    """Where an export of ``ckpt`` goes unless told: ``<run>/export/actor_step_XXXXXXXX``."""
    return run_dir_of(ckpt) / "export" / f"actor_{ckpt.name}"


def export_actor(run_or_checkpoint: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                 *, adapter: str | os.PathLike[str] | None = None, reuse: bool = True,
                 log: Callable[[str], None] = lambda message: None, what: str = "export") -> Path:
    """Write the newest (or the given) checkpoint's actor as an HF folder -> its path.

    ``run_or_checkpoint``: a run folder or one ``step_*`` checkpoint. ``out``: default
    `default_out`. A LoRA run's actor is written merged (base + adapters). ``adapter``: a
    LoRA run's adapters also go there as a PEFT adapter folder. With ``reuse`` complete
    folders there, newer than the checkpoint, are returned as they are. ``log`` gets a line
    for the actor loaded and one for the folder written (what and how long). ``what``: the
    command named in a one-line error (``generate`` exports a run before it samples).
    """
    from transformers import AutoTokenizer  # here, not at the top: this module is imported at the CLI's start

    ckpt = checkpoint.latest(Path(run_or_checkpoint), what=what)
    target = Path(out) if out is not None else default_out(ckpt)
    adapter_dir = Path(adapter) if adapter is not None else None
    run_dir = run_dir_of(ckpt)
    lora = lora_section(run_dir)
    if adapter_dir is not None:
        _check_adapter_request(adapter_dir, target, lora, run_dir)
    for folder, option in ((target, "--out"), (adapter_dir, "--adapter")):
        if folder is not None:
            check_replaceable(folder, option, read=(run_dir, ckpt, Path(base_actor(run_dir))), own=default_out(ckpt))
    wanted = [(target, MODEL_FILES)] + ([(adapter_dir, ADAPTER_FILES)] if adapter_dir is not None else [])
    if reuse and all(_fresh(folder, ckpt, files) for folder, files in wanted):
        return target
    base = base_actor(run_dir)
    started = time.perf_counter()
    _, parts = checkpoint.load(ckpt, only=("trainer",), what="export")
    state = parts["trainer"]["actor"]["model"]
    if lora.on_actor:
        wrapped = _lora_actor(base, state, lora, ckpt)
        if adapter_dir is not None:
            _write(adapter_dir, _marked(wrapped.save_pretrained, ckpt))
        model = wrapped.merge_and_unload()
    else:
        model = _full_actor(base, state, ckpt)
    log(loaded(f"actor of {ckpt.name}", sum(p.numel() for p in model.parameters()), time.perf_counter() - started))
    started = time.perf_counter()
    _write(target, _marked(lambda tmp: (model.save_pretrained(tmp), AutoTokenizer.from_pretrained(base).save_pretrained(tmp)),
                           ckpt))
    mb = sum(f.stat().st_size for f in target.glob("*.safetensors")) / 2**20
    log(f"actor written: {mb:.3g} MB in {time.perf_counter() - started:.1f} s")
    return target


def log_level_of(path: str | os.PathLike[str]) -> str:
    """``engines.log_level`` of the run whose folder or checkpoint ``path`` is (its
    ``config.json``); the default for anything else (a model folder, an alias), never an error."""
    p = Path(path).expanduser()
    for folder in (p, run_dir_of(p)):
        try:
            level = json.loads((folder / "config.json").read_text())["engines"]["log_level"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(level, str):
            return level
    return EnginesConfig().log_level


def _check_adapter_request(adapter_dir: Path, target: Path, lora: LoraConfig, run_dir: Path) -> None:
    if not lora.on_actor:
        raise ConfigError(f"export: an adapter folder was asked for, but the config.json of run '{run_dir}' trains "
                          f"its actor in full (lora.rank={lora.rank}, lora.actor={lora.actor}); only a LoRA run "
                          "(lora.rank > 0, lora.actor true) has adapters")
    if adapter_dir.resolve().is_relative_to(target.resolve()):
        raise ConfigError(f"export: the adapter folder '{adapter_dir}' must lie outside the exported model "
                          f"folder '{target}' (that folder is replaced as a whole)")


def _full_actor(base: str, state: dict[str, Any], ckpt: Path):  # noqa: ANN202 - a transformers model
    """The base actor with every tensor of a full fine-tuning checkpoint."""
    from transformers import AutoModelForCausalLM  # here, not at the top: this module is imported at the CLI's start

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    problem = _mismatch(state, model.state_dict(), optional=_tied_names(model))
    if problem:
        changed = ("lora.rank or lora.actor" if any(k.startswith(PEFT_PREFIX) for k in state)  # a LoRA checkpoint
                   else "models.actor")
        raise ConfigError(f"export: checkpoint '{ckpt}' does not fit the base actor '{base}' ({problem}); "
                          f"was {changed} changed after training?")
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return model


def _lora_actor(base: str, state: dict[str, Any], lora: LoraConfig, ckpt: Path):  # noqa: ANN202 - a PeftModel
    """The base actor wrapped in LoRA as in training, with the checkpoint's adapters (its
    trainable tensors, PEFT-named) loaded."""
    from transformers import AutoModelForCausalLM  # here, not at the top: this module is imported at the CLI's start

    model = add_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), lora)
    problem = _mismatch(state, {n: p for n, p in model.named_parameters() if p.requires_grad})
    if problem:
        ranks = sorted({t.shape[0] for k, t in state.items() if ".lora_A." in k})
        raise ConfigError(f"export: checkpoint '{ckpt}' does not fit the LoRA adapters its run's config.json builds "
                          f"(lora.rank={lora.rank}, lora.target_modules={lora.target_modules!r}; the checkpoint's "
                          f"rank {ranks}: {problem}); was lora.* or models.actor changed after training?")
    model.load_state_dict(state, strict=False)
    return model.eval()


def _mismatch(state: dict[str, Any], own: dict[str, Any], optional: set[str] = frozenset()) -> str:
    """What keeps ``state`` from loading into tensors ``own`` ('' when it fits); the names in
    ``optional`` may be left out of ``state``."""
    missing = sorted(set(own) - set(state) - optional)
    unexpected = sorted(set(state) - set(own))
    resized = sorted(k for k in set(state) & set(own) if state[k].shape != own[k].shape)
    if not (missing or unexpected or resized):
        return ""
    return f"missing {missing[:3]}, unexpected {unexpected[:3]}, other shape {resized[:3]}"


MARKER = "colocate_export.json"  # in every folder an export writes: which run and checkpoint it holds


def check_replaceable(folder: Path, option: str, read: Sequence[Path] = (), own: Path | None = None) -> None:
    """An export replaces ``folder`` (``option`` names it): one line unless it is new, empty,
    an earlier export (its :data:`MARKER`) or ``own`` (the run's default export folder), and
    unless it is not one of the folders the export ``read``s (the run, its checkpoint, the
    base model) nor holds one. Before, an ``--out`` naming the run folder replaced it,
    checkpoints and all, with exit 0; a folder of another model would have gone the same way."""
    where = folder.expanduser().resolve()
    for source in read:
        if where == source.expanduser().resolve() or source.expanduser().resolve().is_relative_to(where):
            raise ConfigError(f"export: {option} '{folder}' is or holds '{source}', which the export reads; an export "
                              "replaces the folder it writes: give a new folder")
    if not where.is_dir() or (where / MARKER).is_file() or (own is not None and where == own.resolve()):
        return
    held = sorted(p.name + ("/" if p.is_dir() else "") for p in where.iterdir())
    if held:
        raise ConfigError(f"export: {option} '{folder}' holds {', '.join(held[:3])}{', …' if len(held) > 3 else ''}, "
                          "which colocate did not export; an export replaces the folder it writes: give a new or "
                          "empty folder, or an earlier export")


def _marked(save: Callable[[Path], Any], ckpt: Path) -> Callable[[Path], None]:
    """``save``, then the :data:`MARKER` of an export of ``ckpt``."""
    def write(folder: Path) -> None:
        save(folder)
        (folder / MARKER).write_text(json.dumps({"run": str(run_dir_of(ckpt)), "checkpoint": ckpt.name}) + "\n")

    return write


def _write(folder: Path, save: Callable[[Path], Any]) -> None:
    """``save`` into a temporary sibling of ``folder``, then renamed into its place (a folder
    :func:`check_replaceable` let through); a folder that cannot be written is one line."""
    tmp = folder.parent / f".tmp_{folder.name}_{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        folder.parent.mkdir(parents=True, exist_ok=True)
        save(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"export: cannot write '{folder}' ({unwritable(folder, exc)}); give a folder you can "
                          "write") from None


def _fresh(folder: Path, ckpt: Path, files: tuple[str, str]) -> bool:
    """A complete export (its config and weights ``files``) written after the checkpoint (a
    run restarted into the same folder rewrites its checkpoints; its old exports are then stale)."""
    config, weights = (folder / f for f in files)
    return (config.is_file() and weights.is_file()
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
