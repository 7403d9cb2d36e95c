"""The built-in environments and choosing one by name: the calculator's safe evaluator and
its turns, the scripted environment (replies, rewards, fault knobs) and ``rollout.env``."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import pytest

from colocate.errors import ConfigError
from colocate.rollout.calculator import (
    ALLOWED,
    MAX_CHARS,
    CalculatorEnv,
    CalculatorError,
    evaluate,
    format_number,
)
from colocate.rollout.env import Environment, Observation
from colocate.rollout.environments import BUILTIN, describe, load_environment
from colocate.rollout.scripted_env import GARBAGE, ScriptedEnv

SPEC = f"{__name__}:"  # this module, as rollout.env names it ("tests.unit.test_environments:")


def step(env, history, record=None):
    """Run one (sync or async) step to its Observation."""
    result = env.step(record or {}, history)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def conversation(*assistant_turns: str, role: str = "user") -> list[dict[str, str]]:
    """A history of the given assistant turns with an observation between each two."""
    history: list[dict[str, str]] = [{"role": "user", "content": "the question"}]
    for i, text in enumerate(assistant_turns):
        if i:
            history.append({"role": role, "content": f"observation {i}"})
        history.append({"role": "assistant", "content": text})
    return history


# ---------------------------------------------------------------- evaluator


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("2 ** 3 ** 2", 512),  # right-associative
        ("-2 ** 2", -4),  # ** binds tighter than unary minus
        ("(-2) ** 2", 4),
        ("--3", 3),
        ("+4 - -4", 8),
        ("7 // 2", 3),
        ("-7 // 2", -4),
        ("7 % 3", 1),
        ("-7 % 3", 2),
        ("7 / 2", 3.5),
        ("6 / 3", 2),  # exact: an int
        ("2.5 * 2", 5),
        ("0.5 + 0.25", 0.75),
        ("2 ** -1", 0.5),
        ("4 ** 0.5", 2),
        ("  12 \n *\t3 ", 36),  # whitespace anywhere between tokens
        ("((((((1))))))", 1),
        ("1_000 + 1", 1001),
    ],
)
def test_evaluate_values(expression, value):
    result = evaluate(expression)
    assert result == value
    assert type(result) is type(value)


def test_floats_that_are_not_exact_stay_floats_and_display_rounded():
    assert isinstance(evaluate("0.1 + 0.2"), float)
    assert format_number(evaluate("0.1 + 0.2")) == "0.3"
    assert format_number(evaluate("1 / 3")) == "0.333333"
    assert format_number(evaluate("-2 / 3")) == "-0.666667"
    assert format_number(evaluate("10 / 4")) == "2.5"
    assert format_number(evaluate("1 / 10 ** 9")) == "1e-09"
    assert format_number(evaluate("10 ** 29 / 3")) == "3.33333e+28"
    assert format_number(123) == "123"
    assert format_number(-4.0) == "-4"
    assert format_number(evaluate("10 ** 30")) == str(10**30)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("1 / 0", "division by zero"),
        ("1 // 0", "division by zero"),
        ("1 % 0", "division by zero"),
        ("1.5 / (2 - 2)", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 65", "number too large"),
        ("2 ** -65", "number too large"),
        ("1000001 ** 2", "number too large"),
        ("10 ** 31", "number too large"),
        ("9" * 31, "number too large"),
        ("1e31", "number too large"),
        ("1e999 - 1e999", "number too large"),
        ("10 ** 20 * 10 ** 20", "number too large"),
        ("(-8) ** 0.5", "result is not a real number"),
        ("1 +", "malformed expression"),
        ("", "empty expression"),
        ("   ", "empty expression"),
        ("1" + " + 1" * 70, "expression too long"),  # under MAX_CHARS, over MAX_NODES
        ("-" * 100 + "1", "expression too long"),  # too deep
        ("1" * (MAX_CHARS + 1), "expression too long"),
    ],
)
def test_evaluate_refuses(expression, message):
    with pytest.raises(CalculatorError) as info:
        evaluate(expression)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "expression",
    [
        "x + 1",
        "abs(-3)",
        "pow(2, 3)",
        "(1).real",
        "[1, 2][0]",
        "1, 234",
        "1,234",
        "lambda: 1",
        "'a' * 3",
        "b'a'",
        "True + 1",
        "None",
        "1j * 1j",
        "1 < 2",
        "1 and 2",
        "~1",
        "1 << 3",
        "1 & 3",
        "1 if 1 else 2",
        "__import__('os').system('x')",
        "__builtins__",
        "().__class__.__bases__[0].__subclasses__()",
        "[x for x in (1, 2)]",
        "{1: 2}",
        "f'{1}'",
        "(y := 3)",
    ],
)
def test_evaluate_allows_only_arithmetic(expression):
    with pytest.raises(CalculatorError) as info:
        evaluate(expression)
    assert str(info.value) == ALLOWED


def test_evaluate_never_runs_code(monkeypatch):
    import builtins
    import os

    def boom(*args, **kwargs):
        raise AssertionError("code was run")

    for module, name in ((os, "system"), (builtins, "open"), (builtins, "eval"), (builtins, "exec")):
        monkeypatch.setattr(module, name, boom)
    for expression in ("__import__('os').system('x')", "exec('1')", "eval('1')", "open('/etc/passwd')"):
        with pytest.raises(CalculatorError):
            evaluate(expression)


def test_calculator_error_is_a_value_error():
    assert issubclass(CalculatorError, ValueError)
    with pytest.raises(ValueError):
        evaluate("1 / 0")


# ---------------------------------------------------------------- CalculatorEnv


def test_calculator_env_is_an_environment():
    env = CalculatorEnv()
    assert isinstance(env, Environment)
    assert env.name == "calculator"
    assert "<calc>" in env.instruction and "<answer>" in env.instruction
    assert env.role == "user"
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.role = "tool"  # type: ignore[misc]


def test_calculator_call_gets_its_result():
    obs = step(CalculatorEnv(), conversation("Let me compute. <calc>12 * (3 + 4)</calc>"))
    assert obs == Observation(text="<result>84</result>", reward=0.0, done=False, role="user")
    obs = step(CalculatorEnv(role="tool"), conversation("<calc>1/3</calc>"))
    assert (obs.text, obs.done, obs.role) == ("<result>0.333333</result>", False, "tool")


def test_calculator_bad_call_gets_an_error_and_goes_on():
    obs = step(CalculatorEnv(), conversation("<calc>1 / 0</calc>"))
    assert obs == Observation(text="<error>division by zero</error>", role="user")
    obs = step(CalculatorEnv(), conversation("<calc>__import__('os').system('x')</calc>"))
    assert obs.text == f"<error>{ALLOWED}</error>" and not obs.done


def test_calculator_uses_the_last_complete_call():
    obs = step(CalculatorEnv(), conversation("<calc>1+1</calc> then <calc>2*5</calc> and <calc>3+"))
    assert obs.text == "<result>10</result>"
    obs = step(CalculatorEnv(), conversation("<calc>oops <calc>6*7</calc>"))
    assert obs.text == "<result>42</result>"
    obs = step(CalculatorEnv(), conversation("<calc>\n  2 +\n 2\n</calc>"))
    assert obs.text == "<result>4</result>"


def test_calculator_answer_ends_the_trajectory_with_no_reward():
    obs = step(CalculatorEnv(), conversation("<calc>2+2</calc>", "So it is <answer>4</answer>"))
    assert obs.done and obs.reward == 0.0
    obs = step(CalculatorEnv(), conversation("<calc>2+2</calc> <answer>4</answer>"))  # the answer wins
    assert obs.done


def test_calculator_turn_with_neither_ends_the_trajectory():
    assert step(CalculatorEnv(), conversation("I think it is four.")).done
    assert step(CalculatorEnv(), conversation("<calc>2+2")).done  # no complete call
    assert step(CalculatorEnv(), []).done  # no assistant turn at all


def test_calculator_reads_only_the_last_assistant_message():
    history = conversation("<calc>2+2</calc>", "Thanks, that is all.")
    history[0]["content"] = "<calc>9*9</calc>"  # the question itself is not a call
    history[2]["content"] = "<result>4</result><calc>5*5</calc>"  # nor is an observation
    assert step(CalculatorEnv(), history).done
    history = conversation("<answer>4</answer>", "<calc>3*3</calc>")
    assert step(CalculatorEnv(), history).text == "<result>9</result>"


def test_calculator_is_stateless():
    env, history = CalculatorEnv(), conversation("<calc>3 ** 4</calc>")
    assert step(env, history) == step(env, list(history)) == step(CalculatorEnv(), history)


# ---------------------------------------------------------------- ScriptedEnv


def test_scripted_replies_then_done():
    env = ScriptedEnv()
    assert isinstance(env, Environment) and env.name == "scripted" and env.instruction == ""
    assert asyncio.iscoroutinefunction(env.step)
    assert step(env, conversation("a")) == Observation("observation one", 0.0, False, "tool")
    assert step(env, conversation("a", "b")) == Observation("observation two", 0.0, False, "tool")
    assert step(env, conversation("a", "b", "c")) == Observation(done=True, reward=1.0, role="tool")


def test_scripted_rewards_and_role():
    env = ScriptedEnv(replies=("x", "y", "z"), turn_rewards=(0.25, -1.0), final_reward=0.5, role="user")
    observations = [step(env, conversation(*"abcd"[: k + 1])) for k in range(4)]
    assert [(o.text, o.reward, o.done, o.role) for o in observations] == [
        ("x", 0.25, False, "user"),
        ("y", -1.0, False, "user"),
        ("z", 0.0, False, "user"),  # past turn_rewards: 0
        ("", 0.5, True, "user"),
    ]
    assert step(ScriptedEnv(replies=()), conversation("a")) == Observation(done=True, reward=1.0)


def test_scripted_is_deterministic_and_stateless():
    env = ScriptedEnv()
    second = conversation("a", "b")
    assert step(env, second) == step(env, second)
    assert step(env, conversation("a")).text == "observation one"  # going back: no hidden state
    assert step(env, second[:1] + second[1:]) == step(ScriptedEnv(), second)


def test_scripted_fail_at():
    env = ScriptedEnv(fail_at=1)
    assert step(env, conversation("a")).text == "observation one"
    with pytest.raises(RuntimeError, match="^scripted failure at turn 1$"):
        step(env, conversation("a", "b"))
    with pytest.raises(RuntimeError, match="turn 2"):  # at the final turn too
        step(ScriptedEnv(fail_at=2), conversation("a", "b", "c"))


def test_scripted_garbage_at():
    env = ScriptedEnv(garbage_at=0)
    assert step(env, conversation("a")) == GARBAGE == 42
    assert not isinstance(step(env, conversation("a")), Observation)
    assert step(env, conversation("a", "b")).text == "observation two"


def test_scripted_hang_at():
    env = ScriptedEnv(hang_at=1)

    async def main():
        assert (await asyncio.wait_for(env.step({}, conversation("a")), 0.2)).text == "observation one"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(env.step({}, conversation("a", "b")), 0.2)

    asyncio.run(main())


# ---------------------------------------------------------------- load_environment


class MyEnv:
    """A user's environment class, named as rollout.env=<this module>:MyEnv."""

    name = "mine"
    instruction = "Say anything."

    def step(self, record, history):
        return Observation(done=True, reward=float(len(history)))


