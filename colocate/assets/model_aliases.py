"""Names accepted for ``models.*`` besides folders, and resolving a model spec to a folder.

Owns: :func:`model_aliases` (``smollm2``, ``sentiment-rm``: built once from packaged
sources) and :func:`resolve_model`. Leaves out: how they are built (``colocate.assets.models``,
``colocate.assets.sentiment_rm``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from colocate.errors import ConfigError


def model_aliases() -> dict[str, Callable[..., Path | None]]:
    """Names accepted for ``models.*`` that colocate builds from packaged sources; each is
    called with no argument (build it once, then reuse it) or ``build=False`` (None where
    building would take minutes and it is not built yet: the sentiment RM; SmolLM2's
    conversion takes seconds and is always done)."""
    from colocate.assets.models import prepare_smollm2  # here, not at the top: it brings torch (api imports this)

    def smollm2(build: bool = True) -> Path:
        return prepare_smollm2()

    def sentiment_rm(build: bool = True) -> Path | None:
        from colocate.assets.sentiment_rm import prepare_sentiment_rm  # torch and transformers: only when asked for

        return prepare_sentiment_rm(build=build)

    return {"smollm2": smollm2, "sentiment-rm": sentiment_rm}


def resolve_model(spec: str, field: str, *, build: bool = True) -> str | None:
    """A model folder for ``spec``: the packaged aliases are prepared (once) on demand;
    ``build=False``: None for an alias that is not built yet (``model_aliases``)."""
    aliases = model_aliases()
    if spec in aliases:
        path = aliases[spec](build=build)
        return None if path is None else str(path)
    if not Path(spec).expanduser().is_dir():
        raise ConfigError(f"{field}: '{spec}' is neither a model folder nor one of {sorted(aliases)}")
    return str(Path(spec).expanduser())
