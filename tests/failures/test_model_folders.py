"""A model folder that is not what colocate needs is one line naming the field, exit 2,
before any engine starts: no model in it (no config.json), no tokenizer transformers can
load (files missing or garbled), a tokenizer without a chat template while prompts are
put in one (a base model: ``data.apply_chat_template=false`` trains on the text as it
is). Before, each of these was a traceback from inside transformers. A reward model or
critic whose tokenizer or embedding does not take the actor's token ids as they are: one
line too (before: it started and read other text than the actor wrote, silently).

The raw-text prompts themselves: ``tokenize_prompts(chat=False)`` against the tokenizer's
own plain-text call, and the environment's observation frame under it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from colocate.assets.random_models import build_tiny_causal_lm, build_tiny_reward_model
from colocate.assets.tasks import Prompt
from colocate.cli import main
from colocate.errors import ConfigError
from colocate.rollout.turns import ObservationTemplate
from colocate.run.preflight import load_tokenizer
from colocate.run.session import tokenize_prompts

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def actor(tmp_path_factory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("folders") / "actor", seed=3)


def _copy(actor: Path, where: Path, drop: tuple[str, ...] = ()) -> Path:
    shutil.copytree(actor, where)
    for name in drop:
        (where / name).unlink(missing_ok=True)
    return where


def _base_model(actor: Path, where: Path) -> Path:
    """The actor without a chat template: a base model's folder."""
    folder = _copy(actor, where, drop=("chat_template.jinja",))
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    assert load_tokenizer(str(folder), "models.actor").chat_template is None
    return folder


def _check(tmp_path: Path, *sets: str):
    return CliRunner().invoke(main, ["train", "--check", "--set=reward.kind=rule", "--set=reward.rule=vader",
                                     f"--set=run.out_dir={tmp_path / 'run'}", *(f"--set={s}" for s in sets)])


def _one_line(result) -> str:
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, (result.exit_code, result.output[-3000:])
    return lines[0]


@pytest.mark.parametrize("case, expected", [
    ("empty", "error: models.actor: no model at '{path}' (no config.json there)"),
    ("no config.json", "error: models.actor: no model at '{path}' (no config.json there)"),
    ("no tokenizer", "error: models.actor: '{path}' has no tokenizer transformers can load (no tokenizer files there); "
                     "pass a model folder saved with its tokenizer"),
    ("garbled tokenizer.json", "error: models.actor: '{path}' has no tokenizer transformers can load (expected"),
    # before: a JSON traceback from the first start-up check that opened it
    ("truncated config.json", "error: models.actor: {path}/config.json is not a readable JSON file (Expecting "
                              "property name enclosed in double quotes: line 1 column 2 (char 1)); a model folder's "
                              "config.json is the one save_pretrained writes"),
    ("config.json a list", "error: models.actor: {path}/config.json holds a JSON list, not a model config"),
])
def test_a_folder_without_a_model_or_tokenizer_is_one_line(actor, tmp_path, case, expected):
    where = tmp_path / "actor"
    if case == "empty":
        where.mkdir()
    elif case == "no config.json":
        _copy(actor, where, drop=("config.json",))
    elif case == "no tokenizer":
        _copy(actor, where, drop=TOKENIZER)
    elif case.startswith("truncated config.json") or case == "config.json a list":
        _copy(actor, where)
        (where / "config.json").write_text("{" if case.startswith("truncated") else "[]")
    else:
        _copy(actor, where, drop=("tokenizer_config.json", "chat_template.jinja"))
        (where / "tokenizer.json").write_text('{"model": ')
    line = _one_line(_check(tmp_path, f"models.actor={where}"))
    head = expected.format(path=where)
    if head.endswith("(expected"):  # the JSON parser's own words follow
        assert line.startswith(head[: -len("expected")]), line
        assert "pass a model folder saved with its tokenizer" in line, line
    else:
        assert line.startswith(head), line


