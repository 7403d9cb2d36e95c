"""Item 7 of issue 50: a prompt far too long is refused by its characters, before tokenizing.

A 50 MB one-line prompt used to be tokenized whole (a minute, gigabytes) only to be refused
for length. Now it is refused in one line naming the row, its characters and the bound, in
well under a second: timed around ``tokenize_prompts`` (the check) in a child process, so
that a regression costs the suite a bounded wait and no memory of its own; and end to end
through ``colocate train --check``. The bound never refuses a prompt that fits: for random
texts (whitespace, controls, combining marks, any script) over the limit, the tokenizer
agrees they have more tokens than the limit."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colocate.assets.tasks import Prompt, chat_prompt_ids

BIG = 50 * 2**20  # characters of the one-line prompt
LIMIT_S = 10.0  # the refusal's time, generous (it takes ~0.2 s)
CHILD_TIMEOUT_S = 90  # the unchanged code tokenized for minutes: the child is stopped here
LINE = ("data: prompt 0 (line 1 of {source}) has {chars} characters besides whitespace > 4608 (data.max_prompt_tokens "
        "96 × 12, the longest token of the actor's tokenizer, × 4): more than 96 tokens, refused before tokenizing; "
        "raise data.max_prompt_tokens or shorten the prompt")
TEXT = "All work and no play makes Jack a dull boy. "
CHARS = sum(not c.isspace() for c in TEXT) * (BIG // len(TEXT)) + sum(not c.isspace() for c in TEXT[:BIG % len(TEXT)])

CHECK = """
import sys, time
from transformers import AutoTokenizer
from colocate.assets.tasks import load_prompt_source
from colocate.errors import ConfigError
from colocate.run.session import tokenize_prompts
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
prompts = load_prompt_source(sys.argv[2])
started = time.perf_counter()
try:
    tokenize_prompts(tokenizer, prompts, 96)
    print("not refused")
except ConfigError as exc:
    print(f"{time.perf_counter() - started:.3f}")
    print(exc)
"""


def _limited() -> None:
    """The child's memory: at most 8 GiB (the unchanged code took gigabytes for the ids alone)."""
    resource.setrlimit(resource.RLIMIT_AS, (8 * 2**30, 8 * 2**30))


def _child(args: list[str]) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, preexec_fn=_limited)
    except subprocess.TimeoutExpired:
        pytest.fail(f"not refused within {CHILD_TIMEOUT_S} s: {' '.join(args[:3])} ...")
    if done.returncode not in (0, 2):  # what the child said first, not its backtrace
        pytest.fail(f"the child ended with {done.returncode} after {time.perf_counter() - started:.0f} s: "
                    f"{done.stderr.strip().splitlines()[:3]}")
    return done


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> str:
    """A .jsonl whose one line is a 50 MB prompt."""
    source = tmp_path_factory.mktemp("big") / "big.jsonl"
    source.write_text(json.dumps({"prompt": (TEXT * (BIG // len(TEXT) + 1))[:BIG]}) + "\n")
    return str(source)


def test_a_50mb_prompt_is_refused_by_its_characters_in_well_under_a_second(tiny_actor_path, big):
    done = _child([sys.executable, "-c", CHECK, tiny_actor_path, big])
    assert done.returncode == 0, done.stderr[-2000:]
    seconds, line = done.stdout.splitlines()[:2]
    assert line == LINE.format(source=big, chars=CHARS)
    assert float(seconds) < LIMIT_S, f"the refusal took {seconds} s"


def test_colocate_train_check_refuses_a_50mb_prompt_in_one_line(tiny_actor_path, big):
    done = _child([sys.executable, "-m", "colocate.cli", "train", "--set", f"models.actor={tiny_actor_path}",
                   "--set", "reward.kind=rule", "--set", "reward.rule=vader", "--set", "engines.device=cpu",
                   "--set", f"data.source={big}", "--set", "data.eval_prompts=0", "--set", f"run.out_dir={big}.run",
                   "--check"])
    assert (done.returncode, done.stdout) == (2, ""), done.stderr[-2000:]
    assert done.stderr == f"error: {LINE.format(source=big, chars=CHARS)}\n"


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE whose tokens are long (up to 16 characters: runs of each piece of
    :data:`PIECES`), behind a normalizer that joins characters (NFKC), collapses spaces and
    strips: what could make a prompt fewer tokens than its characters suggest."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from colocate.assets.random_models import TINY_CHAT_TEMPLATE

    byte_char = _gpt2_byte_chars()
    vocab = {c: i for i, c in enumerate(["<|pad|>", "<|im_start|>", "<|im_end|>", *byte_char])}
    merges = {}
    for piece in PIECES:
        encoded = "".join(byte_char[b] for b in piece.encode())
        run = encoded[0]
        for nxt in [*encoded[1:], *([None] * 4)]:  # the piece byte by byte, then doubled while <= 16 long
            pair = (run, nxt) if nxt is not None else (run, run)
            if nxt is None and len(run) * 2 > 16:
                break
            merges.setdefault(pair, None)
            run = pair[0] + pair[1]
            vocab.setdefault(run, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=list(merges)))
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " "),
                                               normalizers.Strip()])
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|pad|>", "<|im_start|>", "<|im_end|>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in of each byte 0..255 (the ByteLevel alphabet), in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(extra)) for b in range(256)]


PIECES = ["a", "é", "漢", "😀", "ﾊﾞ", "ｶﾞ", "\u1100\u1161\u11a8", "e\u0301", " ", "\u3000", "\t", "\n", "\x00", "\x1b", "\u200b",
          "\ufeff", "\u0308", "<|im_end|>", ".", "\U000e0001", "ab"]


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.tuples(st.sampled_from(PIECES), st.integers(1, 4000)), min_size=1, max_size=6))
def test_no_prompt_has_fewer_tokens_than_its_characters_bound(tokenizer, runs):
    """What the refusal rests on: a chat-formatted prompt has at least (its counted
    characters) / (the longest token × 4) tokens; so one over the character limit is over
    the token limit, and the bound never refuses a prompt that fits."""
    from colocate.assets.prompt_chars import JOINED, char_limit, counted

    text = "".join(piece * k for piece, k in runs)
    per_token = char_limit(tokenizer, 1).per_token
    assert per_token == 16  # long tokens: the bound is put to the test
    assert len(chat_prompt_ids(tokenizer, Prompt(text).chat)) * per_token * JOINED >= counted(text)
