"""A LoRA actor's weight sync two ways, measured: the merged push vs SGLang's own LoRA serving.

    python -m colocate.bench.lora_sync --shape smollm2-135m --rank 16 --repeats 5 --out runs/lora-sync

On a random-weight model of the shape (``colocate.assets.random_models.MODEL_SHAPES``; or ``--model``) with
the trainer's PEFT adapters (``colocate.trainer.lora``, all-linear by default), every
repeat draws new adapter values (A and B non-zero) and syncs them into an engine:

* ``merged``: an ordinary actor engine; the merged weights W + alpha/r * B @ A of the
  adapted linears pushed in buckets through ``colocate.run.weight_sync.sync`` (the trainer's
  path: merge, cut, ``SglangEngine.update_weights``);
* ``lora_serving``: an engine started with LoRA (``colocate.engine.lora_serving``; the
  torch_native kernels on CPU, SGLang's default csgmv on CUDA); the adapter tensors
  themselves loaded under one name, the previous copy unloaded first. On a machine without
  CUDA, SGLang 0.5.23's LoRA layers cannot start (they pin host memory): the mode then
  reports that error (``lora_serving.check_pinned_memory``).

Per sync: seconds (from the trainer's tensors to the engine's reply), tensor bytes sent,
and the latency of a one-token request right after (SGLang copies an adapter into its
batch memory pool at the first request that names it). Per mode: generate tokens/s of a
fixed batch (``--prompts`` x ``--new-tokens``, greedy, EOS ignored, prefill included)
after every sync, and whether the last sync's greedy tokens equal HF transformers' greedy
tokens on the PEFT-merged model (and on the unmerged PEFT model, base + B @ A as a side
path, the way SGLang's LoRA kernels compute it). A mode that fails is reported with its
error. ``--device cuda`` runs both engines on the GPU (HF references stay on CPU).
Writes ``lora_sync.json`` and ``lora_sync.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ADAPTER = "actor"  # the adapter's name in the LoRA-serving engine
MAX_TOTAL_TOKENS = 8192  # the KV pool: the generate batch fits many times over
BUCKET_MB = 64  # engines.sync_bucket_mb's default


def randomize(peft_model, seed: int, b_std: float) -> None:
    """New adapter values: A ~ N(0, 1/in), B ~ N(0, b_std^2) (B non-zero, unlike PEFT's init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)


def merged_state(peft_model, scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """What the trainer pushes for a LoRA actor: the merged adapted linears, HF-named."""
    from colocate.trainer.lora import adapted_weight, merged_weights

    return merged_weights(((n, t) for n, t in peft_model.state_dict().items() if adapted_weight(n)), scaling)


def adapter_tensors(peft_model) -> dict[str, torch.Tensor]:
    """The adapter as PEFT saves it (``...q_proj.lora_A.weight``): what a LoRA engine loads."""
    from peft import get_peft_model_state_dict

    return {n: t.detach().clone().contiguous() for n, t in get_peft_model_state_dict(peft_model).items()}


def adapter_config(peft_model) -> dict[str, Any]:
    cfg = peft_model.peft_config["default"]
    return {"peft_type": "LORA", "r": cfg.r, "lora_alpha": cfg.lora_alpha, "target_modules": targets(peft_model),
            "bias": "none", "use_dora": False, "use_rslora": False}


def targets(peft_model) -> list[str]:
    """The adapted linears' names (PEFT resolves all-linear to full module paths; SGLang wants the last part)."""
    return sorted({t.rsplit(".", 1)[-1] for t in peft_model.peft_config["default"].target_modules})


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def counting(named: Iterator[tuple[str, torch.Tensor]], sizes: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` as it is, each tensor's bytes appended to ``sizes`` as it passes."""
    for name, tensor in named:
        sizes.append(nbytes([tensor]))
        yield name, tensor


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF greedy continuations, one prompt at a time (no padding)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
    return out


def agreement(got: list[list[int]], want: list[list[int]]) -> dict[str, Any]:
    """Prompts whose tokens are all equal, and per prompt the tokens equal before the first difference."""
    prefix = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w))) for g, w in zip(got, want)]
    return {"prompts_equal": sum(g == w for g, w in zip(got, want)), "prompts": len(want), "equal_prefix": prefix}


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_mode(mode: str, path: str, peft_model, opts: argparse.Namespace, prompts: list[list[int]],
             probe: list[int], log: Callable[[str], None]) -> dict[str, Any]:
    """Start the mode's engine, then per repeat: new adapter values, sync, probe, generate."""
    from colocate.run import weight_sync
    from colocate.engine import lora_serving
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    scaling = opts.alpha / opts.rank
    engine_kw = {"device": opts.device, "max_total_tokens": MAX_TOTAL_TOKENS}
    started = time.perf_counter()
    if mode == "merged":
        engine, lora = SglangEngine(EngineConfig(path, role="actor", **engine_kw)), None
    else:
        served = lora_serving.start(path, opts.rank, targets(peft_model), **engine_kw)
        engine, lora = served.engine, ADAPTER
    rec: dict[str, Any] = {"engine_start_s": time.perf_counter() - started, "syncs": []}
    try:
        base = lora_serving.greedy(engine, prompts, opts.new_tokens)  # warm-up; the base model's tokens
        for i in range(opts.repeats):
            randomize(peft_model, opts.seed + 1 + i, opts.b_std)
            t = time.perf_counter()
            if mode == "merged":
                sent: list[int] = []
                weight_sync.sync(engine, counting(merged_state(peft_model, scaling), sent), version=i + 1,
                                 bucket_mb=BUCKET_MB)
                sent_bytes = sum(sent)
            else:
                tensors = adapter_tensors(peft_model)
                served.load(ADAPTER, tensors, adapter_config(peft_model))
                sent_bytes = nbytes(tensors.values())
            sync_s = time.perf_counter() - t
            t = time.perf_counter()
            lora_serving.greedy(engine, [probe], 1, lora=lora)
            probe_s = time.perf_counter() - t
            t = time.perf_counter()
            out = lora_serving.greedy(engine, prompts, opts.new_tokens, lora=lora)
            gen_s = time.perf_counter() - t
            tok_s = sum(map(len, out)) / gen_s
            rec["syncs"].append({"sync_s": sync_s, "bytes": sent_bytes, "first_token_s": probe_s, "tok_s": tok_s})
            log(f"{mode} sync {i + 1}/{opts.repeats}: {sync_s:.3f} s, {sent_bytes / 2**20:.1f} MiB, "
                f"first token {probe_s:.3f} s, generate {tok_s:.1f} tok/s")
        rec["tokens"], rec["base_tokens"] = out, base
    finally:
        engine.shutdown()
    return rec


def summary(rec: dict[str, Any], refs: dict[str, list[list[int]]]) -> dict[str, Any]:
    syncs = rec["syncs"]
    return {
        "engine_start_s": rec["engine_start_s"],
        "sync_s": spread([s["sync_s"] for s in syncs]),
        "bytes_per_sync": syncs[0]["bytes"],
        "first_token_s": spread([s["first_token_s"] for s in syncs]),
        "tok_s": spread([s["tok_s"] for s in syncs]),
        "vs_hf": {name: agreement(rec["tokens"], want) for name, want in refs.items()},
        "prompts_changed_by_adapter": sum(a != b for a, b in zip(rec["tokens"], rec["base_tokens"])),
        "syncs": syncs,
    }


def markdown(result: dict[str, Any]) -> str:
    o = result["options"]
    lines = [f"# LoRA sync: merged push vs SGLang LoRA serving ({o['model'] or o['shape']}, {o['device']})",
             "", f"rank {o['rank']}, alpha {o['alpha']}, targets {', '.join(result['targets'])}; "
             f"{o['repeats']} syncs per mode; generate: {o['prompts']} prompts x {o['new_tokens']} new tokens, "
             f"greedy; torch threads {result['torch_threads']}; SGLang {result['sglang']}",
             *([o["note"]] if o["note"] else []), "",
             "| mode | sync s median [min-max] | MiB per sync | first token after sync s | generate tok/s "
             "median [min-max] | = HF merged (prompts, equal prefix) | = HF PEFT unmerged | engine start s |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, r in result["modes"].items():
        if "error" in r:
            lines.append(f"| {mode} | failed: {r['error']} | | | | | | |")
            continue
        f = lambda s, p=3: f"{s['median']:.{p}f} [{s['min']:.{p}f}-{s['max']:.{p}f}]"  # noqa: E731
        hf = {k: f"{v['prompts_equal']}/{v['prompts']} ({v['equal_prefix']})" for k, v in r["vs_hf"].items()}
        lines.append(f"| {mode} | {f(r['sync_s'])} | {r['bytes_per_sync'] / 2**20:.2f} | {f(r['first_token_s'])} | "
                     f"{f(r['tok_s'], 1)} | {hf['merged']} | {hf['peft_unmerged']} | {r['engine_start_s']:.1f} |")
    lines += ["", "Prompts whose greedy tokens the adapter changed (vs the engine's base output): "
              + ", ".join(f"{m} {r['prompts_changed_by_adapter']}/{o['prompts']}"
                          for m, r in result["modes"].items() if "error" not in r), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from colocate.assets.random_models import MODEL_SHAPES

    ap = argparse.ArgumentParser(prog="python -m colocate.bench.lora_sync", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(MODEL_SHAPES))
    ap.add_argument("--model", default=None, help="an HF model folder instead of a random --shape")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="the engines' device")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--targets", default="all-linear", help="PEFT target modules: all-linear or q_proj,v_proj,...")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--b-std", type=float, default=0.05, help="std of the random lora_B values")
    ap.add_argument("--modes", default="merged,lora_serving")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for lora_sync.json and lora_sync.md")
    ap.add_argument("--note", default="", help="a line for lora_sync.md (how this run differs)")
    opts = ap.parse_args(argv)
    if opts.rank < 1 or opts.repeats < 1:
        ap.error("--rank and --repeats must be at least 1")

    from transformers import AutoModelForCausalLM

    from colocate.assets.random_models import build_shaped_causal_lm
    from colocate.trainer.lora import add_lora
    from colocate.trainer.sections import LoraConfig

    with tempfile.TemporaryDirectory(prefix="colocate-lora-sync-") as tmp:
        path = opts.model or str(build_shaped_causal_lm(Path(tmp) / opts.shape, opts.shape, seed=opts.seed))
        lora = LoraConfig(rank=opts.rank, alpha=opts.alpha, target_modules=opts.targets)
        peft_model = add_lora(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), lora).eval()
        vocab = peft_model.config.vocab_size
        g = torch.Generator().manual_seed(opts.seed)
        prompts = [torch.randint(3, vocab, (opts.prompt_tokens,), generator=g).tolist() for _ in range(opts.prompts)]
        probe = torch.randint(3, vocab, (opts.prompt_tokens,), generator=g).tolist()

        # the references: the last repeat's adapter, merged (what the trainer's sync serves) and unmerged
        randomize(peft_model, opts.seed + opts.repeats, opts.b_std)
        refs = {"peft_unmerged": hf_greedy(peft_model, prompts, opts.new_tokens),
                "merged": hf_greedy(copy.deepcopy(peft_model).merge_and_unload(), prompts, opts.new_tokens)}
        print(f"HF references done ({opts.prompts} prompts x {opts.new_tokens} tokens, merged and unmerged)")

        modes: dict[str, Any] = {}
        for mode in opts.modes.split(","):
            try:
                modes[mode] = summary(run_mode(mode, path, peft_model, opts, prompts, probe, print), refs)
            except Exception as exc:  # a mode that fails is a finding: record it, run the other
                modes[mode] = {"error": " ".join(f"{type(exc).__name__}: {exc}".split())[:600],
                               "traceback": traceback.format_exc()}
                print(f"{mode} failed: {modes[mode]['error']}")
    from importlib.metadata import version

    result = {"options": vars(opts), "targets": targets(peft_model), "torch_threads": torch.get_num_threads(),
              "sglang": version("sglang"), "modes": modes}
    md = markdown(result)
    print(md)
    if opts.out:
        out = Path(opts.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "lora_sync.json").write_text(json.dumps(result, indent=1))
        (out / "lora_sync.md").write_text(md)


if __name__ == "__main__":
    main()
