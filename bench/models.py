"""The bench's own small models: random weights, real shapes, built once per folder.

Owns: the small random Llama actor and reward model of the ``quick`` preset (throughput
mechanics without the cost of real weights), and an EOS-prone variant of that actor for
the ``reasoning`` workload: a random model spreads its probability evenly over the 259
tokens of the tiny tokenizer, so it ends a response at EOS about once in 259 tokens and
nearly every response would run to the cap. The variant points the EOS row of the LM
head along the mean direction of the model's final hidden states (in a random model they
are nearly parallel, cosine ~0.94), scaled so that every position ends the response with
probability ~1/mean_tokens: geometric response lengths decided by EOS, as with a real
instruct model, for colocate and TRL alike. The pad and BOS rows point the other way, so
the model never samples them (colocate also stops at pad; TRL stops at EOS only).
The ``gpu`` preset's pair instead: a random actor of a real model's shape
(``colocate.assets.random_models.MODEL_SHAPES``, e.g. Qwen2.5-0.5B) and a random reward model of
the same shape (:func:`shaped_models`).
Leaves out: real models (``colocate.assets.models``), rewards.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MARKER = "bench_eos.json"


def small_models(root: Path) -> tuple[str, str]:
    """A small random Llama actor and reward model (SmolLM2-like width, few layers):
    throughput mechanics without the cost of real weights. Built once per folder."""
    from colocate.assets.random_models import build_tiny_causal_lm, build_tiny_reward_model

    actor, rm = root / "small-actor", root / "small-rm"
    if not (actor / "config.json").is_file():
        build_tiny_causal_lm(actor, seed=0, hidden=256, layers=4, heads=8, kv_heads=4, max_positions=2048)
    if not (rm / "config.json").is_file():
        build_tiny_reward_model(rm, seed=1, hidden=256, layers=4, heads=8, kv_heads=4, max_positions=2048)
    return str(actor), str(rm)


def shaped_models(root: Path, shape: str) -> tuple[str, str]:
    """A random actor of ``shape`` (a ``MODEL_SHAPES`` name) and a random one-label reward
    model of the same shape (the actor's size, as in OPPO's runs). Built once per folder."""
    from colocate.assets.random_models import build_shaped_causal_lm, build_shaped_reward_model

    actor, rm = Path(root) / f"actor-{shape}", Path(root) / f"rm-{shape}"
    if not (actor / "config.json").is_file():
        build_shaped_causal_lm(actor, shape, seed=0)
    if not (rm / "config.json").is_file():
        build_shaped_reward_model(rm, shape, seed=1)
    return str(actor), str(rm)


def eos_prone_actor(base: str, root: Path, mean_tokens: int) -> str:
    """``base`` (a random tiny-tokenizer actor) with an EOS hazard of ~1/``mean_tokens`` per
    token, in ``root/small-actor-eos<mean_tokens>``; built once, reused while its marker matches."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(root) / f"small-actor-eos{mean_tokens}"
    marker = {"base": str(base), "mean_tokens": mean_tokens}
    if (out / MARKER).is_file() and json.loads((out / MARKER).read_text()).get("spec") == marker:
        return str(out)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    hidden = _final_hidden_states(model, tokenizer)
    direction = hidden.mean(0) / hidden.mean(0).norm()
    head = model.get_output_embeddings().weight  # [V, H]
    with torch.no_grad():
        for tid in {tokenizer.pad_token_id, tokenizer.bos_token_id} - {None, tokenizer.eos_token_id}:
            head[tid] = -direction  # logit ~ -|h| (about -15): never sampled
        scale = _calibrate(hidden, head, direction, tokenizer.eos_token_id, 1.0 / mean_tokens)
        head[tokenizer.eos_token_id] = scale * direction
        hazard = _eos_hazard(hidden, head, tokenizer.eos_token_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(json.dumps({"spec": marker, "scale": scale, "eos_hazard": hazard}, indent=1))
    return str(out)


def _final_hidden_states(model, tokenizer, prompts: int = 4, tokens: int = 64) -> torch.Tensor:
    """Final-norm hidden states at the positions of a few sampled responses: [N, H]."""
    from colocate.assets.tasks import chat_prompt_ids

    ids = torch.tensor([chat_prompt_ids(tokenizer, "Answer the question and explain your reasoning step by step.")])
    states = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(prompts):
            seq = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_k=0,
                                 pad_token_id=tokenizer.pad_token_id)
            states.append(model.model(seq).last_hidden_state[0, ids.shape[1] - 1:])
    return torch.cat(states)


def _eos_hazard(hidden: torch.Tensor, head: torch.Tensor, eos: int) -> float:
    """Mean probability of EOS over the sampled positions."""
    return float(torch.softmax(hidden @ head.T, dim=-1)[:, eos].mean())


def _calibrate(hidden: torch.Tensor, head: torch.Tensor, direction: torch.Tensor, eos: int,
               target: float) -> float:
    """The scale s of ``direction`` as EOS row that gives a mean EOS probability of ``target``
    (bisection: the probability grows with s, since every hidden state leans along it)."""
    lo, hi = 0.0, 4.0
    for _ in range(40):
        mid = (lo + hi) / 2
        head[eos] = mid * direction
        lo, hi = (mid, hi) if _eos_hazard(hidden, head, eos) < target else (lo, mid)
    return (lo + hi) / 2
