"""Actor engine start time and decode throughput vs HF ``generate``, same batch, same machine.

    python -m colocate.bench.engine_throughput --batch 16 --new-tokens 128 --repeats 3

Runs SGLang and HF alternately (interleaved repeats) on the same prompts, greedy, fixed
length (EOS ignored), and prints tokens/s as median [min–max] plus the ratio.
Measure on a quiet machine: nothing else busy on the cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _prompts(tokenizer, batch: int) -> list[list[int]]:
    topics = ["the sea", "a city at night", "old books", "coffee", "mountains", "rain", "music",
              "a train ride", "gardens", "winter", "bridges", "markets", "clocks", "bicycles",
              "the moon", "bread"]
    out = []
    for i in range(batch):
        msgs = [{"role": "user", "content": f"Write a short paragraph about {topics[i % len(topics)]}."}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def _sglang_once(engine, prompts, n) -> float:
    from colocate.rollout import generation
    from colocate.rollout.sample import Sample

    samples = [Sample(i, p, n) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    engine.loop.run_until_complete(
        generation.generate(engine, samples, {"temperature": 0.0, "ignore_eos": True}, f"bt{int(t*1e3) % 10**8:08d}"))
    took = time.perf_counter() - t
    engine.flush_cache()
    return sum(len(s.output_ids) for s in samples) / took


def _hf_once(model, tokenizer, prompts, n) -> float:
    import torch

    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=pad)
    took = time.perf_counter() - t
    return (out.shape[1] - width) * len(prompts) / took


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}–{max(xs):.1f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from colocate.assets.model_aliases import model_aliases
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    path = str(model_aliases()[args.model]()) if args.model in model_aliases() else args.model
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(tok, args.batch)
    engine = SglangEngine(EngineConfig(path, role="actor"))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _sglang_once(engine, prompts[:2], 8)  # warm-up
    sgl, hf = [], []
    try:
        for _ in range(args.repeats):
            sgl.append(_sglang_once(engine, prompts, args.new_tokens))
            hf.append(_hf_once(model, tok, prompts, args.new_tokens))
    finally:
        engine.shutdown()
    ratios = [a / b for a, b in zip(sgl, hf)]
    report = {"engine_start_s": round(engine.start_seconds, 2), "batch": args.batch,
              "new_tokens": args.new_tokens, "torch_threads": torch.get_num_threads(),
              "sglang_tok_s": sgl, "hf_tok_s": hf, "ratio": ratios}
    print(json.dumps(report))
    print(f"engine start {engine.start_seconds:.1f} s | SGLang {_spread(sgl)} tok/s | "
          f"HF generate {_spread(hf)} tok/s | SGLang/HF {_spread(ratios)}x")


if __name__ == "__main__":
    main()
