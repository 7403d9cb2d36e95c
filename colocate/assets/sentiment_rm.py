"""The default reward model of `colocate train`: the first K layers of SmolLM2, distilled from VADER.

Owns: building `<cache>/models/sentiment-rm-k{K}/` once (atomically, with a marker) and
reusing it. The model is a causal `LlamaForSequenceClassification` (one label): the
embeddings, first K decoder layers and final norm of the converted SmolLM2-135M-Instruct,
plus a score head. The embeddings (and the lowest K - T layers, none by default) stay
frozen; the layers above, the norm and the head are fitted (MSE) to VADER's compound
score at every response prefix of the texts of `trainer.distill_data`, so the score read
at the last token — what SGLang's reward engine returns, also for a half-generated
response — tracks VADER. Measured on held-out SmolLM2 answers (Pearson r): a linear head
alone on last-token states 0.3 (K=6) to 0.5 (K=16); K=6 with its top 3 layers fitted
0.65; all layers fitted, K=2: 0.63, K=3: 0.69, K=4: 0.74 (the default).

Training runs every batch as ONE packed sequence: the chat-template prefix shared by all
texts (system prompt and user header) once, then each text's own tokens with their own
positions, under a block-causal mask (each text sees the shared prefix and itself). That
is exact, has no padding, and skips ~1/3 of the tokens.

Left out: serving the model (engine/), PPO (the rest of trainer/), any SGLang import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from colocate.errors import ModelSourceError
from colocate.assets.models import MARKER_NAME, install_atomically, marker_matches, default_cache_dir, prepare_smollm2
from colocate.assets.tasks import sentiment_prompts
from colocate.assets.distill_data import Example, build_examples, generate_responses

MARKER_FORMAT = 1
END_OF_TEXT = "<|endoftext|>"  # the RM's pad token: SmolLM2 pads with EOS, and HF pools the last non-pad


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """How the sentiment reward model is built; every field is part of the cache marker."""

    layers: int = 4  # K: decoder layers kept from SmolLM2 (measured: K=2 r=0.63, 3: 0.69, 4: 0.74)
    trained_layers: int = 4  # top layers fitted; K=6 with only the top 3 fitted reached r=0.65
    n_generated: int = 320  # SmolLM2 answers sampled with HF generate (~130 s on one core)
    counterfactuals: int = 2  # rewrites per answer
    n_template: int = 400  # template sentences
    max_new_tokens: int = 32
    epochs: int = 2  # 3 epochs gave the same held-out r
    lr: float = 4e-4  # layers and norm; the head gets 10x
    batch_size: int = 16
    held_out: float = 0.15  # share of texts (with their rewrites) kept out for the reported correlation
    seed: int = 0

    @property
    def dir_name(self) -> str:
        return f"sentiment-rm-k{self.layers}"


def prepare_sentiment_rm(cache_dir: Path | None = None, *, config: DistillConfig | None = None,
                         base_path: Path | None = None, progress: Callable[[str], object] = print,
                         build: bool = True) -> Path | None:
    """`<cache>/models/sentiment-rm-k{K}/`, built on first use (a few minutes on CPU), then reused.

    `base_path` is the converted SmolLM2 folder (default: `prepare_smollm2(cache_dir)`).
    `build=False`: None instead of building it (`colocate train --check`).
    """
    config = config or DistillConfig()
    base = Path(base_path) if base_path is not None else prepare_smollm2(cache_dir, progress=progress)
    target = (cache_dir or default_cache_dir()) / "models" / config.dir_name
    expected = {"format": MARKER_FORMAT, "base": _base_identity(base), "config": dataclasses.asdict(config)}
    if marker_matches(target, expected):
        return target
    if not build:
        return None
    progress(f"building the sentiment reward model in {target} (once)")
    start = time.perf_counter()

    def build(staging: Path) -> None:
        metrics = build_sentiment_rm(staging, base, config, progress)
        marker = expected | {"metrics": metrics, "seconds": round(time.perf_counter() - start, 1)}
        (staging / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")

    install_atomically(target, build, done=lambda: marker_matches(target, expected))
    progress(f"built the sentiment reward model in {time.perf_counter() - start:.0f} s")
    return target


def _base_identity(base: Path) -> object:
    try:
        return json.loads((base / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return str(base)


def build_sentiment_rm(out: Path, base: Path, config: DistillConfig,
                       progress: Callable[[str], object] = print) -> dict[str, float]:
    """Build, fit, verify and save the reward model into `out`; returns held-out correlations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # on demand: reusing the built folder stays light

    tokenizer = AutoTokenizer.from_pretrained(base)
    lm = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if not 0 < config.trained_layers <= config.layers <= lm.config.num_hidden_layers:
        raise ValueError(f"need 0 < trained_layers <= layers <= {lm.config.num_hidden_layers}, got {config}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        examples = _texts(lm, tokenizer, config, progress)
        backbone = lm.model
        backbone.layers = backbone.layers[: config.layers]
        head = torch.nn.Linear(backbone.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(head.weight)
        train, held = _split(examples, config)
        _fit(backbone, head, train, config, progress)
        metrics = _evaluate(backbone, head, held, config)
    progress("held-out correlation with VADER: " + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items()))
    _export(backbone, head, tokenizer, config, out, check=held[:4])
    return metrics


def _texts(lm, tokenizer, config: DistillConfig, progress) -> list[Example]:  # noqa: ANN001
    started = time.perf_counter()
    pool = sentiment_prompts(seed=config.seed)
    prompts = [pool[i % len(pool)] for i in range(config.n_generated)]
    responses = generate_responses(lm, tokenizer, prompts, config.max_new_tokens)
    progress(f"sampled {len(responses)} SmolLM2 answers in {time.perf_counter() - started:.0f} s")
    return build_examples(tokenizer, list(zip(prompts, responses)), pool, n_template=config.n_template,
                          counterfactuals=config.counterfactuals, max_response_tokens=config.max_new_tokens + 16,
                          seed=config.seed, progress=progress)


def _split(examples: list[Example], config: DistillConfig) -> tuple[list[Example], list[Example]]:
    """Held-out groups (a text with its rewrites); only originals are evaluated, never rewrites."""
    groups = sorted({e.group for e in examples})
    random.Random(config.seed).shuffle(groups)
    held = set(groups[: max(1, round(len(groups) * config.held_out))])
    train = [e for e in examples if e.group not in held]
    return train, [e for e in examples if e.group in held and e.kind != "counterfactual"]


# ---------------------------------------------------------------- packed forward


def shared_prefix(examples: Sequence[Example]) -> int:
    """Length of the token prefix every example starts with (the chat template's opening)."""
    return len(os.path.commonprefix([list(e.ids) for e in examples])) if examples else 0


def packed_forward(backbone, layers: range, hidden: torch.Tensor, segments: Sequence[int], prefix: int) -> torch.Tensor:  # noqa: ANN001
    """Run decoder `layers` of `backbone` over one packed sequence.

    `hidden` [N, H] holds a shared prefix of `prefix` tokens, then segments of the given
    lengths; each segment attends to the prefix and causally to itself, with positions
    continuing from `prefix`. Returns [N, H], equal to running each prefix+segment alone.
    """
    seg_id = torch.cat([torch.full((prefix,), -1)] + [torch.full((n,), i) for i, n in enumerate(segments)])
    pos = torch.cat([torch.arange(prefix)] + [torch.arange(prefix, prefix + n) for n in segments])
    idx = torch.arange(len(seg_id))
    causal = idx[None, :] <= idx[:, None]  # [N, N]
    mask = causal & ((seg_id[None, :] == -1) | (seg_id[None, :] == seg_id[:, None]))
    h = hidden[None]  # [1, N, H]
    position_ids = pos[None]
    embeddings = backbone.rotary_emb(h, position_ids=position_ids)
    for i in layers:
        h = backbone.layers[i](h, attention_mask=mask[None, None], position_embeddings=embeddings,
                               position_ids=position_ids)
    return h[0]


def _frozen_states(backbone, examples: list[Example], prefix_ids: list[int], frozen: int, batch: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Hidden states after the frozen layers for each example's own tokens (past the shared prefix); [0] is the prefix."""
    prefix = len(prefix_ids)
    if frozen == 0:
        return [torch.tensor(prefix_ids)] + [torch.tensor(e.ids[prefix:]) for e in examples]
    out = []
    with torch.no_grad():
        for start in range(0, len(examples), batch):
            chunk = examples[start : start + batch]
            ids = torch.tensor(prefix_ids + [t for e in chunk for t in e.ids[prefix:]])
            h = packed_forward(backbone, range(frozen), backbone.embed_tokens(ids), [len(e.ids) - prefix for e in chunk], prefix)
            if not out:
                out.append(h[:prefix])
            out.extend(torch.split(h[prefix:], [len(e.ids) - prefix for e in chunk]))
    return out


def _scores(backbone, head, config: DistillConfig, prefix_state: torch.Tensor, states: list[torch.Tensor]) -> torch.Tensor:  # noqa: ANN001
    """[N] reward head outputs over the packed sequence (prefix, then each example's tokens).

    With no frozen layers the "states" are token ids, embedded here."""
    hidden = torch.cat([prefix_state, *states])
    if hidden.dtype == torch.long:
        hidden = backbone.embed_tokens(hidden)
    top = range(config.layers - config.trained_layers, config.layers)
    h = packed_forward(backbone, top, hidden, [len(s) for s in states], len(prefix_state))
    return head(backbone.norm(h))[:, 0]


def _targets(examples: list[Example], prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed indices, VADER targets and weights of a batch (same layout as `_scores`)."""
    index, target, weight, offset = [], [], [], prefix
    for e in examples:
        for position, value, w in e.targets:
            index.append(offset + position - prefix)
            target.append(value)
            weight.append(w)
        offset += len(e.ids) - prefix
    return torch.tensor(index), torch.tensor(target), torch.tensor(weight)


# ---------------------------------------------------------------- fit, evaluate, export


def _fit(backbone, head, examples: list[Example], config: DistillConfig, progress) -> None:  # noqa: ANN001
    started = time.perf_counter()
    prefix = shared_prefix(examples)
    frozen = config.layers - config.trained_layers
    states = _frozen_states(backbone, examples, list(examples[0].ids[:prefix]), frozen, config.batch_size * 2)
    prefix_state, states = states[0], states[1:]
    trained = [p for i in range(frozen, config.layers) for p in backbone.layers[i].parameters()]
    trained += list(backbone.norm.parameters())
    trained_ids = {id(p) for p in trained}
    for p in backbone.parameters():
        p.requires_grad_(id(p) in trained_ids)
    optimizer = torch.optim.AdamW([{"params": trained, "lr": config.lr},
                                   {"params": head.parameters(), "lr": config.lr * 10}], weight_decay=0.0)
    order = list(range(len(examples)))
    steps = config.epochs * -(-len(order) // config.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    for epoch in range(config.epochs):
        random.Random(config.seed + epoch).shuffle(order)
        total = 0.0
        for start in range(0, len(order), config.batch_size):
            batch = order[start : start + config.batch_size]
            scores = _scores(backbone, head, config, prefix_state, [states[i] for i in batch])
            index, target, weight = _targets([examples[i] for i in batch], prefix)
            loss = (weight * (scores[index] - target) ** 2).sum() / weight.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            total += loss.item() * len(batch)
        progress(f"epoch {epoch + 1}/{config.epochs}: loss {total / len(order):.4f} "
                 f"({time.perf_counter() - started:.0f} s)")
    for p in [*backbone.parameters(), *head.parameters()]:
        p.requires_grad_(False)


def _final_scores(backbone, head, examples: list[Example], config: DistillConfig) -> list[float]:  # noqa: ANN001
    """Each example's score at its last token, as the reward engine reads it."""
    prefix = shared_prefix(examples)
    states = _frozen_states(backbone, examples, list(examples[0].ids[:prefix]), config.layers - config.trained_layers,
                            config.batch_size * 2)
    out = []
    with torch.no_grad():
        for start in range(0, len(examples), config.batch_size):
            chunk = states[1 + start : 1 + start + config.batch_size]
            scores = _scores(backbone, head, config, states[0], chunk)
            ends = torch.cumsum(torch.tensor([len(s) for s in chunk]), 0) + prefix - 1
            out += scores[ends].tolist()
    return out


def _evaluate(backbone, head, held: list[Example], config: DistillConfig) -> dict[str, float]:  # noqa: ANN001
    """Pearson r of final scores with VADER on held-out texts: generated answers, templates, both."""
    predicted = _final_scores(backbone, head, held, config)
    truth = [e.targets[-1][1] for e in held]
    metrics = {}
    for name, kinds in (("generated", {"generated"}), ("template", {"template"}), ("all", {"generated", "template"})):
        pairs = [(p, t) for p, t, e in zip(predicted, truth, held) if e.kind in kinds]
        if len(pairs) > 2:
            metrics[name] = round(pearson(*zip(*pairs)), 4)
    return metrics


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of two equal-length sequences (0.0 when either is constant)."""
    a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    a, b = a - a.mean(), b - b.mean()
    denominator = (a.norm() * b.norm()).item()
    return float((a @ b).item() / denominator) if denominator > 0 else 0.0


def _export(backbone, head, tokenizer, config: DistillConfig, out: Path, check: list[Example]) -> None:  # noqa: ANN001
    """Save as `LlamaForSequenceClassification` (+ tokenizer padding with <|endoftext|>); check it reloads and agrees."""
    from transformers import LlamaForSequenceClassification  # on demand, as above

    pad_id = tokenizer.convert_tokens_to_ids(END_OF_TEXT)
    if not isinstance(pad_id, int) or pad_id == tokenizer.eos_token_id:
        raise ModelSourceError(f"base tokenizer has no {END_OF_TEXT} token distinct from EOS to pad the reward model with")
    rm_config = backbone.config.__class__.from_dict(backbone.config.to_dict())
    rm_config.update({"num_hidden_layers": config.layers, "num_labels": 1, "pad_token_id": pad_id,
                      "architectures": ["LlamaForSequenceClassification"], "tie_word_embeddings": False, "use_cache": False})
    rm = LlamaForSequenceClassification(rm_config).to(torch.float32).eval()
    rm.model.load_state_dict(backbone.state_dict())
    rm.score.load_state_dict(head.state_dict())
    tokenizer.pad_token = END_OF_TEXT
    rm.save_pretrained(out)
    tokenizer.save_pretrained(out)
    reloaded = LlamaForSequenceClassification.from_pretrained(out, dtype=torch.float32).eval()
    expected = _final_scores(backbone, head, check, config)
    with torch.no_grad():
        got = [reloaded(torch.tensor([e.ids])).logits[0, 0].item() for e in check]
    if max((abs(a - b) for a, b in zip(got, expected)), default=0.0) > 1e-4:
        raise ModelSourceError(f"saved reward model scores {got} but the fitted model scores {expected}")
