"""Flex attention alone on CUDA (issue 36): compiled forward + backward in bfloat16 over a
packed row's block mask with transformers' kind of score_mod, at row lengths inside and at
whole 128-token blocks; whether it compiles and whether the gradients are finite.
    python3 scripts/gpu_flex_probe.py --lengths 85,256,1025 --heads 2 --kv-heads 1
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def one(n: int, heads: int, kv_heads: int, dim: int, compiled) -> dict:
    torch.manual_seed(0)
    q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    doc = (torch.arange(n, device="cuda") // 40)  # 40-token sequences packed in one row

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    def score_mod(score, b, h, qi, ki):  # transformers passes one (softcap / head mask hooks)
        return score

    started = time.perf_counter()
    try:
        mask = create_block_mask(mask_mod, None, None, n, n, device="cuda")
        out = compiled(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=heads != kv_heads)
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        finite = all(bool(t.grad.isfinite().all()) for t in (q, k, v))
        return {"n": n, "ok": True, "finite_grads": finite, "s": round(time.perf_counter() - started, 1)}
    except Exception as exc:  # noqa: BLE001 - reported, the next length still runs
        return {"n": n, "ok": False, "error": " ".join(str(exc).split())[:300], "s": round(time.perf_counter() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="85,256,1025")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--dim", type=int, default=64)
    a = ap.parse_args()
    compiled = torch.compile(flex_attention)
    for n in (int(x) for x in a.lengths.split(",")):
        print(json.dumps({"heads": a.heads, "kv_heads": a.kv_heads, "dim": a.dim, **one(n, a.heads, a.kv_heads, a.dim, compiled)}),
              flush=True)


if __name__ == "__main__":
    main()
