"""Actor engine start time and decode throughput vs HF ``generate``, same batch, same machine.

    python -m colocate.bench.engine_throughput --batch 16 --new-tokens 128 --repeats 3
    python -m colocate.bench.engine_throughput --attention-backend torch_native \
        --attention-backend colocate_cpu --dtype bfloat16 --no-hf     # two engines, A/B

Runs SGLang (one engine per ``--attention-backend``; none given: the machine's default)
and HF alternately (interleaved repeats) on the same prompts, greedy, fixed length (EOS
ignored), and prints tokens/s as median [min–max] plus the ratios to the first engine
and to HF. Measure on a quiet machine: nothing else busy on the cores.
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
    from colocate.rollout import generate_and_score
    from colocate.rollout.sample import Sample

    samples = [Sample(i, p, n) for i, p in enumerate(prompts)]
    t = time.perf_counter()
    engine.loop.run_until_complete(
        generate_and_score.generate(engine, samples, {"temperature": 0.0, "ignore_eos": True}, f"bt{int(t*1e3) % 10**8:08d}"))
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
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--attention-backend", action="append", default=[],
                    help="SGLang attention backend of one engine (repeat to compare; default: the machine's)")
    ap.add_argument("--no-hf", action="store_true", help="time the engines only")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from colocate.assets.model_aliases import model_aliases
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    path = str(model_aliases()[args.model]()) if args.model in model_aliases() else args.model
    tok = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(tok, args.batch)
    backends = args.attention_backend or [None]
    engines = {}
    try:
        for backend in backends:
            engines[backend] = SglangEngine(EngineConfig(path, role="actor", dtype=args.dtype, attention_backend=backend))
            _sglang_once(engines[backend], prompts[:2], 8)  # warm-up
        model = None if args.no_hf else AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        sgl: dict = {b: [] for b in backends}
        hf = []
        for _ in range(args.repeats):
            for backend, engine in engines.items():
                sgl[backend].append(_sglang_once(engine, prompts, args.new_tokens))
            if model is not None:
                hf.append(_hf_once(model, tok, prompts, args.new_tokens))
    finally:
        for engine in engines.values():
            engine.shutdown()
    first = backends[0]
    report = {"engine_start_s": {str(b): round(e.start_seconds, 2) for b, e in engines.items()}, "batch": args.batch,
              "new_tokens": args.new_tokens, "dtype": args.dtype, "torch_threads": torch.get_num_threads(),
              "sglang_tok_s": {str(b): v for b, v in sgl.items()}, "hf_tok_s": hf}
    print(json.dumps(report))
    for backend, tps in sgl.items():
        line = f"{backend or 'default'}: engine start {engines[backend].start_seconds:.1f} s | SGLang {_spread(tps)} tok/s"
        if backend != first:
            line += f" | /{first} {_spread([a / b for a, b in zip(tps, sgl[first])])}x"
        if hf:
            line += f" | /HF generate {_spread([a / b for a, b in zip(tps, hf)])}x"
        print(line)
    if hf:
        print(f"HF generate {_spread(hf)} tok/s")


if __name__ == "__main__":
    main()
