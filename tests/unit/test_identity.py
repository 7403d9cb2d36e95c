"""Fingerprints (``colocate.assets.identity``): a model folder's, equal for a copy of the
folder wherever it is, different for other weights, another config or another tokenizer;
a data file's or folder's, equal for a copy, different for other bytes; None for what is
no model folder or no data path."""

from __future__ import annotations

import json
import shutil

from colocate.assets.identity import data_fingerprint, fingerprint
from colocate.assets.random_models import build_tiny_causal_lm


def test_a_copy_is_the_same_model_and_other_files_are_not(tmp_path):
    a = build_tiny_causal_lm(tmp_path / "a", seed=5)
    shutil.copytree(a, tmp_path / "moved" / "a2")
    assert fingerprint(a) == fingerprint(tmp_path / "moved" / "a2") is not None
    assert fingerprint(build_tiny_causal_lm(tmp_path / "b", seed=6)) != fingerprint(a)  # other weights, one shape
    config = json.loads((tmp_path / "moved" / "a2" / "config.json").read_text())
    (tmp_path / "moved" / "a2" / "config.json").write_text(json.dumps({**config, "rope_theta": 1234.0}))
    assert fingerprint(tmp_path / "moved" / "a2") != fingerprint(a)
    shutil.copytree(a, tmp_path / "c")
    (tmp_path / "c" / "tokenizer.json").write_text((tmp_path / "c" / "tokenizer.json").read_text() + " ")
    assert fingerprint(tmp_path / "c") != fingerprint(a)


def test_what_is_no_model_folder_has_none(tmp_path):
    assert fingerprint(tmp_path / "gone") is None
    assert fingerprint("smollm2") is None  # a name colocate resolves: no folder here
    (tmp_path / "empty").mkdir()
    assert fingerprint(tmp_path / "empty") is None


def test_a_data_file_or_folder_is_known_by_its_bytes(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "state.json").write_text("{}")
    (tmp_path / "saved" / "data.arrow").write_bytes(bytes(range(256)) * 300)
    shutil.copy(tmp_path / "a.jsonl", tmp_path / "b.jsonl")
    shutil.copytree(tmp_path / "saved", tmp_path / "copy")
    assert data_fingerprint(str(tmp_path / "a.jsonl")) == data_fingerprint(str(tmp_path / "b.jsonl")) is not None
    assert data_fingerprint(str(tmp_path / "saved")) == data_fingerprint(str(tmp_path / "copy")) is not None
    (tmp_path / "b.jsonl").write_text('{"prompt": "ho"}\n')
    (tmp_path / "copy" / "state.json").write_text('{"x": 1}')
    assert data_fingerprint(str(tmp_path / "b.jsonl")) != data_fingerprint(str(tmp_path / "a.jsonl"))
    assert data_fingerprint(str(tmp_path / "copy")) != data_fingerprint(str(tmp_path / "saved"))
    for name in ("sentiment-prompts", "hf:openai/gsm8k:main", "reasoning-gym:basic_arithmetic", str(tmp_path / "no")):
        assert data_fingerprint(name) is None
