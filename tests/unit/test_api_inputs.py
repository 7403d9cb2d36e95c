"""What the Python API is handed is checked as the CLI's config is, before any engine:
reward functions, an environment, the config itself (before: ``reward_fns=[42]`` or an
environment without ``step`` failed ~60 s in, after the engines started and the first
rollout ran; a dict for ``cfg`` was an AttributeError from inside the run)."""

from __future__ import annotations

import pytest

from colocate import api
from colocate.config import load_config
from colocate.errors import ConfigError
from colocate.run.builder import _reward_fns, environment

CFG = load_config(overrides=["reward.kind=rule", "reward.rule=vader"])


def good(record, text):
    return 0.0


@pytest.mark.parametrize("fns, said", [
    ([42], "reward_fns[0]: int '42' is not callable; name a reward function fn(record, text)"),
    ([good, lambda: 0.0], "reward_fns[1]: <lambda>() cannot be called as fn(record, text) (too many positional "
                          "arguments)"),
    (good, "reward_fns: one function (good), not a list of them; pass reward_fns=[good]"),
    ("good", "reward_fns: a str, not a list of reward functions; pass reward_fns=[fn, ...]"),
])
def test_bad_reward_fns_are_one_line(fns, said):
    with pytest.raises(ConfigError) as e:
        _reward_fns(CFG, fns)
    assert str(e.value).startswith(said), str(e.value)


def test_good_reward_fns_come_first_then_the_configs():
    fns = _reward_fns(CFG, (good,))
    assert fns[0] is good and len(fns) == 2  # and vader's rule


class _NoStep:
    name, instruction = "calc", "use the tool"


class _NumberInstruction(_NoStep):
    instruction = 5

    def step(self, record, history):
        return None


@pytest.mark.parametrize("env, lacks", [(_NoStep(), "step method"), (_NumberInstruction(), "str instruction")])
def test_an_environment_missing_its_protocol_is_one_line(env, lacks):
    with pytest.raises(ConfigError) as e:
        environment(CFG, env)
    assert str(e.value) == (f"env: {type(env).__name__} is not an environment (no {lacks}); it needs a str name, "
                            "a str instruction and a step(record, history) method")


@pytest.mark.parametrize("call", [api.check, api.train])
def test_a_config_that_is_not_a_config_is_one_line(call):
    with pytest.raises(ConfigError) as e:
        call({"run": {"steps": 1}})
    assert str(e.value) == ("cfg: a dict, not a colocate Config; build one with "
                            "colocate.config.load_config(path, overrides) or Config()")


def test_an_unknown_generate_option_is_one_line_before_any_model_loads(tmp_path):
    """``api.generate(..., max_tokens=5)`` was a TypeError from the options' constructor; now
    one line naming the closest option, before the model is looked up (a folder that does
    not exist is not what is reported)."""
    with pytest.raises(ConfigError) as e:
        api.generate(tmp_path / "nothing-here", ["hi"], max_tokens=5)
    assert str(e.value) == ("generate: unknown option 'max_tokens'; did you mean 'max_new_tokens'? the options: "
                            "max_new_tokens, temperature, top_p, seed, device, dtype, chat")


def test_generate_from_a_run_without_a_checkpoint_names_generate(tmp_path):
    """A run folder that saved no checkpoint yet: the error names the command the user ran
    (before: "export: no checkpoint under …", a command they had not typed)."""
    from colocate.run.checkpoint import CheckpointError

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError) as e:
        api.generate(tmp_path / "run", ["hi"])
    assert str(e.value) == f"generate: no checkpoint under '{tmp_path / 'run'}' (expected step_*/manifest.json)"


@pytest.mark.parametrize("nproc", [0, -1, 1.5])
def test_check_on_no_processes_is_one_line(nproc):
    """Before: nproc=0 was a ZeroDivisionError from the placement, -1 checked ok."""
    with pytest.raises(ConfigError, match=rf"^nproc: {nproc!r}; give the number of training processes, 1 or more$"):
        api.check(load_config(), nproc=nproc)


@pytest.mark.parametrize("callbacks,said", [
    (print, r"^callbacks: one function \(print\), not a list of them; pass callbacks=\[print\]$"),
    ([print, 3], r"^callbacks\[1\]: 3 is not callable; pass functions that take a step's metrics \(a dict\)$"),
    ("log", r"^callbacks: 'log' is not a list of functions"),
])
def test_bad_callbacks_are_one_line_before_anything_starts(callbacks, said):
    """Before: a TypeError after the first step had trained."""
    with pytest.raises(ConfigError, match=said):
        api.train(load_config(), callbacks=callbacks)