MY_ENV = MyEnv()


def make_env():
    return ScriptedEnv(replies=("from a factory",), name="made")


class CallableEnv(MyEnv):
    """An environment instance that is also callable: used as it is, not called."""

    def __call__(self):
        raise AssertionError("an environment instance must not be called")


CALLABLE_ENV = CallableEnv()
NOT_AN_ENV = object()


def not_an_env_factory():
    return "just a string"


def failing_factory():
    raise ValueError("no API key\nsecond line")


class Namespace:
    inner = MyEnv


def test_tests_are_importable_as_a_package():
    assert __name__ == "tests.unit.test_environments"


def test_builtins():
    assert BUILTIN == ("calculator", "scripted")
    calc, scripted = load_environment("calculator"), load_environment(" scripted ")
    assert calc == CalculatorEnv() and scripted == ScriptedEnv()
    assert describe(calc) == "calculator (colocate built-in)"
    assert describe(scripted) == "scripted (colocate built-in)"


def test_module_attr_forms():
    from_class = load_environment(SPEC + "MyEnv")
    assert isinstance(from_class, MyEnv) and isinstance(from_class, Environment)
    assert step(from_class, conversation("a")) == Observation(done=True, reward=2.0)
    assert load_environment(SPEC + "MY_ENV") is MY_ENV
    assert load_environment(SPEC + "CALLABLE_ENV") is CALLABLE_ENV
    made = load_environment(SPEC + "make_env")
    assert made == ScriptedEnv(replies=("from a factory",), name="made")
    assert isinstance(load_environment(SPEC + "Namespace.inner"), MyEnv)
    assert describe(from_class) == "mine (tests.unit.test_environments.MyEnv)"
    assert describe(made) == "made (colocate built-in)"


