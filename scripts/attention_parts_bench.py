"""One layer's shared-prefix attention, fwd + bwd, on CPU: the segment's whole block of the
[N, N] mask (the varlen sdpa path before 6f03441) against part by part
(`PackedRows.prefix_blocks`, today's), SmolLM2's heads (9 query, 3 key/value, dim 64).

    python scripts/attention_parts_bench.py                       # 2 groups, 4 x 180-310 after 119
    LENS=40,64,90,126 SEGS=4 python scripts/attention_parts_bench.py

Prints the largest output and gradient difference and min/median/max ms of 15 interleaved
runs each; compare minima and medians (a few runs' medians were bimodal here).
"""

from __future__ import annotations

import os
import time

import torch

from colocate.trainer.packed import PackedRows, visible
from colocate.trainer.varlen_attention import varlen_sdpa_forward

H, HKV, D, PROMPT = 9, 3, 64, 119
ROUNDS = 15  # the medians of a few runs are bimodal at these sizes (46 vs 74 ms for one computation)


def main() -> None:
    torch.manual_seed(0)
    lens = [int(x) for x in os.environ.get("LENS", "180,256,310,220").split(",")]
    segments = int(os.environ.get("SEGS", "2"))
    one_seg = [0] * PROMPT + [k + 1 for k, n in enumerate(lens) for _ in range(n)]
    part = torch.tensor(one_seg * segments)
    segment = torch.arange(segments).repeat_interleave(len(one_seg))
    n = len(part)
    index = torch.arange(n)
    mask = visible(segment, part, index[:, None], index[None])[None, None]
    bounds = [len(one_seg) * s for s in range(segments + 1)]
    row = PackedRows(input_ids=torch.zeros(1, n, dtype=torch.long), position_ids=index[None], keep=index,
                     targets=index, response_mask=torch.ones(1, 1, dtype=torch.bool),
                     cu_seq_lens=torch.tensor(bounds, dtype=torch.int32), segment=segment, part=part, shared=True)
    blocks = row.prefix_blocks()
    module = torch.nn.Module()

    def whole_block(q, k, v):
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], attn_mask=mask[:, :, a:b, a:b])
            for a, b in zip(bounds, bounds[1:])], 2)

    def by_part(q, k, v):
        return varlen_sdpa_forward(module, q, k, v, None, shared_prefix_blocks=blocks)[0].transpose(1, 2)

    q = torch.randn(1, H, n, D, requires_grad=True)
    k, v = (torch.randn(1, HKV, n, D, requires_grad=True) for _ in range(2))
    a, b = whole_block(q, k, v), by_part(q, k, v)
    grads = [torch.autograd.grad(x.square().sum(), (q, k, v)) for x in (a, b)]
    print(f"N {n}: max |output diff| {(a - b).abs().max().item():.2e}, max |grad diff| "
          f"{max((x - y).abs().max().item() for x, y in zip(*grads)):.2e}")
    runs = {"whole block": whole_block, "by part": by_part}
    times = {name: [] for name in runs}
    for _ in range(ROUNDS):  # interleaved: a slow spell of the machine hits both
        for name, fn in runs.items():
            start = time.perf_counter()
            fn(q, k, v).sum().backward()
            times[name].append(time.perf_counter() - start)
    for name, ts in times.items():
        ts = sorted(ts)
        print(f"{name:12s} fwd+bwd ms min/median/max {ts[0] * 1e3:.1f} / {ts[len(ts) // 2] * 1e3:.1f} / {ts[-1] * 1e3:.1f}")


if __name__ == "__main__":
    main()
