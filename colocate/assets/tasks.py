"""Where prompts come from and the rule rewards that judge their responses (plain Python).

Owns: the packaged "sentiment-prompts" set (the default task of `colocate train`: make
responses more positive), prompts and exact scorers from `reasoning-gym`, users' datasets
(a .jsonl file, or through the `datasets` library a Hub dataset `hf:<name>[:<config>]`, a
`save_to_disk` folder or a .parquet/.json/.csv file: the `data.prompt_key` column holds
text or chat messages, the whole row is the record), the dispatch over those by a
`data.source` string, and two rule rewards: VADER's compound score and a reasoning-gym
task's own scorer.

`chat_prompt_ids` is the one place a prompt (a text, or chat messages) becomes
chat-formatted token ids, so the actor and the distilled reward model see the same
tokens; `text_ids` tokenizes text from outside (prompts, tool output) so that a special
token's string in it stays characters.

Left out: reward models (trainer/reward_distill builds the
default one, the engine scores with it), and any torch or SGLang code.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import vader

from colocate.assets.data_files import library_errors_held, not_utf8
from colocate.errors import ConfigError, cause_line

FIELD = "data.source"
SENTIMENT_SOURCE = "sentiment-prompts"
REASONING_GYM_PREFIX = "reasoning-gym:"
HF_PREFIX = "hf:"
DATASET_FILES = {".parquet": "parquet", ".json": "json", ".csv": "csv"}  # suffix -> datasets' loader (.jsonl: ours)
TEXT_FILES = (".json", ".csv")  # of those, the ones that must be UTF-8 text
SENTIMENT_DATA = "data/sentiment_prompts.json"
REASONING_GYM_DEFAULT_SIZE = 1000
ANSWER_INSTRUCTION = "Give only the final answer, between <answer> and </answer>."
EXAMPLE_TASKS = ("basic_arithmetic", "chain_sum", "gsm_symbolic", "leg_counting", "spell_backward")

RewardFn = Callable[[Mapping[str, Any], str], float]  # (prompt meta, response text) -> reward


Messages = tuple[Mapping[str, str], ...]  # chat messages: {"role", "content"} each
_ROLE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*\Z")  # a role is a name: it can carry no template text


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One user request. `meta` is what its rule reward needs (a reasoning-gym entry, a dataset's
    row). `messages`, when set (a dataset's chat messages, a system turn too), is what is
    chat-formatted; `text` is then its last user turn's content, for display."""

    text: str
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    messages: Messages = ()
    where: str = ""  # a dataset's row: "line 7 of prompts.jsonl", "row 7 of hf:..."; "" for generated prompts

    @property
    def contents(self) -> tuple[str, ...]:
        """The texts that are chat-formatted: each message's content, else the text."""
        return tuple(m["content"] for m in self.messages) or (self.text,)

    @property
    def chat(self) -> str | Messages:
        """What `chat_prompt_ids` formats: the messages, else the text as one user turn."""
        return self.messages or self.text

    def with_instruction(self, instruction: str) -> Prompt:
        """This prompt with `instruction` after its text (after the last user turn's content)."""
        if not self.messages:
            return dataclasses.replace(self, text=f"{self.text}\n\n{instruction}")
        at = _last_user(self.messages)
        last = self.messages[at]
        content = f"{last['content']}\n\n{instruction}"
        messages = (*self.messages[:at], {**last, "content": content}, *self.messages[at + 1:])
        return dataclasses.replace(self, text=content if last["role"] == "user" else self.text, messages=messages)


def _last_user(messages: Messages) -> int:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return users[-1] if users else len(messages) - 1


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


