"""Where prompts come from and the rule rewards that judge their responses (plain Python).

Owns: the packaged "sentiment-prompts" set (the default task of `colocate train`: make
responses more positive), prompts and exact scorers from `reasoning-gym`, user prompt
files (.jsonl with a "prompt" field), the dispatch over those by a `data.source` string,
and two rule rewards: VADER's compound score and a reasoning-gym task's own scorer.

`chat_prompt_ids` is the one place a prompt becomes chat-formatted token ids, so the
actor and the distilled reward model see the same tokens; `text_ids` tokenizes text from
outside (prompts, tool output) so that a special token's string in it stays characters.

Left out: reward models (trainer/reward_distill builds the
default one, the engine scores with it), and any torch or SGLang code.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import vader

from colocate.errors import ConfigError

FIELD = "data.source"
SENTIMENT_SOURCE = "sentiment-prompts"
REASONING_GYM_PREFIX = "reasoning-gym:"
SENTIMENT_DATA = "data/sentiment_prompts.json"
REASONING_GYM_DEFAULT_SIZE = 1000
ANSWER_INSTRUCTION = "Give only the final answer, between <answer> and </answer>."
EXAMPLE_TASKS = ("basic_arithmetic", "chain_sum", "gsm_symbolic", "leg_counting", "spell_backward")

RewardFn = Callable[[Mapping[str, Any], str], float]  # (prompt meta, response text) -> reward


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One user request. `meta` is what its rule reward needs (a reasoning-gym entry, a jsonl record)."""

    text: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------- sources


def sentiment_prompts(n: int | None = None, seed: int = 0) -> list[str]:
    """The packaged requests that invite a short opinionated answer, shuffled by `seed`.

    Built as templates x slot values from `colocate/data/sentiment_prompts.json` (372 in
    all); `n` caps how many are returned (None: all of them).
    """
    groups = json.loads(resources.files("colocate").joinpath(SENTIMENT_DATA).read_text())["groups"]
    texts = [t.format(x=v) for g in groups.values() for t in g["templates"] for v in g["values"]]
    return _shuffled_head(list(dict.fromkeys(texts)), n, seed)


