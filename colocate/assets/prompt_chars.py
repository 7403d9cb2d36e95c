"""A prompt too long to fit ``data.max_prompt_tokens``, known by its characters, before it is tokenized.

Tokenizing a 50 MB prompt takes a minute and gigabytes only to refuse it; its characters
say it cannot fit. Owns: :func:`char_limit`, the bound for a tokenizer, and
:meth:`CharLimit.over`, a prompt's count against it. The bound can never refuse a prompt
that would fit, because each factor is an upper bound:

- one token stands for at most ``per_token`` characters: the longest string of the
  tokenizer's vocabulary, added and special tokens included (a byte-level token's string
  has one character per byte, and a byte is at most one character; a byte-fallback token
  ``<0xE9>`` stands for less than its six characters);
- the characters counted are those no normalizer or chat template drops: whitespace
  (stripped, collapsed), control and format characters (cleaned away), combining marks
  (stripped as accents) and unassigned code points are not counted;
- Unicode normalization (NFC, NFKC) joins at most 4 characters into one (a character's
  canonical decomposition is at most 4 long), hence × :data:`JOINED`.

So a prompt with more counted characters than ``max_tokens × per_token × 4`` has more
than ``max_tokens`` tokens. Tokenizers whose unknown token can stand for any number of
characters (WordPiece, WordLevel, Unigram, a BPE that fuses unknown characters without
byte fallback) have no such bound (``char_limit`` is None): their prompts are tokenized
as before. Assumed: the chat template writes each message's content (trimmed or not).
Leaves out: tokenizing (``colocate.assets.tasks.chat_prompt_ids``), the refusal's wording
(``colocate.run.session.tokenize_prompts``).
"""

from __future__ import annotations

import dataclasses
import unicodedata
from collections.abc import Sequence
from typing import Any

import numpy as np

JOINED = 4  # the most characters Unicode normalization composes into one
_NOT_COUNTED = {"Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Cn", "Mn", "Mc", "Me"}
_BMP = 0x10000
_ASCII_DROPPED = bytes([*range(0x21), 0x7F])  # ASCII's controls and space


@dataclasses.dataclass(frozen=True)
class CharLimit:
    """More counted characters than :attr:`chars` is more than ``max_tokens`` tokens."""

    max_tokens: int
    per_token: int  # the most characters one token of the tokenizer stands for

    @property
    def chars(self) -> int:
        return self.max_tokens * self.per_token * JOINED

    def over(self, texts: Sequence[str]) -> int:
        """The counted characters of ``texts`` (a prompt's text or its messages' contents)
        when they are more than :attr:`chars`, else 0. Texts no longer than the limit in
        all are not counted (the common case costs a ``len``)."""
        if sum(map(len, texts)) <= self.chars:
            return 0
        n = sum(counted(t) for t in texts)
        return n if n > self.chars else 0


def char_limit(tokenizer: Any, max_tokens: int) -> CharLimit | None:
    """The bound for a Hugging Face tokenizer (module docstring), None when it has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's: its model says what unknown is
    model = getattr(backend, "model", None)
    if type(model).__name__ != "BPE" or (model.fuse_unk and not model.byte_fallback):
        return None
    vocab = tokenizer.get_vocab()  # added and special tokens too
    return CharLimit(max_tokens, max(1, max(map(len, vocab), default=1)))


def counted(text: str) -> int:
    """How many characters of ``text`` no normalizer or template drops (module docstring)."""
    if text.isascii():  # the quick path: printable ASCII but the space
        return len(text.encode("ascii").translate(None, _ASCII_DROPPED))
    codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    low = codes[codes < _BMP]
    n = int(np.count_nonzero(_bmp_counted()[low]))
    high, times = np.unique(codes[codes >= _BMP], return_counts=True)
    return n + int(sum(k for c, k in zip(high.tolist(), times.tolist()) if _is_counted(c)))


def _is_counted(code: int) -> bool:
    return not chr(code).isspace() and unicodedata.category(chr(code)) not in _NOT_COUNTED


def _bmp_counted() -> np.ndarray:
    """Whether each code point of the Basic Multilingual Plane is counted (65536 looked up: ~30 ms)."""
    return np.fromiter((_is_counted(c) for c in range(_BMP)), dtype=bool, count=_BMP)