def jsonl_prompts(path: str | Path, n: int | None = None, seed: int = 0, *, prompt_key: str = "prompt",
                  answer_key: str = "") -> list[Prompt]:
    """Prompts from a .jsonl file, one JSON object per line whose `prompt_key` holds text or chat
    messages; meta is the record (with `answer_key`'s value also under "answer")."""
    try:  # lines end at \n only (JSON text may hold U+2028 and other line breaks); a byte-order mark is skipped
        lines = Path(path).read_text(encoding="utf-8-sig").split("\n")
    except OSError as exc:
        raise ConfigError(f"{FIELD}: cannot read prompt file {path} ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise ConfigError(_not_utf8(path, not_utf8(path))) from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise ConfigError(f"{FIELD}: {path} line {number} is not valid JSON") from None
        if not isinstance(record, dict):
            raise ConfigError(f'{FIELD}: {path} line {number} is {_a(record)}, not a JSON object with a "{prompt_key}" '
                              "field (data.prompt_key)")
        if prompt_key not in record:
            raise ConfigError(f'{FIELD}: {path} line {number} has no "{prompt_key}" field (data.prompt_key); '
                              f"its fields: {', '.join(map(str, record)) or 'none'}")
        prompts.append(_row_prompt(record, f"line {number} of {path}", prompt_key, answer_key))
    return _shuffled_head(prompts, n, seed)


def dataset_prompts(spec: str, n: int | None = None, seed: int = 0, *, split: str = "train",
                    prompt_key: str = "prompt", answer_key: str = "") -> list[Prompt]:
    """Prompts from a dataset the `datasets` library loads: `hf:<name>[:<config>]` (the Hub or
    its cache; `split`), a `save_to_disk` folder (a DatasetDict: its `split`), a folder of
    data files, or a .parquet/.json/.csv file. Each row's `prompt_key` column holds text or
    chat messages; meta is the row (with `answer_key`'s value also under "answer")."""
    table = _dataset(spec, split)
    columns = list(table.column_names)
    for key, field in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key and key not in columns:
            raise ConfigError(f"{field} {key!r} is not a column of {spec}; its columns: {', '.join(columns)}")
    rows = table.to_list()
    prompts = [_row_prompt(row, f"row {i} of {spec}", prompt_key, answer_key) for i, row in enumerate(rows)]
    return _shuffled_head(prompts, n, seed)


def _dataset(spec: str, split: str) -> Any:  # a datasets.Dataset
    try:  # only for these sources
        import datasets
    except ImportError:
        raise ConfigError(f"{FIELD}: {spec!r} needs the datasets package: pip install datasets") from None
    if spec.startswith(HF_PREFIX):
        name, _, config = spec.removeprefix(HF_PREFIX).partition(":")
        if not name:
            raise ConfigError(f"{FIELD}: {spec!r} names no dataset; use hf:<name>[:<config>] (hf:openai/gsm8k:main)")
        hint = ("; offline? have it in the Hugging Face cache (with HF_HUB_OFFLINE=1), or give a save_to_disk "
                "folder or a data file")
        return _loaded(spec, lambda: datasets.load_dataset(name, config or None, split=split), hint)
    path = Path(spec).expanduser()
    if path.is_dir():
        if not ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file()):
            return _loaded(spec, lambda: datasets.load_dataset(str(path), split=split))  # data files (a Hub clone)
        saved = _loaded(spec, lambda: datasets.load_from_disk(str(path)))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise ConfigError(f"data.split {split!r} is not a split of {spec}; its splits: {', '.join(saved)}")
            return saved[split]
        one = saved
    elif path.suffix.lower() in DATASET_FILES:
        if not path.is_file():
            raise ConfigError(f"{FIELD}: no such file {spec}")
        one = _loaded(spec, lambda: datasets.load_dataset(DATASET_FILES[path.suffix.lower()], data_files=str(path),
                                                          split="train"),
                      text_file=path if path.suffix.lower() in TEXT_FILES else None)
    else:
        raise ConfigError(f"{FIELD}: no such folder {spec}")
    _one_table(spec, split)
    return one


def _one_table(spec: str, split: str) -> None:
    """A file (or a saved single table) has no splits: ``data.split`` must be left unset."""
    if split != "train":
        raise ConfigError(f"data.split {split!r}: {spec} holds one table, not splits; leave data.split unset")


def _loaded(spec: str, load: Callable[[], Any], hint: str = "", text_file: Path | None = None) -> Any:
    """`load()`, whose failure (datasets raises many kinds: ConnectionError offline, a missing
    config or split, a malformed file) is one line naming `data.source` and the cause (not
    datasets' "An error occurred while generating the dataset"), without the libraries'
    own lines (datasets' errors, the Hub client's retries when the Hub cannot be reached);
    `text_file` (a .json/.csv): one that is not UTF-8 is said so, and where."""
    try:
        with library_errors_held("datasets", "huggingface_hub"):
            return load()
    except Exception as exc:  # noqa: BLE001 - any failure deep inside datasets becomes one line
        where = not_utf8(text_file) if text_file is not None else ""
        if where:
            raise ConfigError(_not_utf8(spec, where)) from None
        wrapped = type(exc).__name__ == "DatasetGenerationError" and exc.__cause__ is not None
        why = cause_line(exc.__cause__ if wrapped else exc, 300) or type(exc).__name__
        raise ConfigError(f"{FIELD}: cannot load {spec}: {why}{hint}") from None


def _not_utf8(spec: str | Path, where: str) -> str:
    """The refusal of a data file that is not UTF-8 (``where``: its first such byte, ``not_utf8``) and the fix."""
    return f"{FIELD}: {spec} is not UTF-8: {where}; save the file as UTF-8"


def _row_prompt(row: Mapping[str, Any], where: str, prompt_key: str, answer_key: str) -> Prompt:
    """The prompt of one row (`where`: "row 7 of <source>"): its `prompt_key` text or chat messages."""
    value, messages = row.get(prompt_key), ()
    if isinstance(value, (list, tuple)):
        messages = _messages(value, where, prompt_key)
        value = messages[_last_user(messages)]["content"]
    elif not isinstance(value, str):
        raise ConfigError(f"data: {where}: {prompt_key!r} (data.prompt_key) is {_a(value)}, not text or chat messages")
    if not value.strip():
        raise ConfigError(f"data: {where}: {prompt_key!r} (data.prompt_key) is empty")
    meta = dict(row)
    if answer_key:
        if row.get(answer_key) is None:
            raise ConfigError(f"data: {where}: {answer_key!r} (data.answer_key) is missing")
        meta["answer"] = row[answer_key]
    return Prompt(value, meta, messages, where)


