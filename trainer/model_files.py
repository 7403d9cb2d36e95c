"""What a model folder says about itself, read without loading the model.

Owns: :func:`model_architecture` (``architectures[0]`` of ``config.json``), shared by the
trainer (critic from a causal LM) and colocate's model preparation.
Leaves out: loading weights (transformers), where folders come from (``colocate.assets.models``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import ModelSourceError


def model_architecture(path: str | os.PathLike[str]) -> str:
    """`architectures[0]` from `<path>/config.json`, e.g. "LlamaForCausalLM"."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        what = "has no config.json" if Path(path).is_dir() else "does not exist"
        raise ModelSourceError(
            f"model folder {path} {what}; build it with `colocate prepare` "
            "(or pass a folder written by save_pretrained)"
        )
    architectures = json.loads(config_path.read_text()).get("architectures") or []
    if not architectures:
        raise ModelSourceError(f"{config_path} names no architectures; re-save the model with save_pretrained")
    return str(architectures[0])
