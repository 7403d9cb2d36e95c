"""Start-up checks: what can be known to fail before any engine starts.

Owns: :func:`load_tokenizer` (the actor's tokenizer, or one line when its folder holds no
model or no tokenizer transformers can load), :func:`check_reads_actor_ids` (the reward
model and a critic of their own are handed the actor's token ids as they are: their
tokenizer and embedding must take them) and :func:`check_contexts`, which compares
the longest tokenized prompt + ``rollout.max_new_tokens`` with what each engine takes — the actor's and the reward
model's context length (read from the model folder's ``config.json`` the way SGLang
derives it, or the engine's configured ``context_length``) and each engine's KV pool
(``engines.*_max_total_tokens``: one whole request must fit it) — and fails with one
:class:`~colocate.errors.ConfigError` line naming both numbers and the fix.

Leaves out: what only a running engine knows (a GPU's actual KV pool, any other refusal:
those fail the step as ``RewardRequestError``), the per-prompt limit
``data.max_prompt_tokens`` (checked when prompts are tokenized).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from colocate.config import Config
from colocate.engine.reward import max_score_tokens
from colocate.engine.start_checks import read_architecture
from colocate.errors import ConfigError, cause_line

# the config.json keys SGLang 0.5.23 reads a context length from, first found wins
CONTEXT_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length", "max_position_embeddings")
SGLANG_DEFAULT_CONTEXT = 2048
# the files a tokenizer loads from (fast, sentencepiece, BPE vocabulary)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model_path: str, field: str, trusted: bool = False):
    """The tokenizer of the model folder ``model_path`` (``field`` names it), or one line: a
    folder without a model (no config.json: ``read_architecture``'s) or without a tokenizer
    transformers can load (files missing, or unreadable)."""
    from transformers import AutoTokenizer  # here: the CLI's --help stays light

    read_architecture(model_path, field)
    try:
        return AutoTokenizer.from_pretrained(model_path, trust_remote_code=trusted)
    except (OSError, ValueError, TypeError) as exc:  # transformers' words for absent or unreadable files
        files = any((Path(model_path).expanduser() / name).is_file() for name in TOKENIZER_FILES)
        why = cause_line(exc, 160).rstrip(": ") or type(exc).__name__ if files else "no tokenizer files there"
        raise ConfigError(f"{field}: '{model_path}' has no tokenizer transformers can load ({why}); pass a model "
                          "folder saved with its tokenizer (tokenizer.json, tokenizer_config.json)") from None


# each model that reads the actor's token ids: the way out its refusal names
READS_ACTOR_IDS = {
    "models.reward": "use a reward model with the actor's tokenizer (one of its model family), or reward.kind=rule "
                     "with reward functions, which read the decoded text",
    "models.critic": "use a critic backbone with the actor's tokenizer, or leave models.critic unset (the actor's "
                     "own backbone)",
}


def check_reads_actor_ids(actor_tokenizer, actor_path: str, model_path: str, field: str,
                          trusted: bool = False) -> None:
    """The model at ``model_path`` (``field``: the reward model, or a critic backbone of its
    own) is handed the actor's token ids as they are: its embedding must have a row for
    every id the actor can sample, and its tokenizer (where its folder has one) must give
    the actor's tokens the actor's ids, else it would score or value other text than the
    actor wrote, with no error anywhere. Tokens either tokenizer adds (special and added
    ones) may differ; the line ends with the field's way out (:data:`READS_ACTOR_IDS`)."""
    if Path(model_path).expanduser().resolve() == Path(actor_path).expanduser().resolve():
        return
    fix = READS_ACTOR_IDS[field]
    rows, actor_rows = _vocab_size(model_path), _vocab_size(actor_path)
    if rows is not None and actor_rows is not None and rows < actor_rows:
        raise ConfigError(f"{field}: its embedding has {rows} rows, fewer than the actor's {actor_rows} token ids "
                          f"(config.json vocab_size), so a token the actor samples can be past its end; {fix}")
    if not any((Path(model_path).expanduser() / name).is_file() for name in TOKENIZER_FILES):
        return  # no tokenizer of its own to compare (the engine reads token ids only)
    try:
        other = load_tokenizer(model_path, field, trusted)
    except ConfigError:
        return  # unreadable: nothing runs it (the engine reads token ids only)
    try:
        added = {*getattr(actor_tokenizer, "added_tokens_decoder", {}), *getattr(other, "added_tokens_decoder", {})}
        theirs, vocab = other.get_vocab(), actor_tokenizer.get_vocab()
    except NotImplementedError:  # a tokenizer (remote code) that does not list its vocabulary
        return
    ours = [(token, i) for token, i in vocab.items() if i not in added]
    differ = [(token, i) for token, i in ours if theirs.get(token) != i]
    if differ:
        token, i = min(differ, key=lambda x: x[1])
        there = f"{theirs[token]} there" if token in theirs else "not there"
        raise ConfigError(f"{field}: its tokenizer is not the actor's ({len(differ)} of the actor's {len(ours)} "
                          f"tokens have another id there, e.g. {token!r} is {i} in the actor's, {there}); it is "
                          f"handed the actor's token ids as they are, so it would read other text than the actor "
                          f"wrote; {fix}")


def _vocab_size(model_path: str) -> int | None:
    file = Path(model_path).expanduser() / "config.json"
    data = json.loads(file.read_text()) if file.is_file() else {}
    size = (data.get("text_config") or data).get("vocab_size")
    return int(size) if isinstance(size, int) else None


def model_context_length(model_path: str, configured: int | None = None) -> tuple[int, str]:
    """(the context length SGLang gives the model, where it comes from)."""
    if configured:
        return configured, "its configured context_length"
    file = Path(model_path).expanduser() / "config.json"
    data = json.loads(file.read_text()) if file.is_file() else {}
    text = data.get("text_config") or data
    for key in CONTEXT_KEYS:
        if text.get(key) is not None:
            return int(_rope_factor(text.get("rope_scaling")) * text[key]), f"config.json {key}"
    return SGLANG_DEFAULT_CONTEXT, "SGLang's default"


def _rope_factor(rope: dict[str, Any] | None) -> float:
    if not rope or "original_max_position_embeddings" in rope or rope.get("rope_type") == "llama3":
        return 1
    return rope.get("factor", 1)


def check_contexts(cfg: Config, actor_cfg, reward_cfg, prompts: Sequence[Any]) -> None:
    """Refuse a run whose longest request cannot fit the actor or the reward engine
    (``actor_cfg``/``reward_cfg``: their ``EngineConfig``; reward None without a reward
    model; ``prompts``: every tokenized prompt, held-out ones included)."""
    if not prompts:
        return
    longest = max(len(p.ids) for p in prompts)
    new = cfg.rollout.max_new_tokens
    need = longest + new
    what = f"the longest prompt ({longest} tokens) + rollout.max_new_tokens ({new}) = {need} tokens"
    fix = "lower rollout.max_new_tokens or data.max_prompt_tokens (shorter prompts)"
    ctx, source = model_context_length(actor_cfg.model_path, actor_cfg.context_length)
    if need > ctx:
        raise ConfigError(f"models.actor: {what} > the actor's context length {ctx} ({source}); {fix}, "
                          "or use an actor with a longer context")
    _check_pool("actor", actor_cfg.max_total_tokens, need, what)
    if reward_cfg is None:
        return
    ctx, source = model_context_length(reward_cfg.model_path, reward_cfg.context_length)
    if need > max_score_tokens(ctx):
        raise ConfigError(f"models.reward: {what} > the {max_score_tokens(ctx)} tokens the reward model scores "
                          f"(context length {ctx}, {source}); {fix}, or use a reward model with a longer context")
    _check_pool("reward", reward_cfg.max_total_tokens, need, what)


def _check_pool(role: str, pool: int | None, need: int, what: str) -> None:
    if pool is not None and need > pool:
        raise ConfigError(f"engines.{role}_max_total_tokens: {what} > the {role} engine's KV pool of {pool} "
                          f"tokens, which must hold one whole request; raise engines.{role}_max_total_tokens "
                          "or lower rollout.max_new_tokens")