def test_module_attr_from_a_user_file(tmp_path, monkeypatch):
    (tmp_path / "my_user_env.py").write_text(
        "from colocate.rollout.env import Observation\n"
        "class Env:\n"
        "    name = 'user'\n"
        "    instruction = ''\n"
        "    async def step(self, record, history):\n"
        "        return Observation('hi')\n"
    )
    (tmp_path / "broken_user_env.py").write_text("raise ImportError('needs torchvision\\nmore detail')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("my_user_env:Env")
    assert env.name == "user" and step(env, conversation("a")).text == "hi"
    with pytest.raises(ConfigError) as info:
        load_environment("broken_user_env:Env")
    message = str(info.value)
    assert message.startswith("rollout.env=broken_user_env:Env: cannot import module 'broken_user_env'")
    assert "ImportError: needs torchvision" in message and "\n" not in message


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("", "rollout.env: empty"),
        ("calculater", "unknown environment 'calculater'; use one of calculator, scripted, or package.module:attr"),
        ("some.module.Env", "unknown environment"),
        (":Env", "is not package.module:attr"),
        ("colocate.rollout.calculator:", "is not package.module:attr"),
        ("no_such_package_xyz.envs:Env", "cannot import module 'no_such_package_xyz.envs' (ModuleNotFoundError"),
        (SPEC + "Missing", "has no attribute 'Missing'"),
        (SPEC + "Namespace.missing", "has no attribute 'Namespace.missing'"),
        (SPEC + "NOT_AN_ENV", "object is not an environment (no str name, str instruction, step method)"),
        (SPEC + "not_an_env_factory", "str is not an environment"),
        (SPEC + "failing_factory", "calling failing_factory() failed (ValueError: no API key)"),
        ("colocate.rollout.calculator:evaluate", "calling evaluate() failed (TypeError"),
    ],
)
def test_bad_specs_are_one_line_config_errors(spec, needle):
    with pytest.raises(ConfigError) as info:
        load_environment(spec)
    message = str(info.value)
    assert message.startswith("rollout.env")
    assert needle in message
    assert "\n" not in message
