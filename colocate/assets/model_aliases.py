"""Names accepted for ``models.*`` besides folders, and resolving a model spec to a folder.

Owns: :func:`model_aliases` (``smollm2``, ``sentiment-rm``: built once from packaged
sources) and :func:`resolve_model`. Leaves out: how they are built (``colocate.assets.models``,
``colocate.assets.sentiment_rm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from colocate.errors import ConfigError


def model_aliases() -> dict[str, Callable[[], Path]]:
    """Names accepted for ``models.*`` that colocate builds from packaged sources."""
    from colocate.assets.models import prepare_smollm2  # here, not at the top: it brings torch (api imports this)

    def sentiment_rm() -> Path:
        from colocate.assets.sentiment_rm import prepare_sentiment_rm  # torch and transformers: only when asked for

        return prepare_sentiment_rm()

    return {"smollm2": prepare_smollm2, "sentiment-rm": sentiment_rm}


def resolve_model(spec: str, field: str) -> str:
    """A model folder for ``spec``: the packaged aliases are prepared (once) on demand."""
    aliases = model_aliases()
    if spec in aliases:
        return str(aliases[spec]())
    if not Path(spec).expanduser().is_dir():
        raise ConfigError(f"{field}: '{spec}' is neither a model folder nor one of {sorted(aliases)}")
    return str(Path(spec).expanduser())
