"""Resume reads the run's own config: overrides on top, fixed keys refused, changes named,
a checkpoint of other models refused in one line (no engines: fake run folders)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from click.testing import CliRunner

from colocate.run import checkpoint, resume
from colocate.run.checkpoint import CheckpointError
from colocate.run.checkpoint_layout import LAYOUT
from colocate.cli import main
from colocate.config import load_config, to_dict
from colocate.errors import ConfigError

RUN = ["overlap.mode=oppo", "run.save_every=2", "rollout.temperature=0", "run.steps=6",
       "models.actor=/models/a", "models.reward=/models/rm"]


def make_run(root, overrides=RUN, step=4, meta=None):
    """A run folder as a run leaves it: config.json and one checkpoint."""
    cfg = load_config(overrides=[*overrides, f"run.out_dir={root}"])
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(to_dict(cfg), indent=1))
    checkpoint.save(root / "checkpoints", step, {"run": {"step": step}}, meta=meta)
    return cfg


def test_config_changes_names_each_changed_key_in_config_order(tmp_path):
    saved = load_config(overrides=RUN)
    cfg = load_config(overrides=[*RUN, "run.steps=10", "ppo.minibatches=1", "overlap.mode=inter"])
    assert resume.config_changes(saved, cfg) == [
        ("ppo.minibatches", 2, 1), ("overlap.mode", "oppo", "inter"), ("run.steps", 6, 10)]
    assert resume.config_changes(saved, saved) == []


def test_paths_naming_one_folder_are_no_change(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    a, b = load_config(overrides=["models.actor=m"]), load_config(overrides=[f"models.actor={tmp_path}/m/"])
    assert resume.config_changes(a, b) == []


@pytest.mark.parametrize("where", ["", "checkpoints", "checkpoints/step_00000004"])
def test_run_config_is_the_base_and_out_dir_the_run_folder(tmp_path, where):
    saved = make_run(tmp_path / "run")
    cfg = resume.load_run_config(tmp_path / "run" / where)
    assert cfg.run.out_dir == str(tmp_path / "run")
    assert resume.config_changes(saved, cfg) == []
    assert (cfg.overlap.mode, cfg.run.save_every, cfg.rollout.temperature) == ("oppo", 2, 0.0)


def test_yaml_then_overrides_go_on_top_of_the_run_config(tmp_path):
    make_run(tmp_path / "run")
    yaml_file = tmp_path / "more.yaml"
    yaml_file.write_text("ppo:\n  epochs: 1\nrun:\n  steps: 30\n")
    cfg = resume.load_run_config(tmp_path / "run", yaml_file, ["run.steps=40"])
    assert (cfg.ppo.epochs, cfg.run.steps, cfg.overlap.mode) == (1, 40, "oppo")


@pytest.mark.parametrize("override,key", [("models.actor=/models/b", "models.actor"),
                                          ("models.critic=/models/c", "models.critic"),
                                          ("data.seed=3", "data.seed"), ("ppo.kl_kind=fixed", "ppo.kl_kind")])
def test_a_fixed_key_is_refused_in_one_line_naming_it_and_both_values(tmp_path, override, key):
    saved = make_run(tmp_path / "run")
    with pytest.raises(ConfigError) as e:
        resume.load_run_config(tmp_path / "run", overrides=[override])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{key} cannot change")
    section, field = key.split(".")
    old, new = (getattr(getattr(c, section), field) for c in (saved, load_config(overrides=[*RUN, override])))
    assert f"(the run has {old!r}, this config {new!r})" in msg


@pytest.mark.parametrize("run,override,refused", [
    (["lora.rank=4"], "lora.rank=8", True),  # the adapter's shapes
    ([], "lora.rank=4", True),  # an adapter added to a fully trained run
    (["lora.rank=4"], "lora.rank=0", True),  # ... or taken away
    (["lora.rank=4"], "lora.target_modules=q_proj,v_proj", True),
    (["lora.rank=4"], "lora.actor=false", True),
    (["lora.rank=4"], "lora.critic=false", True),
    (["lora.rank=4", "ppo.advantage=grpo", "rollout.group_size=2", "rollout.temperature=1"], "lora.critic=false",
     False),  # no critic (sampled: greedy groups give grpo nothing to compare)
    (["lora.rank=4"], "lora.alpha=32", False),  # a scale, no tensor
    ([], "lora.target_modules=q_proj", False),  # no adapter before or after
])
def test_an_adapters_shape_and_place_are_kept_by_a_resume(tmp_path, run, override, refused):
    """Before: a LoRA run resumed with another lora.rank started its engines and then was
    refused by the tensor shapes, in a line telling to resume with the run's models.actor
    (which it was)."""
    _kept_or_refused(tmp_path, run, override, refused)


def _kept_or_refused(tmp_path, run, override, refused) -> None:
    """A run made with ``run`` resumes with ``override``, or (``refused``) is refused in one line naming its key."""
    make_run(tmp_path / "run", overrides=[*RUN, *run])
    if not refused:
        assert resume.load_run_config(tmp_path / "run", overrides=[override]) is not None
        return
    with pytest.raises(ConfigError) as e:
        resume.load_run_config(tmp_path / "run", overrides=[override])
    key, value = override.split("=")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{key} cannot change when resuming (the run has ")
    assert ("decides which prompts the run trains on" in str(e.value)) == (key in resume.FILTERED)


@pytest.mark.parametrize("run,override,refused", [
    (["data.filter_overlong_prompts=true"], "data.max_prompt_tokens=200", True),  # another set of prompts
    (["data.filter_overlong_prompts=true"], "data.apply_chat_template=false", True),
    (["data.filter_overlong_prompts=true"], "rollout.env=calculator", True),  # its instruction: longer prompts
    ([], "data.filter_overlong_prompts=true", True),
    ([], "data.max_prompt_tokens=200", False),  # every prompt is kept either way (a longer one is refused)
])
def test_which_prompts_a_run_leaves_out_is_kept_by_a_resume(tmp_path, run, override, refused):
    """The data position counts into the prompts that fit: a resume that changed which ones do
    would train on other prompts than the run's, silently."""
    _kept_or_refused(tmp_path, run, override, refused)


