"""Exporting a checkpoint's actor as an HF folder (no engine): weights, tied embeddings, errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from colocate.run import checkpoint
from colocate.errors import ConfigError
from colocate.tools.export import default_out, export_actor
from colocate.assets.random_models import build_tiny_causal_lm


def _tied_base(tmp_path):
    """A tiny Llama with tied input/output embeddings (as SmolLM2 has), tokenizer included."""
    untied = build_tiny_causal_lm(tmp_path / "untied", seed=3)
    config = AutoConfig.from_pretrained(untied)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    base = tmp_path / "base"
    model.save_pretrained(base)
    for f in untied.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy(f, base / f.name)
    return str(base), model


def _fake_run(tmp_path, base: str, state: dict, step: int = 3):
    """A run folder as `colocate train` leaves it: config.json naming the base actor and a checkpoint."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"models": {"actor": base}}))
    checkpoint.save(run / "checkpoints", step, {"trainer": {"actor": {"model": state, "optim": None}},
                                                "run": {"step": step}})
    return run


@pytest.mark.parametrize("keep_lm_head", [True, False])
def test_export_writes_the_checkpoint_weights_over_the_base(tmp_path, keep_lm_head):
    base, model = _tied_base(tmp_path)
    trained = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    trained["lm_head.weight"] = trained["model.embed_tokens.weight"]  # tied: one tensor
    state = dict(trained) if keep_lm_head else {k: v for k, v in trained.items() if k != "lm_head.weight"}
    run = _fake_run(tmp_path, base, state)

    out = export_actor(run)
    assert out == default_out(run / "checkpoints" / "step_00000003") == run / "export" / "actor_step_00000003"
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    got = loaded.state_dict()
    for name, want in trained.items():
        torch.testing.assert_close(got[name], want, rtol=0, atol=0, msg=name)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert (out / "tokenizer_config.json").is_file()
    assert not any(p.name.startswith(".tmp_") for p in out.parent.iterdir())


def test_export_reuses_a_complete_export_and_takes_a_step_folder(tmp_path):
    base, model = _tied_base(tmp_path)
    run = _fake_run(tmp_path, base, model.state_dict())
    first = export_actor(run)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert export_actor(run) == first and (first / "model.safetensors").stat().st_mtime_ns == stamp
    # the run restarted into the same folder rewrites step 3: the old export is stale
    changed = {k: v + 1 for k, v in model.state_dict().items()}
    checkpoint.save(run / "checkpoints", 3, {"trainer": {"actor": {"model": changed, "optim": None}}})
    again = export_actor(run)
    assert again == first
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(again).model.norm.weight,
                               changed["model.norm.weight"])
    other = export_actor(run / "checkpoints" / "step_00000003", tmp_path / "elsewhere")
    assert (other / "model.safetensors").is_file()


def test_export_errors_name_the_problem(tmp_path):
    base, model = _tied_base(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match=r"^export: no checkpoint under"):
        export_actor(tmp_path / "empty")

    run = _fake_run(tmp_path, base, model.state_dict())
    (run / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"^export: no config.json in run folder"):
        export_actor(run)

    other = build_tiny_causal_lm(tmp_path / "wider", seed=0, hidden=96)  # a different shape
    (run / "config.json").write_text(json.dumps({"models": {"actor": str(other)}}))
    with pytest.raises(ConfigError, match=r"^export: checkpoint .* does not fit the base actor"):
        export_actor(run)


def test_an_export_never_replaces_the_run_the_base_or_a_folder_of_other_files(tmp_path):
    """Before: `--out` naming the run folder (or its checkpoints, or a folder of the user's)
    replaced it with the exported model, exit 0: every checkpoint gone."""
    base, model = _tied_base(tmp_path)
    run = _fake_run(tmp_path, base, model.state_dict())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "keep.txt").write_text("notes")
    for out, said in ((run, f"is or holds '{run}', which the export reads"),
                      (run / "checkpoints", f"is or holds '{run / 'checkpoints' / 'step_00000003'}', which the export"),
                      (tmp_path, f"is or holds '{run}', which the export reads"),
                      (base, f"is or holds '{base}', which the export reads"),
                      (tmp_path / "mine", "holds keep.txt, which colocate did not export; an export replaces the "
                                          "folder it writes: give a new or empty folder, or an earlier export"),
                      (tmp_path / "untied", "holds chat_template.jinja, config.json, generation_config.json, …, which "
                                            "colocate did not export")):  # another model's folder
        with pytest.raises(ConfigError) as e:
            export_actor(run, out)
        assert str(e.value).startswith(f"export: --out '{out}' {said}"), str(e.value)
    assert (run / "checkpoints" / "step_00000003" / checkpoint.MANIFEST).is_file()
    assert (tmp_path / "mine" / "keep.txt").read_text() == "notes"
    first = export_actor(run, tmp_path / "exported")
    assert json.loads((first / "colocate_export.json").read_text()) == {"run": str(run),
                                                                         "checkpoint": "step_00000003"}
    assert export_actor(run, first, reuse=False) == first  # an earlier export: replaced
    own = export_actor(run)
    (own / "colocate_export.json").unlink()  # the run's own export folder, written before the marker
    assert export_actor(run, reuse=False) == own
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match=r"^export: cannot write '.*afile/sub' \('.*afile' is a file\); give a folder"):
        export_actor(run, tmp_path / "afile" / "sub")