def _messages(value: Sequence[Any], where: str, key: str) -> Messages:
    """Chat messages: {"role": a name, "content": text} each (other keys dropped)."""
    if not value:
        raise ConfigError(f"data: {where}: {key!r} (data.prompt_key) is an empty list, not chat messages")
    for i, m in enumerate(value):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ConfigError(f"data: {where}: {key!r} (data.prompt_key) is a list but its item {i} is {_a(m)}, "
                              'not a chat message {"role": ..., "content": ...} of text')
        if not _ROLE.match(m["role"]):
            raise ConfigError(f"data: {where}: {key!r} (data.prompt_key) message {i}'s role {m['role']!r} is not "
                              "a role name (system, user, assistant, ...)")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def _a(value: Any) -> str:
    """How a row's value is named in an error: "null", "an int", "a dict", ..."""
    if value is None:
        return "null"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def reads_dataset(spec: str) -> bool:
    """Whether the `data.source` ``spec`` is read with the datasets package (`dataset_prompts`)."""
    if spec == SENTIMENT_SOURCE or spec.startswith(REASONING_GYM_PREFIX) or spec.lower().endswith(".jsonl"):
        return False
    return spec.startswith(HF_PREFIX) or Path(spec).expanduser().is_dir() or Path(spec).suffix.lower() in DATASET_FILES


def load_prompt_source(spec: str, n: int | None = None, seed: int = 0, *, split: str = "train",
                       prompt_key: str = "prompt", answer_key: str = "") -> list[Prompt]:
    """Prompts named by a `data.source` value.

    "sentiment-prompts" | "reasoning-gym:<task>" | a .jsonl file | a dataset
    (`dataset_prompts`: "hf:<name>[:<config>]", a folder, a .parquet/.json/.csv file); the
    datasets' rows hold their prompt in `prompt_key` (`split`, `answer_key`: the `data.*`
    fields). Anything else, or a source with no prompts, is a `ConfigError`.
    """
    if n is not None and n < 1:
        raise ConfigError(f"{FIELD}: asked for {n} prompts; ask for at least 1")
    if spec == SENTIMENT_SOURCE:
        prompts = [Prompt(text) for text in sentiment_prompts(n, seed)]
    elif spec.startswith(REASONING_GYM_PREFIX):
        prompts = reasoning_gym_prompts(spec.removeprefix(REASONING_GYM_PREFIX), n, seed)
    elif spec.lower().endswith(".jsonl"):
        _one_table(spec, split)
        prompts = jsonl_prompts(spec, n, seed, prompt_key=prompt_key, answer_key=answer_key)
    elif reads_dataset(spec):
        prompts = dataset_prompts(spec, n, seed, split=split, prompt_key=prompt_key, answer_key=answer_key)
    else:
        raise ConfigError(
            f"{FIELD}: unknown prompt source {spec!r}; use {SENTIMENT_SOURCE!r}, "
            f"'{REASONING_GYM_PREFIX}<task>' (e.g. '{REASONING_GYM_PREFIX}chain_sum'), '{HF_PREFIX}<name>[:<config>]' "
            "(e.g. 'hf:openai/gsm8k:main'), a dataset folder or a .jsonl/.json/.parquet/.csv file"
        )
    if not prompts:
        raise ConfigError(f"{FIELD}: prompt source {spec!r} has no prompts")
    return prompts


def chat_prompt_ids(tokenizer: Any, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """`prompt` (a text as a single user turn, or chat messages, a system turn too) in the
    tokenizer's chat template, ready for the assistant's answer. Text stays text: a content
    holding a special token's string (``<|im_start|>``…, from a dataset no one checked) gets
    its characters' tokens, not the control token; the template's own control tokens are
    exact (:func:`text_ids`)."""
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                else [{"role": m["role"], "content": m["content"]} for m in prompt])
    if any(holds_special(tokenizer, m["content"]) for m in messages):
        return _framed_ids(tokenizer, messages)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return [int(t) for t in ids]


def raw_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a base model's prompt, no chat template (``data.apply_chat_template=false``):
    tokenized as the tokenizer does plain text (its BOS where it adds one), a special token's
    string in it as its characters (:func:`text_ids`)."""
    return [int(t) for t in tokenizer(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]]


_CONTENT = "\x1eCONTENT{}\x1e"  # a sentinel no template alters, numbered by message
_CONTENTS = re.compile("\x1eCONTENT(\\d+)\x1e")


def _framed_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The template rendered around sentinels: its frame's text as control tokens, each content as data."""
    marked = [{"role": m["role"], "content": _CONTENT.format(i)} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tokenize=False)
    ids = []
    for i, piece in enumerate(_CONTENTS.split(rendered)):  # frame, index, frame, index, ..., frame
        ids += text_ids(tokenizer, messages[int(piece)]["content"]) if i % 2 else plain_ids(tokenizer, piece)
    return ids


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
