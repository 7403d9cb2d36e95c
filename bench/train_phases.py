"""The training half of a PPO step on one device, measured: phase times and what offload frees.

    python -m colocate.bench.train_phases --device cuda --shape smollm2-135m --out runs/train-phases
    torchrun --nproc_per_node 2 -m colocate.bench.train_phases --device cuda ...   # one rank per GPU

Runs the trainer's part of colocate's step (``colocate.run.loop``) in the loop's order on
random-weight models of a named shape (``colocate.assets.random_models.MODEL_SHAPES``; weights do not
change a step's time or memory) and synthetic rollouts of a fixed shape:
onload -> ref -> old_logp -> values -> advantages -> critic -> actor -> sync_gather (the
FSDP all-gather of the actor's full weights into host memory, as the weight sync does
before the trainer is offloaded; the push into SGLang is not part of it) -> offload.
PPO settings are the config's defaults (``--set ppo.epochs=1`` etc. to change them).

``--compare`` runs the same batches, step by step in turn, through the right-padded
trainer (``ppo.packing=false``), the packed one (``ppo.packing=true``) and a plain-PyTorch
loop over the same packed micro-batches (transformers models without FSDP: the same
forwards, backwards and AdamW steps, no PPO bookkeeping): it reports packed vs padded
time and the packed trainer's overhead over the plain loop, each as a per-step ratio with
its spread. ``--lengths lognormal`` draws response lengths from a lognormal (median
response-tokens / 4, sigma 1) capped at ``--response-tokens``: a long tail, as from
rollouts that end at EOS. The issue's measurement (SmolLM2 shape, batch 16, cap 256):

    python -m colocate.bench.train_phases --device cpu --shape smollm2-135m --batch 16 \
        --response-tokens 256 --lengths lognormal --compare --steps 3 --warmup 1 --out runs/train-compare

On CUDA it also reports the device memory the trainer holds before and after offload,
the device's free memory before and after, and each step's peak. It needs no SGLang: it
is how the CUDA FSDP path is checked where SGLang's CUDA build is not installed.
Writes ``train_phases.json`` and ``train_phases.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from colocate.quick_exit import skip_last_collection

PHASES = ("onload", "ref", "old_logp", "values", "advantages", "critic", "actor", "sync_gather", "offload")
GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Options:
    device: str = "cuda"
    shape: str = "smollm2-135m"
    model: str | None = None  # an HF folder instead of a random shape
    dtype: str | None = None  # compute dtype; default bfloat16 on CUDA, float32 on CPU
    batch: int = 16
    prompt_tokens: int = 64
    response_tokens: int = 128
    steps: int = 3
    warmup: int = 1
    seed: int = 0
    host_offload: str = "pinned"  # or "pageable": module.to("cpu") each step
    sets: tuple[str, ...] = ()
    out: str | None = None
    lengths: str = "even"  # response lengths: "even" over [R / 2, R], or "lognormal" (median R / 4, sigma 1, cap R)
    compare: bool = False  # padded vs packed trainer vs a plain-PyTorch loop, step by step in turn
    old_logp_pass: bool = False  # every row's old log-probs in the no-grad pass (as before `first_forward`)


def response_lengths(rows: int, response_tokens: int, kind: str, g: torch.Generator) -> list[int]:
    """even: spread over [R / 2, R] (the longest exactly R); lognormal: median R / 4, sigma 1, in [1, R]."""
    if kind == "lognormal":
        z = torch.randn(rows, generator=g, dtype=torch.float64)
        return [int(min(response_tokens, max(1, round(response_tokens / 4 * math.exp(x))))) for x in z.tolist()]
    return [response_tokens - (response_tokens // 2) * i // max(rows, 1) for i in range(rows)]


def synthetic_batch(rows: int, prompt_tokens: int, response_tokens: int, vocab: int, seed: int,
                    lengths: str = "even", group_size: int = 1):
    """Rollouts of random prompts (each `prompt_tokens`) and responses of
    `response_lengths(kind=lengths)`, in groups of `group_size` consecutive rows that share
    their prompt (as a group's samples of one prompt do)."""
    from colocate.trainer.batch import make_batch

    g = torch.Generator().manual_seed(seed)
    lengths = response_lengths(rows, response_tokens, lengths, g)
    n = max(group_size, 1)
    distinct = [torch.randint(3, vocab, (prompt_tokens,), generator=g).tolist() for _ in range(-(-rows // n))]
    prompts = [distinct[i // n] for i in range(rows)]
    responses = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    scores = torch.randn(rows, generator=g).tolist()
    return make_batch(prompts, responses, 0, scores, [[-1.0] * n for n in lengths], [[0] * n for n in lengths],
                      [i // group_size for i in range(rows)])


class _Clock:
    """Wall seconds per named phase, synchronising the device around each."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        self._sync()
        start = time.perf_counter()
        out = fn()
        self._sync()
        self.seconds[name] = time.perf_counter() - start
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _memory(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_gib": torch.cuda.memory_allocated(device) / GIB,
            "reserved_gib": torch.cuda.memory_reserved(device) / GIB,
            "device_free_gib": free / GIB, "device_total_gib": total / GIB}


def one_step(trainer, batch, kl_coef: float, device: torch.device, old_logp_pass: bool = False) -> dict[str, Any]:
    """The trainer phases of one loop step, timed; on CUDA with the memory around offload.
    A critic-free estimator (``ppo.advantage``): no values and no critic phase (0 s). As in
    the loop, the actor's first minibatch takes its old log-probs from its own forward where
    the settings allow (`old_logp_from_first_forward`), unless `old_logp_pass`."""
    clock = _Clock(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    critic_free = trainer.critic is None
    clock("onload", trainer.onload)
    ref = clock("ref", lambda: trainer.ref_logprobs(batch))
    first = trainer.settings.old_logp_from_first_forward and not old_logp_pass
    old = clock("old_logp", lambda: trainer.old_logprobs(batch, current_version=0, leave_first=first))
    values = clock("values", lambda: None if critic_free else trainer.values(batch))
    adv, returns, _, _ = clock("advantages", lambda: trainer.advantages(batch, old, ref, values, kl_coef))
    critic = clock("critic", lambda: {} if critic_free else trainer.train_critic(batch, values, returns))
    actor = clock("actor", lambda: trainer.train_actor(batch, old, adv, 0, ref_logp=ref, kl_coef=kl_coef,
                                                        fill_first=first))
    full = clock("sync_gather", trainer.actor_state_for_sync)
    before = _memory(device)
    peak = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    clock("offload", trainer.offload)
    after = _memory(device)
    losses = {"value_loss": critic.get("value_loss"), "policy_loss": actor.get("policy_loss")}
    return {"seconds": clock.seconds, "memory_before_offload": before, "memory_after_offload": after,
            "peak_allocated_gib": peak, "gathered_tensors": len(full), "losses": losses}


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def measure(opts: Options, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the trainer, run warmup + timed steps, and summarise (on every rank; rank 0 logs)."""
    import torch.distributed as tdist

    from colocate.run.builder import make_trainer
    from colocate.config import load_config
    from colocate.assets.random_models import build_shaped_causal_lm
    from colocate.trainer.distributed import init_distributed

    dist = init_distributed(opts.device)
    dtype = opts.dtype or ("bfloat16" if dist.device.type == "cuda" else "float32")
    cfg = load_config(None, [f"models.dtype={dtype}", f"rollout.batch_size={opts.batch}",
                             f"engines.host_offload={opts.host_offload}", *opts.sets])
    with tempfile.TemporaryDirectory(prefix="colocate-train-phases-") as tmp:
        path = opts.model
        if path is None:
            path = str(Path(tmp) / opts.shape)
            if dist.is_main:
                log(f"building a random {opts.shape} model in {path}")
                build_shaped_causal_lm(path, opts.shape, seed=opts.seed)
            if dist.world_size > 1:  # every rank loads the folder rank 0 wrote (one node)
                box = [path]
                tdist.broadcast_object_list(box, src=0)
                path = box[0]
        start = time.perf_counter()
        trainer = make_trainer(cfg, path, path, dist)
        build_s = time.perf_counter() - start
        from colocate.bench.train_compare import PlainLoop, compare_step, comparison

        plain = PlainLoop.load(path, cfg, trainer.settings.token_budget) if opts.compare else None
    vocab = trainer.actor.config.vocab_size
    params = sum(p.numel() for p in trainer.actor.parameters())  # this rank's shard
    steps = []
    for i in range(opts.warmup + opts.steps):
        batch = synthetic_batch(opts.batch, opts.prompt_tokens, opts.response_tokens, vocab, opts.seed + i,
                                opts.lengths, cfg.rollout.group_size)
        if plain is not None:
            rec = compare_step(trainer, plain, batch, cfg.ppo.kl_coef, dist.device)
        else:
            rec = one_step(trainer, batch, cfg.ppo.kl_coef, dist.device, opts.old_logp_pass)
        rec["warmup"] = i < opts.warmup
        rec["tokens_computed"], rec["tokens_samples"] = trainer.pass_tokens(batch)  # one pass's tokens
        steps.append(rec)
        if dist.is_main:
            total = sum(rec["seconds"].values())
            log(f"step {i + 1}/{opts.warmup + opts.steps}{' (warm-up)' if rec['warmup'] else ''}: "
                f"{total:.2f} s " + " ".join(f"{k} {v:.2f}" for k, v in rec["seconds"].items())
                + "".join(f" | {m} {sum(r['seconds'].values()):.2f} s" for m, r in rec.get("modes", {}).items()))
    timed = [s for s in steps if not s["warmup"]] or steps
    phases = {p: _spread([s["seconds"][p] for s in timed]) for p in PHASES}
    phases["total"] = _spread([sum(s["seconds"].values()) for s in timed])
    return {
        "options": dataclasses.asdict(opts), "dtype": dtype, "world_size": dist.world_size,
        "device": torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "cpu",
        "torch": torch.__version__, "actor_params_per_rank": params, "build_s": build_s,
        "ppo": {"epochs": cfg.ppo.epochs, "minibatches": cfg.ppo.minibatches},
        "host_offload": cfg.engines.host_offload, "pinned_host_gib": trainer.stash.pinned_bytes / GIB,
        "phases": phases, "steps": steps, "comparison": comparison(timed) if plain is not None else None,
        # training state (parameters, gradients, optimizer moments) this rank holds, the
        # elements one weight sync pushes (LoRA: the adapted linears), the process's peak RSS
        "train_state_mb": trainer.state_mb(), "sync_mparams": trainer.sync_numel() / 1e6,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "lora": dataclasses.asdict(cfg.lora), "gradient_checkpointing": cfg.ppo.gradient_checkpointing,
        "attention": trainer.settings.attn_implementation, "shared_prefix": trainer.settings.shares_prefix,
        "old_logp_from_first_forward": trainer.settings.old_logp_from_first_forward and not opts.old_logp_pass,
    }


def markdown(result: dict[str, Any]) -> str:
    o = result["options"]
    name = o["model"] or o["shape"]
    lines = [
        f"## Trainer phases: {name} on {result['device']} (world {result['world_size']}, {result['dtype']})",
        "",
        f"batch {o['batch']} x ({o['prompt_tokens']} prompt + up to {o['response_tokens']} response tokens), "
        f"PPO {result['ppo']['epochs']} epochs x {result['ppo']['minibatches']} minibatches, "
        f"{len([s for s in result['steps'] if not s['warmup']])} timed steps after {o['warmup']} warm-up; "
        f"actor parameters {result['actor_params_per_rank'] / 1e6:.1f} M per rank; torch {result['torch']}; "
        f"offload to {result['host_offload']} host memory"
        + (f" ({result['pinned_host_gib']:.1f} GiB pinned)" if result["pinned_host_gib"] else ""),
        "",
        "| phase | median s | min–max s |",
        "| --- | ---: | ---: |",
    ]
    for phase, s in result["phases"].items():
        lines.append(f"| {phase} | {s['median']:.3f} | {s['min']:.3f}–{s['max']:.3f} |")
    lora = result["lora"]
    lines += ["", f"LoRA {'rank ' + str(lora['rank']) + ' on ' + lora['target_modules'] if lora['rank'] else 'off'}, "
              f"gradient checkpointing {'on' if result['gradient_checkpointing'] else 'off'}: training state "
              f"{result['train_state_mb']:.0f} MiB, {result['sync_mparams']:.1f} M parameters pushed per sync, "
              f"peak resident memory {result['peak_rss_gib']:.2f} GiB (the process, build included)",
              "", f"attention {result['attention']}, shared prefix {'on' if result['shared_prefix'] else 'off'}: "
              f"{sum(s['tokens_computed'] for s in result['steps']) / len(result['steps']):.0f} tokens per pass "
              f"computed for {sum(s['tokens_samples'] for s in result['steps']) / len(result['steps']):.0f} "
              f"sample tokens (mean over steps); the actor's first minibatch's old log-probs "
              + ("from its own forward" if result.get("old_logp_from_first_forward") else "in the no-grad pass")]
    last = result["steps"][-1]
    before, after = last["memory_before_offload"], last["memory_after_offload"]
    if before:
        lines += [
            "",
            "| device memory (GiB, last step) | before offload | after offload | freed |",
            "| --- | ---: | ---: | ---: |",
        ]
        for key, label in (("allocated_gib", "allocated by torch"), ("reserved_gib", "reserved by torch"),
                           ("device_free_gib", "free on the device")):
            delta = after[key] - before[key] if key == "device_free_gib" else before[key] - after[key]
            lines.append(f"| {label} | {before[key]:.2f} | {after[key]:.2f} | {delta:.2f} |")
        lines.append(f"| peak allocated during the step | {last['peak_allocated_gib']:.2f} | | |")
    if result.get("comparison"):
        from colocate.bench.train_compare import comparison_lines

        lines += comparison_lines(result["comparison"])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from colocate.assets.random_models import MODEL_SHAPES

    ap = argparse.ArgumentParser(prog="python -m colocate.bench.train_phases", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    ap.add_argument("--device", default=d.device, choices=["cuda", "cpu"])
    ap.add_argument("--shape", default=d.shape, choices=sorted(MODEL_SHAPES))
    ap.add_argument("--model", default=None, help="an HF model folder to use instead of a random --shape")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batch", type=int, default=d.batch)
    ap.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    ap.add_argument("--response-tokens", type=int, default=d.response_tokens)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--warmup", type=int, default=d.warmup)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--host-offload", default=d.host_offload, choices=["pinned", "pageable"],
                    help="CUDA offload into reused pinned buffers, or module.to('cpu') each step")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (ppo.*, models.dtype, ...); repeatable")
    ap.add_argument("--out", default=None, help="folder for train_phases.json and train_phases.md")
    ap.add_argument("--lengths", default=d.lengths, choices=["even", "lognormal"],
                    help="response lengths: even over [R/2, R], or lognormal (median R/4, sigma 1) capped at R")
    ap.add_argument("--compare", action="store_true",
                    help="padded vs packed trainer vs a plain-PyTorch loop on the same batches, in turn")
    ap.add_argument("--old-logp-pass", action="store_true",
                    help="every row's old log-probs in the no-grad pass, none from the actor's first forward")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here; use --device cpu")
    for field in ("batch", "prompt_tokens", "response_tokens", "steps"):
        if getattr(a, field) < 1:
            ap.error(f"--{field.replace('_', '-')} must be at least 1")
    opts = Options(a.device, a.shape, a.model, a.dtype, a.batch, a.prompt_tokens, a.response_tokens, a.steps,
                   a.warmup, a.seed, a.host_offload, tuple(a.sets), a.out, a.lengths, a.compare,
                   a.old_logp_pass)
    result = measure(opts)
    import torch.distributed as tdist

    if tdist.get_rank() == 0:
        text = markdown(result)
        print(text)
        if opts.out:
            out = Path(opts.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "train_phases.json").write_text(json.dumps(result, indent=1))
            (out / "train_phases.md").write_text(text)
    tdist.destroy_process_group()


if __name__ == "__main__":
    skip_last_collection()
    main()
