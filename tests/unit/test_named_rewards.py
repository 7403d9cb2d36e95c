"""reward.rule as a list of named rules and reward.fns as reward functions by name: parsing,
validation and loading, each failure one line."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from colocate.assets import tasks
from colocate.assets.math_rule import math_reward
from colocate.config import Config, from_dict, load_config, to_dict, validate
from colocate.config_checks import RULES
from colocate.errors import ConfigError
from colocate.rollout.named_rewards import load_reward_fn, named_reward_fns, rule_fn
from colocate.rollout.reward_fns import RewardFnErrors, guarded
from tests.unit import reward_fns_for_tests as fns

SPEC = "tests.unit.reward_fns_for_tests:"


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------- reward.rule


def test_defaults_and_single_rules_are_as_before():
    assert Config().reward.rules == () and Config().reward.fn_names == ()
    assert load_config(overrides=["reward.kind=rule", "reward.rule=vader"]).reward.rules == ("vader",)
    cfg = load_config(overrides=["reward.kind=rule", "reward.rule=reasoning-gym"])
    assert cfg.reward.rule == "reasoning-gym" and cfg.reward.rules == ("reasoning-gym",)


@pytest.mark.parametrize("value,rules", [
    ("vader,math", ("vader", "math")),
    (" math , vader ", ("math", "vader")),
    ("[math, vader]", ("math", "vader")),  # a YAML list on the command line
    ("math,", ("math",)),
])
def test_rule_is_a_comma_list(value, rules):
    cfg = load_config(overrides=["reward.kind=rule", f"reward.rule={value}"])
    assert cfg.reward.rules == rules
    assert from_dict(to_dict(cfg)).reward == cfg.reward  # config.json round trip


def test_a_yaml_list_is_joined(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("reward:\n  kind: rule\n  rule: [vader, math]\n  fns:\n    - a.b:c\n    - d.e:f\n")
    cfg = load_config(path)
    assert cfg.reward.rule == "vader,math" and cfg.reward.fns == "a.b:c,d.e:f"
    assert cfg.reward.fn_names == ("a.b:c", "d.e:f")


@pytest.mark.parametrize("overrides,needle", [
    (["reward.kind=rule", "reward.rule=vadr"], "reward.rule: unknown rule 'vadr'; did you mean 'vader'? "
                                               "the rules: vader, reasoning-gym, math"),
    (["reward.rule=math,gsm8k"], "unknown rule 'gsm8k'"),
    (["reward.kind=rule", "reward.rule=math,math"], "reward.rule: 'math' is named twice"),
    (["reward.kind=rule"], "reward.kind=rule (no reward model) needs reward.rule"),
    (["reward.kind=rule", "reward.rule="], "or reward.fns (package.module:fn)"),
    (["reward.rule={a: 1}"], "reward.rule: expected a comma list or a list of names"),
    (["reward.fns=[1, 2]"], "reward.fns: expected a comma list or a list of names"),
])
def test_bad_rules_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert needle in one_line(info)


def test_kind_rule_with_only_functions_is_valid():
    cfg = load_config(overrides=["reward.kind=rule", f"reward.fns={SPEC}constant"])
    assert cfg.reward.rules == () and cfg.reward.fn_names == (f"{SPEC}constant",)


def test_kind_model_with_rules_is_valid():
    cfg = load_config(overrides=["reward.rule=math"])
    assert cfg.reward.kind == "model" and cfg.reward.rules == ("math",)


def test_every_config_rule_has_a_function():
    source = "reasoning-gym:chain_sum"
    made = {name: rule_fn(name, source) for name in RULES if name != "reasoning-gym"}
    assert made == {"vader": tasks.sentiment_reward, "math": math_reward}
    with pytest.raises(ConfigError, match="needs data.source=reasoning-gym:<task>"):
        rule_fn("reasoning-gym", "sentiment-prompts")
    with pytest.raises(ConfigError) as info:
        rule_fn("nope", source)
    assert one_line(info) == "reward.rule: unknown rule 'nope'; the rules: vader, reasoning-gym, math"


def test_rules_then_functions_in_the_order_named():
    cfg = load_config(overrides=["reward.kind=rule", "reward.rule=math,vader",
                                 f"reward.fns={SPEC}constant,{SPEC}SCORER"])
    assert named_reward_fns(cfg.reward, cfg.data.source) == [math_reward, tasks.sentiment_reward, fns.constant,
                                                             fns.SCORER]
    assert named_reward_fns(Config().reward, "sentiment-prompts") == []


def test_validate_checks_names_of_a_replaced_config():
    cfg = Config()
    bad = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, rule=["math", "bogus"]))
    assert bad.reward.rule == "math,bogus"  # a list is joined by the dataclass itself
    with pytest.raises(ConfigError, match="unknown rule 'bogus'"):
        validate(bad)


# ---------------------------------------------------------------- reward.fns


@pytest.mark.parametrize("name", ["constant", "async_length", "turns", "SCORER", "Namespace.inner"])
def test_functions_load_by_name(name):
    fn = load_reward_fn(f" {SPEC}{name} ")
    errors = RewardFnErrors()
    value = asyncio.run(guarded(fn, "raise", errors)({}, "abcd", messages=lambda: [{"role": "assistant"}]))
    assert value == {"constant": 0.25, "async_length": 4.0, "turns": 1.0, "SCORER": 1.0, "Namespace.inner": 0.25}[name]


def test_a_function_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def exact(record, text):\n    return float(text == record['answer'])\n")
    monkeypatch.chdir(tmp_path)
    fn = load_reward_fn("my_rewards.py:exact")
    assert fn({"answer": "x"}, "x") == 1.0 and fn({"answer": "x"}, "y") == 0.0
    assert load_reward_fn(f"{tmp_path / 'my_rewards.py'}:exact") is fn  # one module per file


@pytest.mark.parametrize("spec,needle", [
    ("constant", "reward.fns: 'constant' is not package.module:attr or path/file.py:attr"),
    (":constant", "is not package.module:attr"),
    ("math", "reward.fns: 'math' is a shipped rule, not a function: --set reward.rule=math (reward.fns names your own"),
    ("no_such_pkg_xyz.rewards:fn",
     "reward.fns=no_such_pkg_xyz.rewards:fn: cannot import module 'no_such_pkg_xyz.rewards' (ModuleNotFoundError"),
    ("missing_file_xyz.py:fn", "reward.fns=missing_file_xyz.py:fn: no file 'missing_file_xyz.py'"),
    (SPEC + "missing", "module 'tests.unit.reward_fns_for_tests' has no attribute 'missing'; name a reward function"),
    (SPEC + "NOT_A_FUNCTION", "NOT_A_FUNCTION: int '3' is not callable"),
    (SPEC + "Scorer", "Scorer is a class"),
    (SPEC + "one_argument", "one_argument(record) cannot be called as fn(record, text) (too many positional"),
    (SPEC + "three_arguments", "cannot be called as fn(record, text) (missing a required argument: 'extra')"),
    (SPEC + "keyword_only", "keyword_only(*, record, text) cannot be called as fn(record, text)"),
])
def test_bad_functions_are_one_line_errors(spec, needle):
    with pytest.raises(ConfigError) as info:
        load_reward_fn(spec)
    message = one_line(info)
    assert message.startswith("reward.fns")
    assert needle in message


def test_a_module_that_fails_on_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("raise ImportError('needs torchvision\\nmore')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_reward_fn("broken_rewards:fn")
    assert "cannot import module 'broken_rewards' (ImportError: needs torchvision)" in one_line(info)
    with pytest.raises(ConfigError) as info:
        load_reward_fn(f"{tmp_path / 'broken_rewards.py'}:fn")
    assert "ImportError: needs torchvision" in one_line(info)


def test_every_entry_is_loaded_at_once_naming_the_bad_one():
    cfg = load_config(overrides=["reward.kind=rule", f"reward.fns={SPEC}constant,{SPEC}missing"])
    with pytest.raises(ConfigError) as info:
        named_reward_fns(cfg.reward, cfg.data.source)
    assert one_line(info).startswith(f"reward.fns={SPEC}missing: ")
