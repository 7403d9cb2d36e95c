"""The libraries' progress bars of loading and writing models, off; one line each instead.

Owns: :func:`hide_library_bars`, which a command that loads models calls once for its
process (the CLI: ``colocate train``, ``generate``, ``export``, ``prepare``) with the
``engines.log_level`` it runs under: below info (the default, error) it turns off the bars
of transformers (``from_pretrained``'s "Loading weights", ``save_pretrained``'s "Writing
model shards"), of huggingface_hub (downloads) and, when asked (a run that reads a
dataset), of datasets (its loading and map bars); at debug or info they stay. And
:func:`loaded`, the one line that says what loaded and how long it took.

Leaves out: SGLang's scheduler processes, whose bars are switched where an engine starts
(``engine.sglang_api.child_progress_bars``, from the same ``log_level``); colocate's own
step bar (``colocate.monitor.progress``). A library used from Python keeps its bars
unless the caller turns them off: this is the owner's choice, never made at import.
"""

from __future__ import annotations

from typing import Any, Mapping

from colocate.engine.sglang_api import shows_progress


def hide_library_bars(log_level: str, *, datasets: bool = False) -> bool:
    """Turn the bars of transformers and huggingface_hub (and with ``datasets`` those of
    datasets, if installed) off for this process unless ``log_level`` asks for them
    (``engine.sglang_api.shows_progress``) -> whether they were turned off."""
    if shows_progress(log_level):
        return False
    from transformers.utils import logging as hf_logging  # here, not at the top: transformers is slow to import

    hf_logging.disable_progress_bar()  # huggingface_hub's too
    if datasets:
        try:
            import datasets as hf_datasets  # only for a run that reads one: slow to import
        except ImportError:
            return True
        hf_datasets.disable_progress_bars()
    return True


def count(n: int) -> str:
    """``n`` (a parameter count) short: 134515008 -> "135M", 30212 -> "30.2K"."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def params(models: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of each model (a torch module; None: left out): global counts under FSDP."""
    return {name: sum(p.numel() for p in m.parameters()) for name, m in models.items() if m is not None}


def loaded(what: str, params: int | Mapping[str, int], seconds: float) -> str:
    """The line that replaces a loading bar: "actor loaded: 135M params in 1.2 s"; ``params``
    per part: "trainer loaded: actor 135M, critic 135M params in 2.3 s"."""
    sizes = count(params) if isinstance(params, int) else ", ".join(f"{k} {count(n)}" for k, n in params.items())
    return f"{what} loaded: {sizes} params in {seconds:.1f} s"