@pytest.mark.parametrize("case, expected", [
    # before: --check said ok, and the run failed as SGLang loaded the weights
    ("weights cut short", "error: models.actor: {path}/model.safetensors is not a whole safetensors file (Error while "
                          "deserializing header: incomplete metadata, file not fully covered); the download or copy is "
                          "incomplete or damaged: fetch the model again"),
    ("config of another vocabulary", "error: models.actor: '{path}': config.json's vocab_size is 50 but "
                                     "{head} has {rows} rows; the config and the weights are of different models"),
    ("a shard missing", "error: models.actor: '{path}' lacks 1 of the 2 weight files its index names "
                        "(model-00002-of-00002.safetensors); the download or copy is incomplete: fetch the model again"),
    # before: SGLang skipped the names and served random weights; the trainer refused them after the engines started
    ("saved through torch.compile", "error: models.actor: '{path}' holds weights saved through a training wrapper "
                                    "('_orig_mod.{first}': torch.compile's _orig_mod., DDP's module., FSDP's or "
                                    "activation checkpointing's wrapped modules), whose names neither SGLang nor "
                                    "transformers reads, so the model would start at random; save the unwrapped model "
                                    "with save_pretrained"),
])
def test_weights_cut_short_or_of_another_config_are_one_line_before_any_engine(actor, tmp_path, case, expected):
    from safetensors import safe_open

    where = _copy(actor, tmp_path / "actor")
    weights = where / "model.safetensors"
    with safe_open(str(weights), "pt") as f:
        head = next(name for name in f.keys() if name.endswith("embed_tokens.weight"))
        rows = f.get_slice(head).get_shape()[0]
    if case == "weights cut short":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif case == "config of another vocabulary":
        config = json.loads((where / "config.json").read_text())
        (where / "config.json").write_text(json.dumps({**config, "vocab_size": 50}))
        head = "lm_head.weight" if config.get("tie_word_embeddings") is False else head
    elif case == "saved through torch.compile":
        from safetensors.torch import load_file, save_file

        state = load_file(weights)
        with safe_open(str(weights), "pt") as f:
            first = next(iter(f.keys()))
        save_file({f"_orig_mod.{k}": v for k, v in state.items()}, weights, metadata={"format": "pt"})
        expected = expected.replace("{first}", first)
    else:
        weights.rename(where / "model-00001-of-00002.safetensors")
        (where / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    line = _one_line(_check(tmp_path, f"models.actor={where}"))
    if case == "config of another vocabulary":  # the first of the embedding and the head in the file's order
        assert line.startswith(expected.split("{head}")[0].format(path=where)) and line.endswith(
            f"has {rows} rows; the config and the weights are of different models"), line
    else:
        assert line == expected.format(path=where), line
    critic = _copy(where, tmp_path / "critic")  # the trainer's critic folder too, which no engine checks
    line = _one_line(_check(tmp_path, f"models.actor={actor}", f"models.critic={critic}"))
    assert line.startswith("error: models.critic: "), line


def test_a_critic_folder_without_a_model_is_one_line_before_any_engine(actor, tmp_path):
    """The critic backbone is loaded by the trainer, after the engines started (~30 s on CPU):
    its folder is checked with the others (before: a line naming no field, after the start).
    The tiny actor, not the built-in one: on a fresh machine the built-in model is converted
    first, with its progress lines, by whichever run uses it first."""
    (tmp_path / "critic").mkdir()
    line = _one_line(_check(tmp_path, f"models.actor={actor}", f"models.critic={tmp_path / 'critic'}"))
    assert line.startswith(f"error: models.critic: no model at '{tmp_path / 'critic'}' (no config.json there)"), line


def test_lora_targets_the_model_lacks_are_one_line_before_any_engine(actor, tmp_path):
    """Before, PEFT refused them when the trainer was built, after the engines started (~30 s on
    CPU), and a typo beside a real name (q_proj,nope) was skipped silently."""
    line = _one_line(_check(tmp_path, f"models.actor={actor}", "lora.rank=4", "lora.target_modules=q_proj,nope"))
    assert line.startswith("error: lora.target_modules='q_proj,nope': nope names no module of llama"), line
    result = _check(tmp_path, f"models.actor={actor}", "lora.rank=4", "lora.target_modules=q_proj,v_proj")
    assert result.exit_code == 0 and "check ok:" in result.output, result.output[-3000:]


def test_generate_names_its_model_argument_for_an_empty_folder(tmp_path):
    (tmp_path / "nothing").mkdir()
    result = CliRunner().invoke(main, ["generate", str(tmp_path / "nothing"), "--prompt=hi"])
    assert _one_line(result).startswith(f"error: model: no model at '{tmp_path / 'nothing'}' (no config.json there)")


def test_a_base_model_without_a_chat_template_is_one_line_naming_the_switch(actor, tmp_path):
    base = _base_model(actor, tmp_path / "base")
    line = _one_line(_check(tmp_path, f"models.actor={base}"))
    assert line.startswith("error: models.actor: its tokenizer has no chat template (a base model?)"), line
    assert "set data.apply_chat_template=false" in line
    result = _check(tmp_path, f"models.actor={base}", "data.apply_chat_template=false")
    assert result.exit_code == 0 and "check ok:" in result.output, result.output[-3000:]


def test_raw_prompts_are_the_tokenizers_plain_text_ids(actor, tmp_path):
    """``chat=False``: each prompt's ids are what the tokenizer makes of the text itself, with
    its own special tokens added (none for the tiny byte tokenizer, as for Qwen); a special
    token's string in the text stays text; chat messages are refused in one line."""
    tok = load_tokenizer(str(_base_model(actor, tmp_path / "base")), "models.actor")
    texts = ["Write a short review.", "two\nlines", "a forged <|im_start|>system turn"]
    got = tokenize_prompts(tok, [Prompt(t) for t in texts], 512, chat=False)
    for text, prompt in zip(texts, got):
        naive = tok(text, add_special_tokens=True, split_special_tokens=True)["input_ids"]
        assert list(prompt.ids) == naive and tok.decode(list(prompt.ids)) == text
    assert tok.convert_tokens_to_ids("<|im_start|>") not in got[2].ids  # the control token is not forged
    chat = Prompt("hi", messages=({"role": "user", "content": "hi"},), where="line 3 of p.jsonl")
    with pytest.raises(ConfigError, match=r"^data: prompt 0 \(line 3 of p.jsonl\) is chat messages.*"
                                          r"data.apply_chat_template=true"):
        tokenize_prompts(tok, [chat], 512, chat=False)


def test_raw_prompts_frame_observations_as_lines_even_where_a_template_exists(actor):
    """An environment's answer after a model turn: the chat template's frame by default, plain
    lines under ``data.apply_chat_template=false`` (the prompt had no template either)."""
    tok = load_tokenizer(str(actor), "models.actor")
    assert ObservationTemplate(tok, [tok.eos_token_id]).frame("tool") != ("\n", "\n")
    assert ObservationTemplate(tok, [tok.eos_token_id], chat=False).frame("tool") == ("\n", "\n")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    """A reward model with the actor's tokenizer (built apart from it: equal files)."""
    return build_tiny_reward_model(tmp_path_factory.mktemp("folders") / "rm", seed=4)


def _swapped(model: Path, where: Path) -> Path:
    """``model`` whose tokenizer gives 'a' and 'b' each other's ids."""
    folder = _copy(model, where)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def _fewer_rows(model: Path, where: Path, rows: int) -> Path:
    folder = _copy(model, where)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": rows}))
    return folder


def test_a_reward_model_or_critic_of_another_tokenizer_is_one_line(actor, reward_model, tmp_path):
    base = [f"models.actor={actor}", "reward.kind=model"]
    ok = CliRunner().invoke(main, ["train", "--check", f"--set=run.out_dir={tmp_path / 'run'}",
                                   *(f"--set={s}" for s in (*base, f"models.reward={reward_model}"))])
    assert ok.exit_code == 0 and "check ok:" in ok.output, ok.output[-3000:]
    swapped = _swapped(reward_model, tmp_path / "rm-swapped")
    line = _one_line(_check(tmp_path, *base, f"models.reward={swapped}"))
    assert line.startswith("error: models.reward: its tokenizer is not the actor's (2 of the actor's 256 tokens "
                           "have another id there, e.g. 'a' is 100 in the actor's, 101 there); "), line
    assert line.endswith("or reward.kind=rule with reward functions, which read the decoded text"), line
    line = _one_line(_check(tmp_path, *base, f"models.reward={_fewer_rows(reward_model, tmp_path / 'rm-100', 100)}"))
    assert line.startswith("error: models.reward: its embedding has 100 rows, fewer than the actor's 259 "
                           "token ids"), line
    critic = _swapped(actor, tmp_path / "critic-swapped")
    line = _one_line(_check(tmp_path, *base, f"models.reward={reward_model}", f"models.critic={critic}"))
    assert line.startswith("error: models.critic: its tokenizer is not the actor's"), line
    assert line.endswith("or leave models.critic unset (the actor's own backbone)"), line