def test_api_config_is_checked_against_the_run_and_changes_logged_in_one_line(tmp_path):
    saved = make_run(tmp_path / "run")
    lines = []
    cfg = load_config(overrides=[*RUN, f"run.out_dir={tmp_path / 'run'}", "run.steps=10", "ppo.epochs=1"])
    resume.check_resume(cfg, tmp_path / "run", lines.append)
    assert lines == ["resume: changed ppo.epochs 2 -> 1, run.steps 6 -> 10"]
    resume.check_resume(saved, tmp_path / "run", lines.append)  # nothing changed: nothing logged
    assert len(lines) == 1
    other = load_config(overrides=[*RUN, "models.actor=/models/b", f"run.out_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^models.actor cannot change .*'/models/a'.*'/models/b'"):
        resume.check_resume(other, tmp_path / "run", lines.append)


def test_the_models_are_checked_against_the_checkpoints_record_not_an_edited_config_json(tmp_path):
    """Before: a config.json edited to another actor resumed on it silently (the manifest's
    record of the models was only read to name them in a shape mismatch)."""
    cfg = load_config(overrides=[*RUN, f"run.out_dir={tmp_path / 'run'}"])
    make_run(tmp_path / "run", meta={"models": dataclasses.asdict(cfg.models)})
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    saved["models"]["actor"] = "/models/b"
    (tmp_path / "run" / "config.json").write_text(json.dumps(saved))
    said = "models.actor cannot change when resuming (the run has '/models/a', this config '/models/b')"
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}"):
        resume.load_run_config(tmp_path / "run")
    with pytest.raises(ConfigError, match=f"^{re.escape(said)}"):
        resume.check_resume(load_config(overrides=[*RUN, "models.actor=/models/b", f"run.out_dir={tmp_path / 'run'}"]),
                            tmp_path / "run", print)
    # the checkpoint's own models: accepted, config.json's edit named as a change
    repaired = resume.load_run_config(tmp_path / "run", overrides=["models.actor=/models/a"])
    assert repaired.models.actor == "/models/a"
    lines = []
    resume.check_resume(dataclasses.replace(repaired, run=dataclasses.replace(repaired.run, steps=7)),
                        tmp_path / "run", lines.append)
    assert lines == ["resume: changed models.actor /models/b -> /models/a, run.steps 6 -> 7"]


