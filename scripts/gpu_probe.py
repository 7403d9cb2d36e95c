"""SGLang's engine alone, before colocate's loop: start, generate, release, re-fill the freed
memory, resume, push weights (tensor list and flattened bucket: CUDA-IPC handles on a GPU),
and greedy tokens against HF transformers on the pushed weights.

Part of scripts/gpu_engine_check.sh (its first stage; adapted from the GPU engine kit's
probe). Writes ``$OUT/probe.json`` after every step, so a cut-off run still reports.

    python scripts/gpu_probe.py --device cuda --backends torch_native,triton
    python scripts/gpu_probe.py --device cpu --shape tiny --backends torch_native   # dry run

Random weights of a real model's shape (no weights can travel to the GPU machine): model A
is served first; after release → fill → resume the engine gets A again (tensor list, then
flattened bucket; its greedy tokens must not change), then model B (seed 1) as one
flattened bucket, whose greedy tokens are compared with HF ``generate`` on B in the same
dtype. Where they differ, HF's logit margin at the first difference tells a near-tie
(bf16 rounding picks either token) from a wrong weight.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

GIB = 2**30


class Report:
    def __init__(self, out: Path) -> None:
        self.path, self.t0 = out / "probe.json", time.time()
        out.mkdir(parents=True, exist_ok=True)
        self.data: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "steps": []}

    def log(self, step: str, **kw) -> None:
        kw.update(step=step, t=round(time.time() - self.t0, 1))
        self.data["steps"].append(kw)
        print("PROBE", json.dumps(kw, default=str)[:1500], flush=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

    def step(self, name: str, fn, **kw):
        t = time.time()
        try:
            out = fn()
            self.log(name, ok=True, s=round(time.time() - t, 2), **kw, **(out or {}))
            return True
        except Exception as exc:  # later steps may still report
            self.log(name, ok=False, s=round(time.time() - t, 2), error=repr(exc)[:2000],
                     tb=traceback.format_exc()[-3000:])
            return False


def free_gib(device: str) -> float | None:
    return round(torch.cuda.mem_get_info()[0] / GIB, 3) if device == "cuda" else None


def prompts(vocab: int) -> list[list[int]]:
    """Four prompts of 5, 17, 64 and 200 tokens (ids past the tiny tokenizer's specials)."""
    top = min(vocab, 49000) - 3
    return [[1] + [(37 * i + 11 * n) % top + 3 for i in range(n)] for n in (5, 17, 64, 200)]


def hf_check(path: str, ids: list[list[int]], engine_out: list[list[int]], dtype, device: str) -> dict:
    """HF greedy on ``path`` per prompt, compared token by token with the engine's; at the
    first difference, HF's logit margin of its own token over the engine's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    rows = []
    with torch.no_grad():
        for prompt, got in zip(ids, engine_out):
            x = torch.tensor([prompt], device=device)
            ref = model.generate(x, max_new_tokens=len(got), do_sample=False, min_new_tokens=len(got),
                                 pad_token_id=0)[0, len(prompt):].tolist()
            same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(got))
            row = {"prompt_len": len(prompt), "equal_prefix": same, "n": len(got)}
            if same < len(got):  # teacher-forced on the engine's own tokens up to the difference
                logits = model(torch.tensor([prompt + got[:same]], device=device)).logits[0, -1].float()
                row["hf_margin_at_first_difference"] = round(float(logits[ref[same]] - logits[got[same]]), 4)
                row["logit_std"] = round(float(logits.std()), 4)
            rows.append(row)
    del model
    return {"rows": rows, "min_equal_prefix": min(r["equal_prefix"] for r in rows)}


def run_backend(rep: Report, backend: str, a: str, b: str, device: str, dtype: str, vocab: int) -> None:
    import sglang as sgl
    from safetensors.torch import load_file
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    S: dict = {}
    ids = prompts(vocab)
    n_new = 24
    greedy = {"max_new_tokens": n_new, "temperature": 0.0, "ignore_eos": True}
    sample = {"max_new_tokens": n_new, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "ignore_eos": True}
    cuda = device == "cuda"
    tdtype = getattr(torch, dtype)

    def start():
        before = free_gib(device)
        kw = dict(model_path=a, dtype=dtype, attention_backend=backend, disable_cuda_graph=True,
                  skip_tokenizer_init=True, random_seed=0, log_level="warning", max_total_tokens=16384)
        if cuda:
            kw.update(device="cuda", sampling_backend="pytorch", enable_memory_saver=True,
                      mem_fraction_static=0.3, bf16_gemm_backend="torch")
        else:
            kw.update(device="cpu", mem_fraction_static=0.5)
        S["eng"] = sgl.Engine(**kw)
        S["held"] = (before - free_gib(device)) if cuda else None
        return {"free_before": before, "free_after": free_gib(device), "held_gib": S["held"]}
    if not rep.step(f"{backend}:start", start):
        return
    eng = S["eng"]

    def gen(tag, params):
        def f():
            t = time.perf_counter()
            out = eng.generate(input_ids=ids, sampling_params=params)
            S[tag] = [o["output_ids"] for o in out]
            return {"lens": [len(x) for x in S[tag]], "first": S[tag][0][:8],
                    "tok_per_s": round(sum(len(x) for x in S[tag]) / (time.perf_counter() - t), 1)}
        return f
    rep.step(f"{backend}:generate_greedy", gen("g0", greedy))
    rep.step(f"{backend}:generate_sample", gen("s0", sample))
    if cuda:
        def release():
            before = free_gib(device)
            eng.release_memory_occupation()
            after = free_gib(device)
            grab = max(0.0, after - before - 0.25)  # "training" in the freed memory
            x = torch.empty(int(grab * GIB), dtype=torch.uint8, device="cuda")
            x.fill_(1)
            del x
            torch.cuda.empty_cache()
            freed = round(after - before, 3)
            return {"free_before": before, "free_after": after, "freed_gib": freed, "grabbed_gib": round(grab, 3),
                    "freed_frac_of_held": round(freed / S["held"], 3) if S["held"] else None}
        rep.step(f"{backend}:release", release)

        def resume():
            before = free_gib(device)
            eng.resume_memory_occupation()
            return {"free_before": before, "free_after": free_gib(device)}
        rep.step(f"{backend}:resume", resume)
    dev = "cuda" if cuda else "cpu"
    named_a = [(k, v.to(dev, tdtype)) for k, v in load_file(os.path.join(a, "model.safetensors")).items()]
    named_b = [(k, v.to(dev, tdtype)) for k, v in load_file(os.path.join(b, "model.safetensors")).items()]
    mb = round(sum(v.numel() * v.element_size() for _, v in named_a) / 2**20, 1)

    def push(named, flat):
        def f():
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            eng.begin_weight_update()
            if flat:
                bucket = FlattenedTensorBucket(named_tensors=named)
                data = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
                r = eng.update_weights_from_tensor([MultiprocessingSerializer.serialize(data)],
                                                   load_format="flattened_bucket")
            else:
                r = eng.update_weights_from_tensor(named)
            eng.end_weight_update()
            return {"result": str(r)[:200], "push_s": round(time.perf_counter() - t, 3), "mb": mb}
        return f
    rep.step(f"{backend}:push_tensor_list", push(named_a, False))
    rep.step(f"{backend}:push_flattened_bucket", push(named_a, True))
    rep.step(f"{backend}:generate_greedy_after_sleep_wake_push", gen("g1", greedy))
    rep.log(f"{backend}:greedy_unchanged_after_sleep_wake_push", same=S.get("g0") == S.get("g1"))
    rep.step(f"{backend}:push_model_b_flattened", push(named_b, True))
    if rep.step(f"{backend}:generate_greedy_model_b", gen("gb", greedy)):
        rep.step(f"{backend}:hf_greedy_model_b", lambda: hf_check(b, ids, S["gb"], tdtype, dev))
    rep.step(f"{backend}:shutdown", lambda: eng.shutdown())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="smollm2-135m")
    ap.add_argument("--backends", default="torch_native,triton")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-probe"))
    ap.add_argument("--work", default="/tmp/gpu-probe-models")
    args = ap.parse_args(argv)
    from colocate.assets.random_models import MODEL_SHAPES, build_shaped_causal_lm
    from colocate.engine import sglang_api

    rep = Report(Path(args.out))
    sglang_api.prepare(args.device)  # as colocate does: the CPU switch and stand-in where needed
    rep.log("device", name=torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
            free=free_gib(args.device))
    a, b = f"{args.work}/a", f"{args.work}/b"
    rep.step("make_models", lambda: [build_shaped_causal_lm(p, args.shape, seed=s) for p, s in ((a, 0), (b, 1))] and None)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    for backend in [x for x in args.backends.split(",") if x]:
        run_backend(rep, backend, a, b, args.device, dtype, MODEL_SHAPES[args.shape][-1])
    rep.log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
