"""Resuming a run: its own config as the base, what may change mid-run, and whether a
checkpoint fits the configured models.

Owns: the run folder of ``--resume DIR`` (the folder itself or one of its
``checkpoints/step_*``); :func:`load_run_config` (the run's ``config.json``, then a YAML
file and ``--set`` overrides on top); :func:`check_resume` (before anything starts: a
checkpoint exists and is behind ``run.steps``, the keys in :data:`FIXED` (and :data:`LORA`
where there is an adapter) are the run's, no deferred buffer the configured mode would drop,
every other change named in one log line); :func:`check_checkpoint` (the checkpoint's actor
and critic tensors against the configured models). Every refusal is one line naming the key
and both values.

Leaves out: loading the checkpoint into a session (``colocate.run.session``), the config
format (``colocate.config``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from colocate.assets.identity import data_fingerprint, fingerprint
from colocate.run import checkpoint
from colocate.config import Config, from_dict, load_config, to_dict
from colocate.errors import ConfigError
from colocate.trainer.estimators import CRITIC_FREE

# What a checkpoint depends on, so it cannot change mid-run. Everything else may (each change is logged).
FIXED = (
    "models.actor", "models.critic", "models.dtype",  # the trained weights and optimizer state
    "models.reward",  # the rewards the critic has learnt to predict
    "data.source", "data.seed", "data.eval_prompts",  # the data position counts into this shuffled training split
    "data.split", "data.prompt_key",  # ... of these rows and prompts
    "data.filter_overlong_prompts",  # ... all of them, or those that fit (FILTERED)
    "ppo.kl_kind",  # the saved KL controller state is of one kind
    "ppo.advantage",  # a critic is trained (gae) or none is saved (critic-free)
    "rollout.group_size",  # the data position counts groups; deferred groups have this size
)
# ... and in a run with a LoRA adapter (or a resume adding one), which weights carry one and
# its shapes: the checkpoint holds those tensors and their optimizer state (lora.alpha may change)
LORA = ("lora.rank", "lora.target_modules", "lora.actor", "lora.critic")
# ... and in a run that leaves out the prompts longer than data.max_prompt_tokens, what
# decides which are left out: a prompt's tokens (the chat template, an environment's instruction)
FILTERED = ("data.max_prompt_tokens", "data.apply_chat_template", "rollout.env")
_PATHS = ("models.actor", "models.reward", "models.critic", "data.source", "run.out_dir")  # equal: one folder or file
_FIX = "keep the run's value or start a new run (another run.out_dir)"

Shapes = Mapping[str, tuple[int, ...]]


def run_folder(resume: str | Path) -> Path:
    """The run folder of ``resume``: a run folder, or the run of its ``checkpoints`` or ``checkpoints/step_*``."""
    path = Path(resume).expanduser()
    if not path.is_dir():
        raise ConfigError(f"--resume: '{resume}' is not a folder; give a run folder (its run.out_dir) "
                          "or one of its checkpoints/step_*")
    if (path / checkpoint.MANIFEST).is_file() or path.name.startswith("step_"):
        path = path.parent
    if path.name == "checkpoints" and not (path / "config.json").is_file():
        path = path.parent
    return path


def saved_config(run_dir: Path) -> Config | None:
    """The config a run started with (its ``config.json``); None when it has none."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        return from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError:
        raise ConfigError(f"--resume: '{path}' is not valid JSON; restore it from the run's settings") from None
    except ConfigError as exc:
        raise ConfigError(f"--resume: the run's '{path}': {exc}") from None