def test_a_finished_run_says_raise_run_steps(tmp_path):
    saved = make_run(tmp_path / "run", step=6)
    with pytest.raises(ConfigError, match=r"run.steps is 6 .* at step 6: nothing to run.*--set run.steps=16"):
        resume.check_resume(saved, tmp_path / "run", print)


def test_missing_folder_checkpoint_or_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="is not a folder"):
        resume.load_run_config(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="--resume: no checkpoint"):
        resume.load_run_config(tmp_path / "empty")
    make_run(tmp_path / "run")
    (tmp_path / "run" / "config.json").unlink()
    with pytest.raises(ConfigError, match="--resume: no config.json in"):
        resume.load_run_config(tmp_path / "run")
    lines = []  # the Python API with its own config: resumes, says it could not compare
    resume.check_resume(load_config(overrides=RUN), tmp_path / "run", lines.append)
    assert lines and "not compared" in lines[0]
    (tmp_path / "run" / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json' is not valid JSON"):
        resume.load_run_config(tmp_path / "run")


def _parts(actor_shape, critic_shape, deferred=()):
    """A loaded checkpoint's parts, in today's layout (what ``Session.restore`` checks)."""
    model = lambda shape: {"model": {"model.embed.weight": torch.zeros(shape), "model.norm.weight": torch.zeros(4)}}
    trainer = {"actor": model(actor_shape), "critic": model(critic_shape)}
    return {"layout": LAYOUT, "trainer": trainer, "run": {"step": 4},
            "data": {"base": 0, "ranks": [{"data_pos": 4, "named": 4, "dropped_total": 0,
                                           "deferred": list(deferred)}]},
            "rollout": {"ranks": [None]}}


def _live(actor_shape, critic_shape):
    return {part: {"model.embed.weight": shape, "model.norm.weight": (4,)}
            for part, shape in (("actor", actor_shape), ("critic", critic_shape))}


def test_checkpoint_of_other_models_is_one_line_naming_both(tmp_path):
    saved = make_run(tmp_path / "run", meta={"models": to_dict(load_config(overrides=RUN))["models"]})
    where = checkpoint.latest(tmp_path / "run")
    resume.check_checkpoint(where, _parts((8, 4), (8, 4)), _live((8, 4), (8, 4)), saved)  # same: fine
    other = load_config(overrides=[*RUN, "models.actor=/models/b"])
    with pytest.raises(CheckpointError) as e:
        resume.check_checkpoint(where, _parts((8, 4), (8, 4)), _live((16, 4), (16, 4)), other)
    msg = str(e.value)
    assert "\n" not in msg
    assert "holds the actor '/models/a' (36 parameters) but models.actor is '/models/b' (68 parameters" in msg
    assert "model.embed.weight is [8, 4] in the checkpoint, [16, 4] configured" in msg


def test_older_checkpoint_without_recorded_models_still_checks_shapes(tmp_path):
    saved = make_run(tmp_path / "run")  # no meta: written before the models were recorded
    where = checkpoint.latest(tmp_path / "run")
    assert checkpoint.manifest(where)["meta"] == {}
    resume.check_checkpoint(where, _parts((8, 4), (8, 4)), _live((8, 4), (8, 4)), saved)
    with pytest.raises(CheckpointError, match=r"holds an unnamed critic .* but models.actor is '/models/a'"):
        resume.check_checkpoint(where, _parts((8, 4), (8, 4)), _live((8, 4), (9, 4)), saved)


def test_sequential_mode_would_drop_deferred_samples_so_it_is_refused(tmp_path):
    """Before any engine starts (it was refused after both engines and the trainer had
    started): only the checkpoint's data part is read."""
    saved = make_run(tmp_path / "run")
    seq = load_config(overrides=[*RUN, "overlap.mode=sequential", "run.steps=9"])
    more = dataclasses.replace(saved, run=dataclasses.replace(saved.run, steps=9))

    def checkpoint_with(deferred):
        root = tmp_path / "run" / "checkpoints"
        shutil.rmtree(root)
        checkpoint.save(root, 4, {"run": {"step": 4}, "data": _parts((8, 4), (8, 4), deferred)["data"]})

    checkpoint_with([{"index": 3}])
    with pytest.raises(ConfigError, match="^overlap.mode=sequential would drop the 1 deferred samples"):
        resume.check_resume(seq, tmp_path / "run", lambda m: None)
    resume.check_resume(more, tmp_path / "run", lambda m: None)  # its own mode (oppo) keeps them
    checkpoint_with([])
    resume.check_resume(seq, tmp_path / "run", lambda m: None)  # nothing deferred: nothing dropped


def test_cli_resume_prints_the_runs_config_and_refuses_another_actor(tmp_path):
    make_run(tmp_path / "run")
    result = CliRunner().invoke(main, ["train", "--resume", str(tmp_path / "run"), "--print-config",
                                       "--set", "run.steps=9"])
    assert result.exit_code == 0, result.output
    assert "mode: oppo" in result.output and "steps: 9" in result.output and "save_every: 2" in result.output
    result = CliRunner().invoke(main, ["train", "--resume", str(tmp_path / "run"), "--set", "models.actor=/x"])
    assert result.exit_code == 2
    err = result.output.strip()
    assert len(err.splitlines()) == 1 and "models.actor cannot change" in err and "'/x'" in err


def test_a_moved_model_folder_resumes_when_its_files_are_the_checkpoints(tmp_path):
    """A run's checkpoints record its models' and data's fingerprints: a folder or file moved
    (another machine, another mount) resumes from its new place, named in one log line; the
    run's one gone and not given anew is one line saying how; other files there are refused."""
    from colocate.assets.random_models import build_tiny_causal_lm

    first = build_tiny_causal_lm(tmp_path / "models" / "actor", seed=5)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n{"prompt": "there"}\n')
    inputs = [f"models.actor={first}", "models.reward=/models/rm", f"data.source={tmp_path / 'prompts.jsonl'}"]
    started = load_config(overrides=[*RUN, *inputs])
    assert set(resume.fingerprints(started)) == {"models.actor", "data.source"}  # /models/rm: no folder here
    cfg = make_run(tmp_path / "run", [*RUN, *inputs],
                   meta={"models": dataclasses.asdict(started.models), "fingerprints": resume.fingerprints(started)})
    moved = tmp_path / "elsewhere" / "actor"
    shutil.move(str(first), moved)
    at = f"run.out_dir={tmp_path / 'run'}"
    with pytest.raises(ConfigError, match=f"^--resume: the run's models.actor '{re.escape(str(first))}' is not there "
                                          "anymore; if it moved, pass its new place: --set models.actor=PATH"):
        resume.check_resume(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, steps=7)), tmp_path / "run", print)
    lines = []
    again = resume.load_run_config(tmp_path / "run", overrides=[f"models.actor={moved}", "run.steps=7"])
    resume.check_resume(again, tmp_path / "run", lines.append)
    assert lines == [f"resume: models.actor moved: '{first}' -> '{moved}' (the same files: they match the "
                     "checkpoint's record)", "resume: changed run.steps 6 -> 7"]
    other = build_tiny_causal_lm(tmp_path / "models" / "other", seed=6)
    with pytest.raises(ConfigError, match=r"^models.actor cannot change when resuming"):
        resume.load_run_config(tmp_path / "run", overrides=[f"models.actor={other}", "run.steps=7", at])
    # the prompts file: moved, taken; edited there, refused
    shutil.move(str(tmp_path / "prompts.jsonl"), tmp_path / "elsewhere" / "p.jsonl")
    again = resume.load_run_config(tmp_path / "run", overrides=[f"models.actor={moved}", "run.steps=7",
                                                                f"data.source={tmp_path / 'elsewhere' / 'p.jsonl'}"])
    assert again.data.source == str(tmp_path / "elsewhere" / "p.jsonl")
    (tmp_path / "elsewhere" / "p.jsonl").write_text('{"prompt": "other"}\n')
    with pytest.raises(ConfigError, match=r"^data.source cannot change when resuming"):
        resume.load_run_config(tmp_path / "run", overrides=[f"models.actor={moved}", "run.steps=7",
                                                            f"data.source={tmp_path / 'elsewhere' / 'p.jsonl'}"])
