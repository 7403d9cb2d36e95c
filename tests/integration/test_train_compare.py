"""bench.train_phases --compare on CPU (tiny shape): padded vs packed trainer vs the plain
PyTorch loop on the same long-tailed batches, reported as ratios with their spread."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import torch

from colocate.bench.train_phases import response_lengths, synthetic_batch


def test_lognormal_lengths_have_a_capped_long_tail():
    lengths = response_lengths(4000, 256, "lognormal", torch.Generator().manual_seed(0))
    assert min(lengths) >= 1 and max(lengths) == 256
    assert 56 <= sorted(lengths)[len(lengths) // 2] <= 72  # median R / 4
    batch = synthetic_batch(16, 64, 256, 300, seed=0, lengths="lognormal")
    assert batch.response_mask.sum(-1).tolist() != [256] * 16


def test_compare_reports_packed_padded_and_plain(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "colocate.bench.train_phases", "--device", "cpu", "--shape", "tiny", "--batch", "4",
           "--prompt-tokens", "4", "--response-tokens", "24", "--lengths", "lognormal", "--compare",
           "--steps", "1", "--warmup", "0", "--set", "ppo.epochs=1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "train_phases.json").read_text())
    c = result["comparison"]
    for key in ("padded", "packed", "plain", "speedup_packed_vs_padded", "overhead_packed_vs_plain"):
        assert c[key]["min"] <= c[key]["median"] <= c[key]["max"] and math.isfinite(c[key]["median"]), key
    assert c["padded_per_real_tokens"]["median"] >= 1
    [step] = result["steps"]
    assert set(step["modes"]) == {"padded", "packed", "plain"}
    assert all(math.isfinite(v) for v in step["modes"]["padded"]["losses"].values())
    assert "packed vs padded" in (out / "train_phases.md").read_text()