def load_run_config(resume: str | Path, path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The config that continues the run at ``resume``: its ``config.json`` with ``run.out_dir``
    the run folder, then the YAML file ``path``, then ``overrides``; validated."""
    run_dir = run_folder(resume)
    checkpoint.latest(Path(resume))  # one line when there is none
    saved = saved_config(run_dir)
    if saved is None:
        raise ConfigError(f"--resume: no config.json in '{run_dir}' (a run writes it when it starts); "
                          "resume it from Python: api.train(cfg, resume=...) with the run's settings")
    base = dataclasses.replace(saved, run=dataclasses.replace(saved.run, out_dir=str(run_dir)))
    cfg = load_config(path, list(overrides), base=base)
    _refuse_fixed(_fixed_changes(saved, cfg, checkpoint.manifest(checkpoint.latest(Path(resume)))))
    return cfg


def _fixed_changes(saved: Config | None, cfg: Config, record: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The :data:`FIXED` keys ``cfg`` changes: the models against what the checkpoint's
    manifest (``record``) says it was trained from, which a ``config.json`` edited since
    cannot hide (nor fake: a config.json set back to them resumes), the rest against the
    run's ``config.json`` (``saved``; None: none there)."""
    recorded = {f"models.{key}": value for key, value in record["meta"].get("models", {}).items()
                if f"models.{key}" in FIXED and hasattr(cfg.models, key)}
    moved_to = {key for key, _, _ in moved(record, cfg)}
    trained_from = [(key, value, getattr(cfg.models, key.split(".")[1])) for key, value in recorded.items()
                    if not _same(key, value, getattr(cfg.models, key.split(".")[1])) and key not in moved_to]
    changes = config_changes(saved, cfg) if saved is not None else []
    fixed = FIXED + (_adapter_keys(saved, cfg) + (FILTERED if saved.data.filter_overlong_prompts else ())
                     if saved is not None else ())
    return [c for c in changes if c[0] in fixed and c[0] not in recorded and c[0] not in moved_to] + trained_from


# The folders and files a run reads whose place may change between machines: each checkpoint
# records their fingerprints (:func:`fingerprints`), and a resume takes a new place holding the
# same files (:func:`moved`).
FINGERPRINTED: dict[str, Callable[[str], str | None]] = {
    "models.actor": fingerprint, "models.reward": fingerprint, "models.critic": fingerprint,
    "data.source": data_fingerprint}


def _value(cfg: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def fingerprints(cfg: Config) -> dict[str, dict[str, str]]:
    """``{key: {"path", "sha256"}}`` of the :data:`FINGERPRINTED` keys that name a folder or file
    (``colocate.assets.identity``), for a checkpoint's manifest."""
    out = {}
    for key, of in FINGERPRINTED.items():
        value = _value(cfg, key)
        sha = of(value) if value else None
        if sha:
            out[key] = {"path": value, "sha256": sha}
    return out


def moved(record: Mapping[str, Any], cfg: Config) -> list[tuple[str, str, str]]:
    """``(key, recorded path, configured path)`` of each :data:`FINGERPRINTED` key ``cfg`` names
    by another path than the checkpoint's manifest (``record``) but whose files are the ones
    it was trained from: the folder or file moved (another machine, another mount), its
    content did not."""
    out = []
    for key, was in record["meta"].get("fingerprints", {}).items():
        now = _value(cfg, key) if key in FINGERPRINTED else None
        if now and not _same(key, was["path"], now) and FINGERPRINTED[key](now) == was["sha256"]:
            out.append((key, was["path"], now))
    return out


def _gone(record: Mapping[str, Any], cfg: Config) -> str | None:
    """The refusal of a resume whose configured folder or file is the run's, no longer there
    (a checkpoint that recorded its files, so the place may be given anew)."""
    for key, was in record["meta"].get("fingerprints", {}).items():
        gone = not Path(was["path"]).expanduser().exists()
        if key in FINGERPRINTED and gone and _same(key, was["path"], _value(cfg, key)):
            return (f"--resume: the run's {key} '{was['path']}' is not there anymore; if it moved, pass its new "
                    f"place: --set {key}=PATH (a resume takes it when its files are the ones the checkpoint was "
                    "trained from)")
    return None


def _adapter_keys(saved: Config, cfg: Config) -> tuple[str, ...]:
    """The :data:`LORA` keys a resume keeps: none when neither the run nor ``cfg`` has an
    adapter; ``lora.critic`` only where a critic is trained (not under a critic-free estimator)."""
    if not (saved.lora.rank or cfg.lora.rank):
        return ()
    return tuple(k for k in LORA if k != "lora.critic" or saved.ppo.advantage not in CRITIC_FREE)


def config_changes(saved: Config, cfg: Config) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` of every field of ``cfg`` that differs from ``saved``."""
    old, new = _flat(to_dict(saved)), _flat(to_dict(cfg))
    return [(key, old.get(key), value) for key, value in new.items() if not _same(key, old.get(key), value)]


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, Mapping):
            out |= _flat(value, f"{prefix}{name}.")
        else:
            out[f"{prefix}{name}"] = value
    return out


def _same(key: str, a: Any, b: Any) -> bool:
    if a == b:
        return True
    if key in _PATHS and isinstance(a, str) and isinstance(b, str):
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return False


def check_resume(cfg: Config, resume: str | Path, log: Callable[[str], None]) -> None:
    """Before anything starts: ``resume`` holds a checkpoint behind ``run.steps`` and ``cfg``
    keeps the run's :data:`FIXED` keys; every other change vs its ``config.json`` is logged in one line."""
    run_dir = run_folder(resume)
    where = checkpoint.latest(Path(resume))
    record = checkpoint.check_complete(where)  # a part deleted since: one line now, not after the engines start
    step = record["step"]
    if cfg.run.steps <= step:
        raise ConfigError(f"run.steps is {cfg.run.steps} and the checkpoint '{where}' is at step {step}: "
                          f"nothing to run; raise it (run.steps is the total), e.g. --set run.steps={step + 10}")
    saved = saved_config(run_dir)
    gone = _gone(record, cfg)
    if gone:
        raise ConfigError(gone)
    _refuse_fixed(_fixed_changes(saved, cfg, record))
    _refuse_dropping_deferred(cfg, where)
    relocated = moved(record, cfg)
    for key, a, b in relocated:
        log(f"resume: {key} moved: '{a}' -> '{b}' (the same files: they match the checkpoint's record)")
    if saved is None:
        log(f"resume: no config.json in {run_dir}; the config is not compared with the run's")
        return
    changes = [c for c in config_changes(saved, cfg) if c[0] not in {key for key, _, _ in relocated}]
    if changes:
        log("resume: changed " + ", ".join(f"{key} {a} -> {b}" for key, a, b in changes))


def _refuse_dropping_deferred(cfg: Config, where: Path) -> None:
    """``overlap.mode=sequential`` would drop the deferred samples the checkpoint ``where``
    carries (its ``data`` part, read alone): one line."""
    if cfg.overlap.mode != "sequential":
        return
    _, parts = checkpoint.load(where, only=("data",))
    deferred = [d for state in parts.get("data", {}).get("ranks", []) for d in state["deferred"]]
    if deferred:
        raise ConfigError(f"overlap.mode=sequential would drop the {len(deferred)} deferred samples of "
                          f"checkpoint '{where}'; resume with overlap.mode=inter, intra or oppo")


def _refuse_fixed(changes: Sequence[tuple[str, Any, Any]]) -> None:
    """One line naming each key of ``changes`` (the fixed ones a config changes) and both its values."""
    fixed = [f"{key} cannot change when resuming (the run has {a!r}, this config {b!r}"
             f"{'; with data.filter_overlong_prompts it decides which prompts the run trains on' if key in FILTERED else ''})"
             for key, a, b in changes]
    if fixed:
        raise ConfigError("; ".join(fixed) + f"; {_FIX}")


def shapes(state: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape of a model state dict (full tensors or FSDP's DTensors: global shapes)."""
    return {name: tuple(t.shape) for name, t in state.items() if hasattr(t, "shape")}


def check_checkpoint(where: Path, parts: Mapping[str, Any], live: Mapping[str, Shapes], cfg: Config) -> None:
    """The checkpoint's actor and critic fit the configured models (``live``: the trainer's
    tensor shapes by part); else one line."""
    recorded = checkpoint.manifest(where)["meta"].get("models", {})  # {} in older checkpoints
    configured = dataclasses.asdict(cfg.models)
    for part in live:
        saved = shapes(parts["trainer"].get(part, {}).get("model", {}))
        diff = _first_difference(saved, live[part]) if saved else None
        if diff is None:
            continue
        key = "models.critic" if part == "critic" and cfg.models.critic else "models.actor"
        held = f"the {part} '{_spec(part, recorded)}'" if _spec(part, recorded) else f"an unnamed {part}"
        raise checkpoint.CheckpointError(
            f"--resume: checkpoint '{where}' holds {held} ({_count(saved):,} parameters) but {key} is "
            f"'{_spec(part, configured)}' ({_count(live[part]):,} parameters; {diff}); "
            f"resume with the run's {key} or start a new run")


def _spec(part: str, models: Mapping[str, Any]) -> str | None:
    """The model spec a part was built from (the critic: models.critic, else the actor's)."""
    return (models.get("critic") or models.get("actor")) if part == "critic" else models.get("actor")


def _first_difference(saved: Shapes, live: Shapes) -> str | None:
    for name, shape in saved.items():
        if name not in live:
            return f"{name} is in the checkpoint, not in the configured model"
        if shape != live[name]:
            return f"{name} is {list(shape)} in the checkpoint, {list(live[name])} configured"
    extra = [name for name in live if name not in saved]
    return f"{extra[0]} is in the configured model, not in the checkpoint" if extra else None


def _count(shape_map: Shapes) -> int:
    return sum(math.prod(shape) for shape in shape_map.values())
