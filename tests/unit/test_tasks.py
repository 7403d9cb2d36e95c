"""colocate.assets.tasks: prompt sources are deterministic and well-formed; rule rewards score as promised."""

import json

import pytest

from colocate.assets import tasks
from colocate.errors import ColocateError, ConfigError


def test_sentiment_prompts_are_a_deterministic_set_of_a_few_hundred():
    everything = tasks.sentiment_prompts()
    assert 200 <= len(everything) <= 1000
    assert len(set(everything)) == len(everything)
    assert all(p.strip() and "{" not in p for p in everything)
    assert tasks.sentiment_prompts(seed=3) == tasks.sentiment_prompts(seed=3)
    assert tasks.sentiment_prompts(seed=3) != tasks.sentiment_prompts(seed=4)
    assert sorted(tasks.sentiment_prompts(seed=3)) == sorted(everything)
    assert tasks.sentiment_prompts(10, seed=3) == tasks.sentiment_prompts(seed=3)[:10]


def test_load_prompt_source_sentiment():
    prompts = tasks.load_prompt_source("sentiment-prompts", 5, seed=1)
    assert [p.text for p in prompts] == tasks.sentiment_prompts(5, seed=1)
    assert all(p.meta == {} for p in prompts)


def test_jsonl_source(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"question {i}", "id": i} for i in range(6)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    prompts = tasks.load_prompt_source(str(path), seed=0)
    assert sorted(p.text for p in prompts) == [r["prompt"] for r in rows]
    assert all(p.meta["prompt"] == p.text for p in prompts)
    assert prompts == tasks.load_prompt_source(str(path), seed=0)
    assert len(tasks.load_prompt_source(str(path), 2, seed=0)) == 2


@pytest.mark.parametrize(
    "content, words",
    [
        ('{"prompt": "ok"}\nnot json\n', "line 2"),
        ('{"text": "no prompt field"}\n', '"prompt"'),
        ("\n\n", "no prompts"),
    ],
)
def test_bad_jsonl_names_the_field(tmp_path, content, words):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match="data.source") as info:
        tasks.load_prompt_source(str(path))
    assert words in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("spec", ["nonsense", "prompts.csv", "reasoning-gym:no_such_task", "/no/such/file.jsonl"])
def test_bad_source_errors_name_data_source(spec):
    with pytest.raises(ColocateError, match="data.source") as info:
        tasks.load_prompt_source(spec)
    assert "\n" not in str(info.value)


def test_unknown_reasoning_gym_task_lists_valid_ones():
    with pytest.raises(ConfigError, match="chain_sum"):
        tasks.reasoning_gym_reward("no_such_task")


def test_vader_reward_sign():
    assert tasks.vader_reward("I love this, it is wonderful and delightful!") > 0.5
    assert tasks.vader_reward("This is terrible, awful and disappointing.") < -0.5
    assert tasks.vader_reward("The box is on the table.") == 0.0
    assert tasks.sentiment_reward({}, "What a great day!") == tasks.vader_reward("What a great day!")


def test_reasoning_gym_prompts_and_reward():
    pytest.importorskip("reasoning_gym")
    prompts = tasks.reasoning_gym_prompts("chain_sum", 4, seed=0)
    assert len(prompts) == 4
    assert [p.text for p in prompts] == [p.text for p in tasks.load_prompt_source("reasoning-gym:chain_sum", 4, 0)]
    assert all("<answer>" in p.text for p in prompts)
    reward = tasks.reasoning_gym_reward("chain_sum")
    for p in prompts:
        answer = p.meta["answer"]
        assert reward(p.meta, f"Let me add. <answer>{answer}</answer>") == 1.0
        assert reward(p.meta, answer) == 1.0  # no tags: the whole response is the answer
        assert reward(p.meta, f"<answer>{int(answer) + 1}</answer>") < 1.0
        assert reward(p.meta, "no idea") < 1.0
