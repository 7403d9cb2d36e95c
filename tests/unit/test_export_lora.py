"""Exporting a LoRA run's actor (no engine): the merged HF folder and the PEFT adapter
folder give the trained PEFT actor's logits; reuse; a checkpoint that does not fit the run's
``lora`` section and an adapter of a full run are refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from peft import PeftModel
from transformers import AutoModelForCausalLM

from colocate.run import checkpoint
from colocate.cli import main
from colocate.config import load_config, to_dict
from colocate.errors import ConfigError
from colocate.tools.export import export_actor
from colocate.assets.random_models import build_tiny_causal_lm
from colocate.trainer.lora import add_lora
from colocate.trainer.optim import build_adamw, full_training_state

IDS = torch.tensor([[1, 17, 42, 99, 7, 130, 64, 3]])  # a fixed input, ids of the tiny vocabulary


def _config(run, base, *overrides):
    """The run's config.json as `colocate train` writes it (colocate's config.to_dict)."""
    cfg = load_config(overrides=[f"models.actor={base}", *overrides])
    (run / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    return cfg


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run folder as a run leaves it: config.json with lora.rank=4 and a checkpoint of
    the actor's trainable tensors (random, lora_B non-zero) -> (run, base, the PEFT actor)."""
    tmp = tmp_path_factory.mktemp("lora-export")
    base = build_tiny_causal_lm(tmp / "base", seed=7)
    run = tmp / "run"
    run.mkdir()
    cfg = _config(run, base, "lora.rank=4", "lora.alpha=8")
    actor = add_lora(_hf(base), cfg.lora)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in actor.parameters():
            if p.requires_grad:
                p.normal_(std=0.05)  # lora_A and lora_B: the adapters change the model
    state = full_training_state(actor, build_adamw(actor, 1e-3, 0.0))  # the trainable tensors, as a run saves them
    assert state["model"] and all(".lora_" in k for k in state["model"])
    checkpoint.save(run / "checkpoints", 3, {"trainer": {"actor": state, "updates": {"actor": 1}}, "run": {"step": 3}})
    return run, base, actor.eval()


def test_merged_export_and_adapter_folder_give_the_trained_logits(lora_run, tmp_path):
    run, base, actor = lora_run
    want = _logits(actor)
    assert (want - _logits(_hf(base))).abs().max() > 1e-2  # the adapters matter

    out = export_actor(run, tmp_path / "merged", adapter=tmp_path / "adapter")
    assert out == tmp_path / "merged" and (out / "tokenizer_config.json").is_file()
    merged = _hf(out)
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    torch.testing.assert_close(_logits(merged), want, rtol=0, atol=1e-5)

    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == 4
    loaded = PeftModel.from_pretrained(_hf(base), tmp_path / "adapter").eval()
    torch.testing.assert_close(_logits(loaded), want, rtol=0, atol=1e-5)
    assert not any(p.name.startswith(".tmp_") for p in tmp_path.iterdir())


def test_reuse_skips_only_complete_fresh_folders(lora_run, tmp_path):
    run = lora_run[0]
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export_actor(run, merged)
    assert not adapter.exists()
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    assert export_actor(run, merged) == merged and (merged / "model.safetensors").stat().st_mtime_ns == stamp
    export_actor(run, merged, adapter=adapter)  # the merged folder is fresh, the adapter is missing: written
    stamps = [(f / name).stat().st_mtime_ns for f, name in ((merged, "model.safetensors"),
                                                             (adapter, "adapter_model.safetensors"))]
    export_actor(run, merged, adapter=adapter)  # both fresh: nothing rewritten
    assert stamps == [(f / name).stat().st_mtime_ns for f, name in ((merged, "model.safetensors"),
                                                                     (adapter, "adapter_model.safetensors"))]


def test_a_checkpoint_that_does_not_fit_the_lora_section_is_refused(lora_run, tmp_path):
    run = shutil.copytree(lora_run[0], tmp_path / "run")
    base = lora_run[1]
    cases = [(("lora.rank=8", "lora.alpha=8"), r"^export: checkpoint .* does not fit the LoRA adapters", "rank [4]"),
             (("lora.rank=4", "lora.target_modules=q_proj,v_proj"), r"does not fit the LoRA adapters", "unexpected"),
             ((), r"^export: checkpoint .* does not fit the base actor", "was lora.rank or lora.actor changed")]
    for overrides, pattern, needle in cases:
        _config(run, base, *overrides)
        with pytest.raises(ConfigError, match=pattern) as err:
            export_actor(run, tmp_path / "out", adapter=tmp_path / "adapter" if overrides else None)
        assert needle in str(err.value) and len(str(err.value).splitlines()) == 1, overrides
    assert not (tmp_path / "out").exists() and not (tmp_path / "adapter").exists()


def test_an_adapter_of_a_full_run_is_refused(tmp_path):
    base = build_tiny_causal_lm(tmp_path / "base", seed=2)
    run = tmp_path / "run"
    run.mkdir()
    _config(run, base, "lora.rank=4", "lora.actor=false")  # adapters on the critic only: the actor trains in full
    checkpoint.save(run / "checkpoints", 1, {"trainer": {"actor": {"model": _hf(base).state_dict(), "optim": None}}})
    with pytest.raises(ConfigError, match=r"^export: an adapter folder was asked for, but the config.json of run .* "
                                          r"trains its actor in full \(lora.rank=4, lora.actor=False\)") as err:
        export_actor(run, adapter=tmp_path / "adapter")
    assert len(str(err.value).splitlines()) == 1 and not (tmp_path / "adapter").exists()
    assert (export_actor(run) / "model.safetensors").is_file()  # without --adapter: the full path


def test_cli_export_adapter(lora_run, tmp_path):
    run = lora_run[0]
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(merged), "--adapter", str(adapter)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [str(merged), str(adapter)]  # stderr: transformers' progress bars
    assert (adapter / "adapter_model.safetensors").is_file() and (merged / "model.safetensors").is_file()

    inside = CliRunner().invoke(main, ["export", str(run), "--out", str(merged), "--adapter", str(merged / "a")])
    assert inside.exit_code == 2 and inside.stdout == ""
    assert inside.stderr.startswith("error: export: the adapter folder") and len(inside.stderr.splitlines()) == 1
