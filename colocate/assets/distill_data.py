"""Training texts for the distilled sentiment reward model, labelled by VADER.

Owns: what the reward model is taught on. (a) SmolLM2-Instruct's own sampled answers
to the sentiment prompts (what the actor will produce at the start of training),
(b) counterfactual copies of them with their sentiment words swapped or a short
opinion added (natural contexts with other labels), and (c) template sentences over
strong positive, negative and neutral words of the VADER lexicon (coverage). Every
text is a chat-formatted prompt plus response token ids, as the reward engine sees
them, labelled with VADER's compound score at every response prefix (the engine reads
the score at the last token, also while a response is still being generated).

Left out: the model and its training (trainer/reward_distill), VADER itself
(colocate.assets.tasks.vader_reward).
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable
from typing import Any

import torch
import vader.data.lexicon as lexicon

from colocate.assets.tasks import chat_prompt_ids, vader_reward

POSITIVE = (
    "wonderful amazing excellent fantastic great lovely delightful beautiful brilliant superb outstanding "
    "perfect awesome charming pleasant enjoyable fun happy joyful cheerful friendly comfortable impressive "
    "gorgeous marvelous fabulous nice good"
).split()
NEGATIVE = (
    "terrible awful horrible dreadful disgusting miserable boring disappointing ugly nasty annoying painful "
    "sad depressing frustrating rude dirty useless pathetic bad poor unpleasant stressful scary broken lousy tragic"
).split()
NEUTRAL = (
    "ordinary blue wooden large quiet small square typical usual average plain brown tall modern old new round "
    "regular standard simple"
).split()
NOUNS = "food view room staff music weather price story service design".split()
TEMPLATES = (
    "It was {a}.", "Honestly, the whole thing was {a}.", "I found it {a} and {b}.",
    "The {n} was {a}, and the {m} was {b}.", "What a {a} experience!", "It was not {a} at all.",
    "The {n} was {a} but the {m} was {b}.", "It is really {a}, I would say.",
    "Overall a {a} {n} and a {b} {m}.", "I think the {n} is {a}.",
)
LEXICON_MIN_VALENCE = 1.0  # lexicon words drawn for templates/swaps: |valence| at least this
SWAP_OTHER_WORDS = 0.06  # share of non-lexicon words also swapped in a counterfactual copy
FINAL_WEIGHT = 4.0  # loss weight of a whole response vs. one of its prefixes


@dataclasses.dataclass(frozen=True)
class Example:
    """Chat prompt + response ids with VADER targets at response positions.

    `targets` holds (position, VADER score of the response up to and including that
    token, loss weight); `group` ties counterfactual copies to their original so a
    held-out split keeps them together.
    """

    ids: tuple[int, ...]
    targets: tuple[tuple[int, float, float], ...]
    group: int
    kind: str  # generated | counterfactual | template


class TextMaker:
    """Seeded source of template sentences and counterfactual rewrites (its own RNG, no globals)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.lexicon = lexicon.LEXICON
        self.strong = sorted(
            w for w, v in self.lexicon.items() if w.isalpha() and len(w) > 3 and abs(v) >= LEXICON_MIN_VALENCE
        )

    def word(self) -> str:
        """A curated adjective (positive, negative or neutral) or, half the time, any strong lexicon word."""
        if self.rng.random() < 0.5:
            return self.rng.choice(self.strong)
        return self.rng.choice(self.rng.choice([POSITIVE, NEGATIVE, NEUTRAL]))

    def template(self) -> str:
        words = {"a": self.word(), "b": self.word(), "n": self.rng.choice(NOUNS), "m": self.rng.choice(NOUNS)}
        return self.rng.choice(TEMPLATES).format(**words)

    def counterfactual(self, text: str, variant: int) -> str:
        """Even variants swap sentiment words for random ones; odd ones add a template sentence."""
        if variant % 2 == 1:
            return f"{self.template()} {text}" if self.rng.random() < 0.5 else f"{text} {self.template()}"

        def swap(match: re.Match) -> str:
            word = match.group(0)
            if abs(self.lexicon.get(word.lower(), 0.0)) >= LEXICON_MIN_VALENCE or self.rng.random() < SWAP_OTHER_WORDS:
                return self.word()
            return word

        return re.sub(r"[A-Za-z']+", swap, text)


def generate_responses(model: Any, tokenizer: Any, prompts: list[str], max_new_tokens: int,
                       batch_size: int = 32) -> list[list[int]]:
    """Sampled answers (temperature 1, no top-k/top-p), cut after the first EOS, which is kept."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out = []
    for start in range(0, len(prompts), batch_size):
        rows = [chat_prompt_ids(tokenizer, p) for p in prompts[start : start + batch_size]]
        width = max(map(len, rows))
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            new = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad)[:, width:]
        for row in new.tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def make_example(tokenizer: Any, prompt: str, response: list[int], group: int, kind: str) -> Example:
    """`prompt` chat-formatted + `response`, with a VADER target after every response token."""
    prompt_ids = chat_prompt_ids(tokenizer, prompt)
    targets = []
    for end in range(1, len(response) + 1):
        text = tokenizer.decode(response[:end], skip_special_tokens=True)
        weight = FINAL_WEIGHT if end == len(response) else 1.0
        targets.append((len(prompt_ids) + end - 1, vader_reward(text), weight))
    return Example(tuple(prompt_ids + list(response)), tuple(targets), group, kind)


def build_examples(tokenizer: Any, generated: list[tuple[str, list[int]]], template_prompts: list[str], *,
                   n_template: int, counterfactuals: int, max_response_tokens: int, seed: int,
                   progress: Callable[[str], object] = print) -> list[Example]:
    """(prompt, answer ids) pairs, `counterfactuals` rewrites of each, and `n_template` template sentences.

    A rewrite ends with EOS when its original does; a template half the time (as an
    unfinished response has none); templates answer prompts drawn from `template_prompts`.
    """
    maker = TextMaker(seed)
    eos = tokenizer.eos_token_id
    examples = []
    for group, (prompt, response) in enumerate(generated):
        examples.append(make_example(tokenizer, prompt, response, group, "generated"))
        text = tokenizer.decode(response, skip_special_tokens=True)
        ends = [eos] if response[-1:] == [eos] else []
        for variant in range(counterfactuals):
            ids = tokenizer(maker.counterfactual(text, variant), add_special_tokens=False).input_ids
            examples.append(make_example(tokenizer, prompt, ids[:max_response_tokens] + ends, group, "counterfactual"))
    for i in range(n_template):
        ids = tokenizer(maker.template(), add_special_tokens=False).input_ids
        ends = [eos] if maker.rng.random() < 0.5 else []
        prompt = maker.rng.choice(template_prompts)
        examples.append(make_example(tokenizer, prompt, ids + ends, len(generated) + i, "template"))
    progress(f"labelled {len(examples)} texts with VADER ({sum(len(e.targets) for e in examples)} targets)")
    return examples
