"""A model folder's fingerprint (``colocate.assets.model_identity``): equal for a copy of the
folder wherever it is, different for other weights, another config or another tokenizer;
None for what is no model folder."""

from __future__ import annotations

import json
import shutil

from colocate.assets.model_identity import fingerprint
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