def reasoning_gym_prompts(task: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """`n` procedurally generated questions of reasoning-gym task `task` (seeded by `seed`).

    Each prompt's text is the question plus an instruction to put the answer between
    <answer> tags; its meta is the reasoning-gym entry, which `reasoning_gym_reward` scores.
    """
    rg = _reasoning_gym(task)
    dataset = rg.create_dataset(task, seed=seed, size=n or REASONING_GYM_DEFAULT_SIZE)
    return [Prompt(f"{entry['question']}\n\n{ANSWER_INSTRUCTION}", dict(entry)) for entry in dataset]


def jsonl_prompts(path: str | Path, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts from a .jsonl file, one JSON object per line with a string "prompt"; meta is the record."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"{FIELD}: cannot read prompt file {path} ({exc.strerror or exc})") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{FIELD}: {path} line {number} is not valid JSON") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ConfigError(f'{FIELD}: {path} line {number} has no string "prompt" field')
        prompts.append(Prompt(record["prompt"], record))
    return _shuffled_head(prompts, n, seed)


def load_prompt_source(spec: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """Prompts named by a `data.source` value.

    "sentiment-prompts" | "reasoning-gym:<task>" | a path to a .jsonl file with a
    "prompt" field. Anything else, or a source with no prompts, is a `ConfigError`.
    """
    if n is not None and n < 1:
        raise ConfigError(f"{FIELD}: asked for {n} prompts; ask for at least 1")
    if spec == SENTIMENT_SOURCE:
        prompts = [Prompt(text) for text in sentiment_prompts(n, seed)]
    elif spec.startswith(REASONING_GYM_PREFIX):
        prompts = reasoning_gym_prompts(spec.removeprefix(REASONING_GYM_PREFIX), n, seed)
    elif spec.endswith(".jsonl"):
        prompts = jsonl_prompts(spec, n, seed)
    else:
        raise ConfigError(
            f"{FIELD}: unknown prompt source {spec!r}; use {SENTIMENT_SOURCE!r}, "
            f"'{REASONING_GYM_PREFIX}<task>' (e.g. '{REASONING_GYM_PREFIX}chain_sum') or a .jsonl file"
        )
    if not prompts:
        raise ConfigError(f"{FIELD}: prompt source {spec!r} has no prompts")
    return prompts


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """`text` as a single user turn in the tokenizer's chat template, ready for the assistant's
    answer. Text stays text: a prompt holding a special token's string (``<|im_start|>``…, from
    a dataset no one checked) gets its characters' tokens, not the control token; the
    template's own control tokens are exact (:func:`text_ids`)."""
    if holds_special(tokenizer, text):
        before, after = _user_frame(tokenizer)
        return plain_ids(tokenizer, before) + text_ids(tokenizer, text) + plain_ids(tokenizer, after)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


_CONTENT = "\x1eCONTENT\x1e"  # a sentinel no template alters


def _user_frame(tokenizer: Any) -> tuple[str, str]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": _CONTENT}], add_generation_prompt=True,
                                         tokenize=False)
    before, _, after = text.partition(_CONTENT)
    return before, after


def special_strings(tokenizer: Any) -> list[str]:
    """The strings the tokenizer turns into its added (control) tokens."""
    return [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.content]


def holds_special(tokenizer: Any, text: str) -> bool:
    return any(s in text for s in special_strings(tokenizer))


def plain_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as the template wrote it: its control tokens' strings are control tokens."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` from outside (a tool's output, a dataset's prompt) as data: a special token's
    string in it is tokenized as its characters (``split_special_tokens``), so it can forge
    no turn; decoding the ids gives ``text`` back."""
    if not text:
        return []
    return [int(t) for t in tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]]


def _shuffled_head(items: list, n: int | None, seed: int) -> list:
    random.Random(seed).shuffle(items)
    return items if n is None else items[:n]


# ---------------------------------------------------------------- rule rewards


def vader_reward(text: str) -> float:
    """VADER's compound sentiment of `text`, in [-1, 1] (positive is > 0)."""
    return float(vader.polarity_scores(text)["compound"])


def sentiment_reward(prompt_meta: Mapping[str, Any], response_text: str) -> float:
    """`vader_reward` as a `RewardFn` (the prompt does not matter)."""
    return vader_reward(response_text)


def reasoning_gym_reward(task: str) -> RewardFn:
    """Reward of a response to a `reasoning_gym_prompts(task)` prompt, by the task's own scorer.

    The answer is the last <answer>...</answer> span of the response, or the whole
    stripped response when it has none; the score is in [0, 1] (1: correct).
    """
    rg = _reasoning_gym(task)
    score_answer = rg.get_score_answer_fn(task)
    extract_answer = rg.utils.extract_answer

    def reward(prompt_meta: Mapping[str, Any], response_text: str) -> float:
        answer = extract_answer(response_text)
        answer = response_text.strip() if answer is None else answer
        return float(score_answer(answer, dict(prompt_meta)))  # raising: reward.on_error decides

    return reward


def _reasoning_gym(task: str):  # noqa: ANN202 - the reasoning_gym module
    """Import reasoning_gym and check `task` is one of its datasets, else a ConfigError on `data.source`."""
    try:  # optional and heavy: only for a reasoning-gym data.source
        import reasoning_gym
        import reasoning_gym.utils  # noqa: F401 - extract_answer
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(
            f"{FIELD}: '{REASONING_GYM_PREFIX}{task}' needs the reasoning-gym package: pip install reasoning-gym"
        ) from None
    if task not in DATASETS:
        raise ConfigError(
            f"{FIELD}: unknown reasoning-gym task {task!r}; valid tasks include "
            f"{', '.join(EXAMPLE_TASKS)} ({len(DATASETS)} in all: reasoning_gym.factory.DATASETS)"
        )
    return reasoning_gym
