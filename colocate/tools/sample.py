"""Sampling from a model with the SGLang actor engine: `colocate generate` and `api.generate`.

Owns: resolving what to sample from (a packaged alias, an HF folder, or a run folder /
checkpoint, whose actor is exported first), chat-formatting the prompts like training
does, one engine for the call (a run's own ``engines.log_level``), and the decoded responses.
Leaves out: the engine (``engine.runtime``), the export (``colocate.tools.export``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path
from typing import Callable, Sequence

from colocate.run.checkpoint import MANIFEST
from colocate.errors import ConfigError
from colocate.assets.model_aliases import resolve_model
from colocate.assets.tasks import chat_prompt_ids, raw_prompt_ids
from colocate.config import EnginesConfig, ModelsConfig, load_config
from colocate.rollout import generate_and_score
from colocate.rollout.sample import Sample
from colocate.engine.runtime import SglangEngine
from colocate.rollout.generate_and_score import sampling_params
from colocate.tools.export import export_actor, log_level_of


DEVICES = typing.get_args(typing.get_type_hints(EnginesConfig)["device"])  # auto, cpu, cuda
DTYPES = typing.get_args(typing.get_type_hints(ModelsConfig)["dtype"])


@dataclasses.dataclass(frozen=True)
class SampleOptions:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "float32"
    chat: bool = True  # apply the tokenizer's chat template, as training does


@dataclasses.dataclass(frozen=True)
class Generation:
    prompt: str
    response: str
    token_ids: list[int]  # the response's tokens
    finish_reason: str  # stop | length


def options(given: dict) -> SampleOptions:
    """``api.generate``'s keyword options as :class:`SampleOptions`; an unknown one is one
    line naming it, the closest known one and all of them."""
    known = [f.name for f in dataclasses.fields(SampleOptions)]
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            raise ConfigError(f"generate: unknown option {name!r}; {f'did you mean {close[0]!r}? ' if close else ''}"
                              f"the options: {', '.join(known)}")
    return SampleOptions(**given)


def is_run(path: Path) -> bool:
    """A run folder (with checkpoints) or a single checkpoint, rather than a model folder."""
    return (path / MANIFEST).is_file() or (path / "checkpoints").is_dir()


def model_folder(spec: str, log: Callable[[str], None] = lambda message: None) -> str:
    """An HF folder for ``spec``: a run folder or checkpoint (its actor, exported once into
    ``<run>/export/``; ``log``: the export's lines), a model folder, or a packaged alias (``smollm2``)."""
    path = Path(spec).expanduser()
    if path.is_dir() and is_run(path):
        return str(export_actor(path, log=log, what="generate"))
    return resolve_model(spec, "model")


def check(prompts: Sequence[str], opts: SampleOptions) -> None:
    problems = [
        (bool(prompts), "no prompts: pass --prompt TEXT (repeatable) or --prompts-file FILE"),
        (opts.max_new_tokens >= 1, f"--max-new-tokens {opts.max_new_tokens}: must be >= 1"),
        (0 <= opts.temperature < math.inf, f"--temperature {opts.temperature}: must be >= 0 and finite (0 is greedy)"),
        (0 < opts.top_p <= 1, f"--top-p {opts.top_p}: must be in (0, 1]"),
        (opts.device in DEVICES, f"--device {opts.device!r}: one of {', '.join(DEVICES)}"),
        (opts.dtype in DTYPES, f"--dtype {opts.dtype!r}: one of {', '.join(DTYPES)}"),
    ]
    for ok, message in problems:
        if not ok:
            raise ConfigError(message)


def generate(model: str, prompts: Sequence[str], opts: SampleOptions = SampleOptions(),
             log: Callable[[str], None] = lambda message: None) -> list[Generation]:
    """Responses of ``model`` to ``prompts`` (all sampled concurrently on one engine); ``log``
    gets a line for what was loaded (a run's export, the engine) and how long it took."""
    # here, not at the top: transformers (also via builder and session) would slow the CLI's start
    from colocate.run.builder import cuda_missing, engine_configs
    from colocate.run.preflight import load_tokenizer, model_context_length
    from colocate.run.session import stop_ids

    check(prompts, opts)
    if opts.device == "cuda" and (why := cuda_missing()) is not None:
        raise ConfigError(f"--device cuda: {why}; use --device auto (the CPU here) or cpu "
                          "(colocate doctor: the driver)")
    folder = model_folder(model, log)
    tokenizer = load_tokenizer(folder, "model")
    ids = [_prompt_ids(tokenizer, text, opts.chat) for text in prompts]
    context, where = model_context_length(folder)
    longest = max(len(x) for x in ids)
    if longest + opts.max_new_tokens > context:  # one line before the engine starts, not a refusal after
        raise ConfigError(f"the longest prompt is {longest} tokens and --max-new-tokens {opts.max_new_tokens}: "
                          f"{longest + opts.max_new_tokens} > the model's context of {context} tokens ({where}); "
                          "shorten the prompt or lower --max-new-tokens")
    stop = stop_ids(tokenizer)
    cfg = load_config(overrides=[f"engines.device={opts.device}", f"models.dtype={opts.dtype}",
                                 f"run.seed={opts.seed}",  # the engine settings training would use,
                                 f"engines.log_level={log_level_of(model)}"])  # a run's log level its own
    engine = SglangEngine(engine_configs(cfg, folder, None)[0], field="model")
    log(f"actor engine up: {Path(folder).name} in {engine.start_seconds:.1f} s")
    try:
        samples = [Sample(i, p, opts.max_new_tokens) for i, p in enumerate(ids)]
        engine.loop.run_until_complete(generate_and_score.generate(
            engine, samples, sampling_params(opts.temperature, opts.top_p, stop), "gen"))
    finally:
        engine.shutdown()
    return [Generation(text, tokenizer.decode(s.output_ids, skip_special_tokens=True), list(s.output_ids),
                       s.finish_reason or "") for text, s in zip(prompts, samples)]


def _prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:  # noqa: ANN001 - a HF tokenizer
    """Chat-formatted as in training (``colocate.assets.tasks.chat_prompt_ids``), or the plain text
    (``raw_prompt_ids``, as ``data.apply_chat_template=false`` trains) when asked or when the
    tokenizer has no chat template."""
    if not chat or tokenizer.chat_template is None:
        return raw_prompt_ids(tokenizer, text)
    return chat_prompt_ids(tokenizer, text)
