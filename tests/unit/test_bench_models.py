"""The bench's EOS-prone small actor: random weights that end a response at EOS after a
geometric number of tokens (mean as asked), never at pad or BOS; built once per folder."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from colocate.bench.models import MARKER, eos_prone_actor
from colocate.assets.random_models import TINY_BOS_ID, TINY_EOS_ID, TINY_PAD_ID, build_tiny_causal_lm


@pytest.fixture(scope="module")
def eos_actor(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-models")
    base = build_tiny_causal_lm(root / "base", seed=0, hidden=64, layers=2, heads=4, kv_heads=2)
    return eos_prone_actor(str(base), root, mean_tokens=8)


def test_eos_hazard_is_calibrated_and_the_folder_is_reused(eos_actor):
    folder = Path(eos_actor)
    marker = json.loads((folder / MARKER).read_text())
    assert marker["eos_hazard"] == pytest.approx(1 / 8, rel=0.02) and marker["spec"]["mean_tokens"] == 8
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert eos_prone_actor(marker["spec"]["base"], folder.parent, 8) == eos_actor
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt


def test_sampled_responses_end_at_eos_with_geometric_lengths(eos_actor):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from colocate.assets.tasks import chat_prompt_ids

    tok, model = AutoTokenizer.from_pretrained(eos_actor), AutoModelForCausalLM.from_pretrained(eos_actor).eval()
    prompt = torch.tensor([chat_prompt_ids(tok, "How many legs do 3 spiders have?")] * 32)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=64, do_sample=True, top_k=0, eos_token_id=[TINY_EOS_ID, TINY_PAD_ID],
                             pad_token_id=TINY_PAD_ID)[:, prompt.shape[1]:].tolist()
    lengths = [r.index(TINY_EOS_ID) + 1 if TINY_EOS_ID in r else len(r) for r in out]
    assert all(TINY_PAD_ID not in r[:n] and TINY_BOS_ID not in r[:n] for r, n in zip(out, lengths))
    assert sum(TINY_EOS_ID in r for r in out) >= 30  # EOS ends (nearly) all of them below the cap
    assert 4 <= statistics.fmean(lengths) <= 16 and max(lengths) >= 3 * min(lengths)  # spread, mean ~8
