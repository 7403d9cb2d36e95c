"""Start-up guards: batch/world-size agreement, the script's entry-point guard. (The weight-version
agreement of every step's tokens: ``test_rank_rollouts.py``.)"""

from __future__ import annotations

import pytest

from colocate.errors import ConfigError
from colocate.run.guards import check_world_size


@pytest.mark.parametrize("batch,minibatches,world,ok", [
    (8, 2, 1, True), (8, 2, 2, True), (8, 2, 4, True), (8, 4, 2, True),
    (1, 1, 2, False), (6, 2, 2, False), (8, 8, 2, False),
])
def test_world_size_split(batch, minibatches, world, ok):
    if ok:
        check_world_size(batch, minibatches, world)
    else:
        with pytest.raises(ConfigError, match="rollout.batch_size"):
            check_world_size(batch, minibatches, world)


def test_model_that_ships_code_needs_trust_remote_code(tmp_path):
    import json

    import re

    from colocate.engine.start_checks import EngineStartError, check_remote_code
    from colocate.errors import in_config_terms

    folder = tmp_path / "custom"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["MyLM"], "auto_map": {"AutoModel": "m.MyLM"}}))
    with pytest.raises(EngineStartError) as e:
        check_remote_code(str(folder), "models.actor", trusted=False)
    assert re.match("models.actor: .* models.trust_remote_code=true", str(in_config_terms(e.value)))
    assert "\n" not in str(e.value)
    check_remote_code(str(folder), "models.actor", trusted=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    check_remote_code(str(folder), "models.actor", trusted=False)


def test_cli_refuses_remote_code_model_in_one_line(tmp_path):
    import json

    from click.testing import CliRunner

    from colocate.cli import main
    from colocate.assets.random_models import build_tiny_causal_lm

    folder = build_tiny_causal_lm(tmp_path / "actor", seed=1)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModelForCausalLM": "x.Y"}}))
    result = CliRunner().invoke(main, ["train", "--set", f"models.actor={folder}", "--set", "reward.kind=rule",
                                       "--set", "reward.rule=vader", "--set", f"run.out_dir={tmp_path / 'run'}"])
    assert result.exit_code == 2, result.output
    # one line; a note on what earlier killed runs left behind ("[colocate] removed …", the
    # leftovers sweep of a run's start) may come before it on a machine that had such runs
    lines = [line for line in result.output.strip().splitlines() if not line.startswith("[colocate] removed ")]
    assert len(lines) == 1 and "trust_remote_code" in lines[0], result.output


def _module(tmp_path, source: str, name: str = "__main__"):
    import types

    path = tmp_path / "script.py"
    path.write_text(source)
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    return mod


@pytest.mark.parametrize("source", [
    'if __name__ == "__main__":\n    train()\n',
    "import x\nif '__main__' == __name__:\n    x.train()\n",
])
def test_a_guarded_script_passes(tmp_path, source):
    from colocate.run.guards import check_main_guard

    check_main_guard(_module(tmp_path, source))


def test_an_unguarded_script_exits_with_one_line_naming_the_fix(tmp_path):
    from colocate.run.guards import check_main_guard

    with pytest.raises(SystemExit) as e:
        check_main_guard(_module(tmp_path, "from colocate import api\napi.train(cfg)\n"))
    msg = str(e.value.code)
    assert "\n" not in msg and 'if __name__ == "__main__":' in msg and "script.py" in msg


def test_a_notebook_or_spawned_reimport():
    import types

    from colocate.run.guards import check_main_guard

    check_main_guard(types.ModuleType("__main__"))  # interactive: no __file__
    with pytest.raises(SystemExit, match="spawn"):
        check_main_guard(types.ModuleType("__mp_main__"))


def test_a_script_on_stdin_exits_with_one_line_naming_the_fix():
    import types

    from colocate.run.guards import check_main_guard

    main = types.ModuleType("__main__")
    main.__file__ = "<stdin>"  # what `python - < script.py` and a here-document leave
    with pytest.raises(SystemExit) as info:
        check_main_guard(main)
    msg = str(info.value)
    assert "\n" not in msg and "<stdin>" in msg and "python script.py" in msg and "python -c" in msg
    module = types.ModuleType("__main__")
    module.__file__, module.__spec__ = "<stdin>", object()  # python -m: spawn re-imports by name
    check_main_guard(module)


def test_load_limits_refuse_what_sglang_s_classes_cannot_run_and_pass_what_they_can():
    """engine.start_checks.LOAD_LIMITS against transformers' own configs: SGLang's Gemma
    models score with the input embeddings (untied heads refused), its Gemma-2 reads
    hidden_act, its Phi has no grouped-query attention; the tiny models colocate builds of
    those families pass (tied Gemmas)."""
    from transformers import AutoConfig

    from colocate.assets.random_models import _tiny_config
    from colocate.engine.start_checks import LOAD_LIMITS

    def refusals(arch: str, config) -> list[str]:
        return [why.split(" (")[0] for runs, why in LOAD_LIMITS[arch] if not runs(config)]

    untied = "its model has no output head of its own"
    assert refusals("GemmaForCausalLM", AutoConfig.for_model("gemma", tie_word_embeddings=False)) == [untied]
    assert refusals("GemmaForCausalLM", AutoConfig.for_model("gemma", tie_word_embeddings=True)) == []
    no_act = "its model reads config.hidden_act, which this config.json lacks"
    assert refusals("Gemma2ForCausalLM", AutoConfig.for_model("gemma2", tie_word_embeddings=False)) == [no_act, untied]
    assert refusals("Gemma2ForCausalLM", AutoConfig.for_model("gemma2", hidden_act="gelu_pytorch_tanh")) == []
    assert refusals("Gemma3ForCausalLM", AutoConfig.for_model("gemma3_text", tie_word_embeddings=False)) == [untied]
    phi = AutoConfig.for_model("phi", num_attention_heads=4, num_key_value_heads=2)
    assert refusals("PhiForCausalLM", phi) == ["its model has no grouped-query attention"]
    assert refusals("PhiForCausalLM", AutoConfig.for_model("phi", num_attention_heads=4, num_key_value_heads=4)) == []
    for arch, cls in (("gemma", "GemmaForCausalLM"), ("gemma3_text", "Gemma3ForCausalLM")):
        built = _tiny_config(arch, 64, 2, 4, 2, 512, 128)
        assert refusals(cls, built) == [], arch


def test_the_classes_colocate_registers_are_named_without_sglang_and_have_no_load_limits():
    from colocate.engine import sglang_api
    from colocate.engine.start_checks import LOAD_LIMITS

    assert [c.__name__ for c in sglang_api.model_classes()] == list(sglang_api.REGISTERED_ARCHITECTURES)
    assert not set(sglang_api.REGISTERED_ARCHITECTURES) & set(LOAD_LIMITS)


def test_a_start_check_of_a_registered_architecture_imports_no_sglang(tiny_actor_path, tiny_rm_path):
    """``colocate train --check`` of a Llama actor and reward model stays light: the start
    check resolves no class SGLang would load anyway (an unregistered family still is:
    tests/failures/test_unloadable_model.py)."""
    import subprocess
    import sys

    code = ("import sys\nfrom colocate.engine.engine_config import EngineConfig\n"
            "from colocate.engine.start_checks import check_startable\n"
            f"print(check_startable(EngineConfig({tiny_actor_path!r}, role='actor', device='cpu'), 'models.actor'))\n"
            f"print(check_startable(EngineConfig({tiny_rm_path!r}, role='reward', device='cpu'), 'models.reward'))\n"
            "print('sglang' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["LlamaForCausalLM", "LlamaForSequenceClassification", "False"], done.stderr[-2000:]
