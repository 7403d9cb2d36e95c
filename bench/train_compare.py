"""``python -m colocate.bench.train_phases --compare``: padded vs packed trainer vs plain PyTorch.

Owns: :class:`PlainLoop` (the trainer's passes as a plain-PyTorch loop over the same packed
micro-batches: transformers models without FSDP, no PPO bookkeeping), :func:`compare_step`
(one step of each mode on the same batch), :func:`comparison` (per-step ratios with their
spread) and the report's comparison lines.
Leaves out: the phase measurement and the command line (``colocate.bench.train_phases``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from colocate.bench.train_phases import _Clock, _spread, one_step

TRAIN_PHASES = ("ref", "old_logp", "values", "advantages", "critic", "actor")  # what the modes compare


@dataclasses.dataclass
class PlainLoop:
    """The trainer's passes in plain PyTorch: transformers models without FSDP, the same packed
    micro-batches (`first_fit_decreasing` + `pack`) and attention (`VARLEN_SDPA`), forward + backward + clip + AdamW, and
    no PPO bookkeeping (a stand-in loss: the mean log-prob or value)."""

    actor: torch.nn.Module
    critic: torch.nn.Module
    optims: tuple[torch.optim.Optimizer, torch.optim.Optimizer]
    budget: int
    epochs: int
    minibatches: int

    @classmethod
    def load(cls, path: str, cfg, budget: int) -> PlainLoop:
        from transformers import AutoModelForCausalLM

        from colocate.trainer.critic import ValueModel
        from colocate.trainer.varlen_attention import register_varlen_sdpa

        attn = register_varlen_sdpa()  # the packed trainer's attention on CPU
        actor = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
        critic = ValueModel.from_pretrained(path, attn_implementation=attn).eval()
        optims = (torch.optim.AdamW(actor.parameters(), lr=1e-6), torch.optim.AdamW(critic.parameters(), lr=1e-6))
        return cls(actor, critic, optims, budget, cfg.ppo.epochs, cfg.ppo.minibatches)

    def step(self, batch) -> dict[str, float]:
        """Seconds of {no_grad (2 policy + 1 value forward), critic, actor} over `batch`."""
        from colocate.trainer.packed import pack
        from colocate.trainer.packing import first_fit_decreasing

        def micro(rows: torch.Tensor) -> list:
            bins = first_fit_decreasing(batch.attention_mask[rows].sum(-1).tolist(), self.budget)
            return [pack(batch.select(rows[torch.tensor(b)])) for b in bins]

        def logp(p) -> torch.Tensor:
            logits = self.actor(input_ids=p.input_ids, position_ids=p.position_ids, use_cache=False,
                                logits_to_keep=p.keep, **p.attention_kwargs()).logits[0]  # [n, V]
            return torch.log_softmax(logits.float(), -1).gather(-1, p.targets[:, None])  # [n, 1]

        def value(p) -> torch.Tensor:
            return self.critic(p.input_ids, None, position_ids=p.position_ids, **p.attention_kwargs())[0, p.keep]  # [n]

        def train(fn, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
            g = torch.Generator().manual_seed(0)
            for _ in range(self.epochs):
                for idx in batch.minibatches(self.minibatches, g):
                    for p in micro(idx):
                        fn(p).mean().backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optim.step()
                    optim.zero_grad(set_to_none=True)

        clock = _Clock(torch.device("cpu"))
        with torch.no_grad():
            clock("no_grad", lambda: [fn(p) for fn in (logp, logp, value) for p in micro(torch.arange(batch.size))])
        clock("critic", lambda: train(value, self.critic, self.optims[1]))
        clock("actor", lambda: train(logp, self.actor, self.optims[0]))
        return clock.seconds


def compare_step(trainer, plain: PlainLoop, batch, kl_coef: float, device: torch.device) -> dict[str, Any]:
    """One step of each: the padded trainer, the packed trainer, the plain loop (same batch).

    One trainer, its settings switched between the two: a step's time does not depend on
    the weights' values, and two SmolLM2 trainers do not fit beside each other in the
    memory of our 2-core machines.
    """
    base = trainer.settings
    modes = {}
    for name, packing in (("padded", False), ("packed", True)):
        trainer.settings = dataclasses.replace(base, ppo=dataclasses.replace(base.ppo, packing=packing))
        modes[name] = one_step(trainer, batch, kl_coef, device)
    trainer.settings = base
    modes["plain"] = {"seconds": plain.step(batch)}
    used = batch.attention_mask
    tokens = {"real": int(used.sum()), "padded": int(used.numel()),
              "response_real": int(batch.response_mask.sum()), "response_padded": int(batch.response_mask.numel())}
    return {**modes["packed"], "modes": modes, "tokens": tokens}


def comparison(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step trainer seconds of each mode, packed vs padded and packed vs plain ratios, tokens/s."""
    def trainer_s(step: dict[str, Any], mode: str) -> float:
        seconds = step["modes"][mode]["seconds"]
        return sum(seconds.get(p, 0.0) for p in TRAIN_PHASES) if mode != "plain" else sum(seconds.values())

    out = {mode: _spread([trainer_s(s, mode) for s in steps]) for mode in ("padded", "packed", "plain")}
    out["speedup_packed_vs_padded"] = _spread([trainer_s(s, "padded") / trainer_s(s, "packed") for s in steps])
    out["overhead_packed_vs_plain"] = _spread([trainer_s(s, "packed") / trainer_s(s, "plain") - 1 for s in steps])
    out["tokens_per_s"] = {mode: _spread([s["tokens"]["real"] / trainer_s(s, mode) for s in steps])
                           for mode in ("padded", "packed", "plain")}
    out["padded_per_real_tokens"] = _spread([s["tokens"]["padded"] / s["tokens"]["real"] for s in steps])
    out["padded_per_real_response_tokens"] = _spread(
        [s["tokens"]["response_padded"] / s["tokens"]["response_real"] for s in steps])
    return out



def comparison_lines(c: dict[str, Any]) -> list[str]:
    def cell(s: dict[str, float], fmt: str) -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"

    lines = [
        "",
        "Trainer phases (ref, old_logp, values, advantages, critic, actor) per step, same batches in turn; "
        f"padded/real tokens {cell(c['padded_per_real_tokens'], '.2f')}, "
        f"response tokens only {cell(c['padded_per_real_response_tokens'], '.2f')}.",
        "",
        "| trainer | seconds, median (min–max) | real tokens/s |",
        "| --- | ---: | ---: |",
    ]
    for mode in ("padded", "packed", "plain"):
        label = "plain PyTorch loop (no FSDP)" if mode == "plain" else f"{mode} (FSDP)"
        lines.append(f"| {label} | {cell(c[mode], '.2f')} | {cell(c['tokens_per_s'][mode], '.0f')} |")
    overhead = {k: 100 * v for k, v in c["overhead_packed_vs_plain"].items()}
    lines += [
        "",
        f"packed vs padded: {cell(c['speedup_packed_vs_padded'], '.2f')}x faster; "
        f"packed trainer over the plain loop: {cell(overhead, '+.0f')} %",
    ]
    return lines
