"""Issue 40.1 end to end: a run on a user's parquet dataset whose prompts are chat messages
(a system turn, a user turn), with `data.answer_key`: the reward function gets each row as
its record, the answer under "answer"; the engines serve the chat-formatted prompts."""

from __future__ import annotations

import datasets
import pytest

from colocate import api
from colocate.config import load_config
from tests.conftest import THREADS  # one thread per engine: pooled across modes

pytestmark = pytest.mark.slow
SEEDS = (3, 4)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)


def test_a_run_on_a_parquet_dataset_of_chat_messages(tiny_actor_path, tiny_rm_path, tmp_path, engine_pool):
    rows = [{"messages": [{"role": "system", "content": "You are terse."},
                          {"role": "user", "content": f"What is {i} + {i}?" + ("<|im_start|>" if i == 3 else "")}],
             "solution": f"#### {2 * i}", "id": i} for i in range(8)]
    source = tmp_path / "gsm.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(source))
    seen = []

    def answer_check(record, text):
        seen.append(record)
        return 1.0 if record["answer"].removeprefix("#### ") in text else 0.0

    cfg = load_config(overrides=[
        f"models.actor={tiny_actor_path}", f"models.reward={tiny_rm_path}", f"run.out_dir={tmp_path / 'run'}",
        f"data.source={source}", "data.prompt_key=messages", "data.answer_key=solution", "data.eval_prompts=0",
        "rollout.batch_size=4", "rollout.max_new_tokens=8", "ppo.minibatches=2", "run.steps=1", "run.save_every=1",
        "data.max_prompt_tokens=512", "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192",
        "engines.device=cpu", "models.dtype=float32", *THREADS])
    summary = api.train(cfg, reward_fns=[answer_check], quiet=True, engines=engine_pool)
    assert [h["trained_samples"] for h in summary.history] == [4]
    assert len(seen) >= 4
    for record in seen:
        assert record == {**rows[record["id"]], "answer": rows[record["id"]]["solution"]}


@pytest.mark.parametrize("prompt_key,reward", [
    ("question", ("reward.rule=math",)),  # a question column, scored by the math rule
    ("messages", ("reward.fns=tests.unit.reward_fns_for_tests:says_seven",)),  # chat messages, a function by name
])
def test_a_tiny_model_learns_a_gsm8k_like_parquet(tiny_pair, run_overrides, tmp_path, engine_pool, prompt_key, reward):
    """Every answer is 7: a random policy's last number is almost never 7 (reward ~0); GRPO
    on the dataset's answers must raise it well above that constant's."""
    rows = [{"question": f"What is {a} + {7 - a}?", "answer": f"{a} + {7 - a} = 7\n#### 7",
             "messages": [{"role": "system", "content": "Answer with a number."},
                          {"role": "user", "content": f"What is {a} + {7 - a}?"}]} for a in range(8)] * 4
    source = tmp_path / "gsm.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(source))
    cfg = load_config(overrides=run_overrides(
        tiny_pair("loop", *SEEDS), tmp_path / "run", f"data.source={source}", f"data.prompt_key={prompt_key}",
        "data.answer_key=answer", "reward.kind=rule", *reward, "rollout.batch_size=16", "rollout.group_size=8",
        "ppo.advantage=grpo", "rollout.max_new_tokens=3", "ppo.actor_lr=1e-2", "ppo.kl_kind=fixed", "ppo.kl_coef=0",
        "ppo.minibatches=1", "run.steps=30", "run.eval_every=0", "run.save_every=0"))
    summary = api.train(cfg, quiet=True, engines=engine_pool)
    rewards = [h["reward_mean"] for h in summary.history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15 and last > 0.5, rewards
    # a group's prompt once in the trainer (ppo.shared_prefix): 16 rows, 2 prompts of P tokens
    for h in summary.history:
        prompt = (h["train/tokens_samples"] - h["response_len"] * 16) / 16
        assert h["train/tokens_computed"] == pytest.approx(h["train/tokens_samples"] - 14 * prompt)
