"""After training: export the actor of a real 2-step run and sample from it with SGLang,
compared against HF transformers' greedy decoding of the exported folder; the CLI faces."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForCausalLM, AutoTokenizer

from colocate import api
from colocate.run import checkpoint
from colocate.cli import main
from colocate.config import load_config
from colocate.assets.tasks import chat_prompt_ids
from colocate.tools.sample import model_folder

pytestmark = pytest.mark.slow
SEEDS = (11, 12)  # its tiny_pair: modules with equal seeds run one after another on the pool's engines (conftest)
PROMPTS = ["tell me about rainy days", "what is a good breakfast?"]


@pytest.fixture(scope="module")
def trained_run(tiny_pair, run_overrides, tmp_path_factory, engine_pool):
    models = tiny_pair("export", *SEEDS)
    out = tmp_path_factory.mktemp("export-run")
    cfg = load_config(overrides=run_overrides(models, out, "run.steps=2", "rollout.max_new_tokens=8",
                                              "ppo.actor_lr=1e-3", "run.eval_every=0"))
    summary = api.train(cfg, quiet=True, engines=engine_pool)
    assert summary.steps == 2
    return summary, models[0]


def test_export_holds_the_trained_weights(trained_run):
    summary, base = trained_run
    folder = summary.export_actor()
    _, parts = checkpoint.load(checkpoint.latest(summary.checkpoint_dir))
    want = parts["trainer"]["actor"]["model"]
    got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    before = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    assert set(want) <= set(got)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    assert any(not torch.equal(got[n], before[n]) for n in want)  # training moved the weights


def test_generate_from_the_run_equals_hf_greedy_on_the_export(trained_run):
    summary, _ = trained_run
    out = api.generate(summary.out_dir, PROMPTS, max_new_tokens=10)
    folder = summary.out_dir / "export" / checkpoint.latest(summary.checkpoint_dir).name.replace("step", "actor_step")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    stop = [t for t in {tokenizer.eos_token_id, tokenizer.pad_token_id} if t is not None]
    assert [g.prompt for g in out] == PROMPTS
    for g in out:
        ids = chat_prompt_ids(tokenizer, g.prompt)
        hf = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=stop,
                            pad_token_id=stop[0])[0, len(ids):].tolist()
        strip = lambda t: t[:-1] if t and t[-1] in stop else t  # noqa: E731 - whether the stop token is kept
        assert strip(g.token_ids) == strip(hf)
        assert g.response == tokenizer.decode(g.token_ids, skip_special_tokens=True)
        assert g.finish_reason in ("stop", "length")


def test_cli_export_and_generate(trained_run, tmp_path):
    summary, _ = trained_run
    runner = CliRunner()
    exported = runner.invoke(main, ["export", str(summary.out_dir), "--out", str(tmp_path / "actor")])
    assert exported.exit_code == 0, exported.output
    assert exported.output.strip().endswith("actor") and (tmp_path / "actor" / "model.safetensors").is_file()

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    result = runner.invoke(main, ["generate", str(tmp_path / "actor"), "--prompts-file", str(prompts),
                                  "--max-new-tokens", "6", "--jsonl"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines() if line.startswith("{")]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert all(1 <= len(r["token_ids"]) <= 6 for r in rows)


@pytest.mark.parametrize("args,needle", [
    (["generate", "{run}"], "no prompts: pass --prompt"),
    (["generate", "{run}", "--prompts-file", "{blank}"], "blank.txt: no prompts in it (one a line"),
    (["generate", "{run}", "--prompt", "x", "--temperature", "-1"], "--temperature -1.0: must be >= 0"),
    (["generate", "{run}", "--prompt", "x", "--temperature", "inf"], "--temperature inf: must be >= 0 and finite"),
    (["generate", "{run}", "--prompt", "x", "--max-new-tokens", "100000"], "> the model's context of"),  # no engine
    (["generate", "/no/such/model", "--prompt", "x"], "model: '/no/such/model' is neither a model folder"),
    (["export", "{empty}"], "export: no checkpoint under"),
])
def test_cli_bad_input_is_one_line(trained_run, tmp_path, args, needle):
    summary, _ = trained_run
    model_folder(str(summary.out_dir))  # the run's actor exported once (its two lines), whichever test runs first
    (tmp_path / "empty").mkdir()
    (tmp_path / "blank.txt").write_text("\n  \n")
    args = [a.format(run=summary.out_dir, empty=tmp_path / "empty", blank=tmp_path / "blank.txt") for a in args]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert needle in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


class _Planted:
    """A pickled object with a side effect, as a tampered checkpoint would carry."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _tampered(run_dir, dest, marker):
    """A copy of ``run_dir`` whose newest checkpoint's trainer part carries a planted object,
    its manifest checksum rewritten to match (anyone who can write the folder can)."""
    import hashlib
    import shutil

    shutil.copytree(run_dir, dest)
    ckpt = checkpoint.latest(dest / "checkpoints")
    trainer = torch.load(ckpt / "trainer.pt", weights_only=True)
    trainer["note"] = _Planted(marker)
    torch.save(trainer, ckpt / "trainer.pt")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainer.pt"] = hashlib.sha256((ckpt / "trainer.pt").read_bytes()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return dest


def test_a_tampered_checkpoint_is_refused_in_one_line_and_never_run(trained_run, tmp_path, engine_pool):
    """Issue 38.1: checkpoints were loaded with weights_only=False, so a pickled object's
    __reduce__ ran on export, generate and --resume (tried: a marker file appeared)."""
    from colocate.run.resume import load_run_config

    summary, _ = trained_run
    marker = tmp_path / "planted-ran"
    run = _tampered(summary.out_dir, tmp_path / "run", marker)
    runner = CliRunner()
    for args in (["export", str(run), "--out", str(tmp_path / "x")], ["generate", str(run), "--prompt", "hi"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 2, result.output
        assert "refused: trainer.pt holds an object that is not a tensor or plain data" in result.output
        assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    cfg = load_run_config(run, overrides=["run.steps=3"])
    with pytest.raises(checkpoint.CheckpointError, match=r"--resume: checkpoint .* refused: trainer.pt holds"):
        api.train(cfg, resume=run, quiet=True, engines=engine_pool)
    assert not marker.exists()  # nothing it carried ran
