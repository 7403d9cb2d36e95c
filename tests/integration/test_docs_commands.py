"""Every `colocate …` command of README.md and docs/*.md runs as written.

Each shell line of a fenced code block that starts with `colocate ` (after `&&` too;
`\\` continuations joined, a trailing `# comment` dropped) is run through the real click
CLI, in a folder holding the files the docs name (`my.yaml`, `runs/default`, `sums.parquet`
made by README's own line, ...), with no engine started:

- `colocate train`: as written plus `--check` (config resolved and validated, models,
  reward functions, the data source loaded and tokenized against `data.max_prompt_tokens`,
  prompt + budget against each engine's context: what a run refuses before its first
  engine); with `--print-config`, as written. A command :data:`CONFIG_ONLY` names is
  checked as far as `--print-config` (config resolved and validated) and the reason given;
- `colocate bench`: parsed and validated (modes, workloads, variants, `--set` overrides)
  up to the suite's `run`, which is not started;
- `colocate show`: run as written (on the rows of a fixture run folder);
- `colocate export`, `generate`, `doctor`: parsed by click as written; the test
  :data:`RUN_ELSEWHERE` names runs them end to end.

A command of any other subcommand fails here until it is covered.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from colocate.cli import main
from colocate.config import load_config, to_dict

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = ("", "bash", "sh", "shell", "console", "zsh")

# train commands checked only as far as --print-config: a substring of the command -> why (narrow on purpose)
CONFIG_ONLY = {
    "data.source=hf:openai/gsm8k:main": "a Hugging Face Hub dataset: the suite has no network and no HF cache",
    "models.actor=/models/my-sft": "the reader's own model folders (/models/my-sft, /models/my-rm)",
}
# subcommands parsed here and run end to end by a sibling test (file::test)
RUN_ELSEWHERE = {
    "export": "tests/integration/test_export_generate.py::test_cli_export_and_generate",
    "generate": "tests/integration/test_export_generate.py::test_cli_export_and_generate",
    "doctor": "tests/integration/test_quiet_start.py::test_doctor_prints_no_known_harmless_warnings",
}


def doc_commands() -> list[tuple[str, str]]:
    """(``file:line``, command) of every `colocate` command in a shell fence of the docs."""
    found = []
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        fence, i = None, 0
        while i < len(lines):
            text = lines[i].strip()
            opened = re.match(r"^(`{3,}|~{3,})\s*([\w-]*)", text)
            if opened and fence is None:
                fence = (opened.group(1), opened.group(2).lower())
            elif fence is not None and text.startswith(fence[0]) and text.strip("`~") == "":
                fence = None
            elif fence is not None and fence[1] in SHELL_FENCES:
                start = i
                while text.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    text = text[:-1] + " " + lines[i].strip()
                for part in text.removeprefix("$ ").split("&&"):
                    if part.strip().startswith("colocate "):
                        found.append((f"{doc.relative_to(ROOT)}:{start + 1}", part.strip()))
            i += 1
    return found


def argv(command: str) -> tuple[list[str], str | None]:
    """(arguments after `colocate`, the file of a `> FILE` redirect or None)."""
    words = shlex.split(command, comments=True)
    out = None
    if ">" in words:
        at = words.index(">")
        words, out = words[:at], words[at + 1]
    assert not any(w in ("|", "<", "2>", ";") for w in words), f"shell syntax this test does not run: {command}"
    assert words[0] == "colocate"
    return words[1:], out


COMMANDS = doc_commands()


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    """A folder holding what the docs' commands name, made as the docs make it where they say how."""
    from datasets import Dataset, DatasetDict

    from colocate.monitor import completions
    from colocate.run import checkpoint

    root = tmp_path_factory.mktemp("docs")
    # the docs' my.yaml (docs/config.md) names run.out_dir runs/oppo, the run `--resume runs/oppo` continues with it
    printed = CliRunner().invoke(main, ["train", "--print-config", "--set", "run.out_dir=runs/oppo"])
    assert printed.exit_code == 0, printed.output
    (root / "my.yaml").write_text(printed.output)
    for name in ("default", "oppo", "lora", "sums"):  # a run folder: its config and a checkpoint at step 10
        run = root / "runs" / name
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps(to_dict(load_config(overrides=[f"run.out_dir=runs/{name}"]))))
        checkpoint.save(run / "checkpoints", 10, {"run": {"step": 10}})
        completions.append(run / completions.TRAIN_FILE, [{
            "step": 10, "index": k, "group": k, "prompt": "What do you think of Mondays?", "response": "I love them.",
            "reward": 0.5, "reward_parts": {"model": 0.5}, "length": 4, "model_tokens": 4, "turns": 1,
            "finish_reason": "stop", "deferred": False, "resumed": False, "versions": [[10, 4]]} for k in range(2)])
    # README's own line makes sums.parquet
    [make] = [line for line in (ROOT / "README.md").read_text().splitlines() if "sums.parquet" in line
              and line.startswith("python -c")]
    subprocess.run(make, shell=True, cwd=root, check=True, timeout=300)
    (root / "data").mkdir()
    questions = [f"What do you think of day {k}?" for k in range(8)]
    Dataset.from_list([{"messages": [{"role": "user", "content": q}]} for q in questions]).to_parquet(
        root / "data" / "train.parquet")
    DatasetDict({split: Dataset.from_list([{"prompt": q} for q in questions]) for split in ("train", "test")}
                ).save_to_disk(str(root / "data" / "my_dataset"))
    return root


def test_every_doc_command_is_found():
    files = {where.split(":")[0] for where, _ in COMMANDS}
    assert {"README.md", "docs/config.md", "docs/environments.md", "docs/bench.md"} <= files
    assert len(COMMANDS) >= 30
    # each narrow exception still matches a command, and each sibling test still exists
    for key in CONFIG_ONLY:
        assert any(key in c for _, c in COMMANDS), f"CONFIG_ONLY entry {key!r} matches no doc command: drop it"
    for where in RUN_ELSEWHERE.values():
        path, test = where.split("::")
        assert f"def {test}(" in (ROOT / path).read_text(), where


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_doc_command_runs_as_written(where, command, docs_dir, monkeypatch):
    monkeypatch.chdir(docs_dir)
    args, out = argv(command)
    sub = args[0]
    if sub == "train":
        _train(args, out, command)
    elif sub == "bench":
        _bench(args, monkeypatch, docs_dir)
    elif sub == "show":
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert "sample 0" in result.output and "response: " in result.output
    elif sub in RUN_ELSEWHERE:
        main.commands[sub].make_context(sub, list(args[1:]))  # parsed, its parameters validated (paths, types)
    else:
        pytest.fail(f"{where}: `colocate {sub}` is run by no test; cover it here (or in RUN_ELSEWHERE)")


def _train(args: list[str], out: str | None, command: str) -> None:
    reasons = [why for key, why in CONFIG_ONLY.items() if key in command]
    if "--print-config" in args or reasons:
        run = args if "--print-config" in args else [*args, "--print-config"]
        result = CliRunner().invoke(main, run)
        assert result.exit_code == 0, result.output
        assert "models:" in result.output and "run:" in result.output
        if out is not None:  # `> my.yaml`: the file it writes loads back to the same config
            Path(out).write_text(result.output)
            sets = [b for a, b in zip(args, args[1:]) if a == "--set"]
            assert to_dict(load_config(out)) == to_dict(load_config(None, sets))
        return
    assert out is None
    # each example is a run of its own: the earlier runs in docs_dir's runs/ are not its (a new run there
    # is refused, colocate.run.run_folder); checked as on a machine without them
    fresh = [] if "--resume" in args else ["--set", "run.overwrite_out_dir=true"]
    result = CliRunner().invoke(main, [*args, *fresh, "--check"])
    assert result.exit_code == 0, result.output
    # the check's line (after, on a machine where the default models are not prepared yet, the one-time conversion's)
    assert any(line.startswith("check ok:") for line in result.stdout.splitlines()), result.output


def _bench(args: list[str], monkeypatch, docs_dir: Path) -> None:
    """Parsed and validated by the CLI up to the suite's run, whose options are checked here."""
    import colocate.bench.suite as suite

    seen = []

    def run(opts, log):
        variants = opts.convergence.variants if opts.convergence else ()
        for extra in [(), *(extra for _, extra in variants)]:  # every run's overrides resolve and validate
            load_config(overrides=[*opts.overrides, *extra])
        seen.append(opts)
        folder = docs_dir / "bench-not-run"
        folder.mkdir(exist_ok=True)
        (folder / "report.md").write_text("not run\n")
        return folder

    monkeypatch.setattr(suite, "run", run)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert len(seen) == 1


def test_check_refuses_what_the_run_refuses(docs_dir, monkeypatch):
    """The calculator example without its data.max_prompt_tokens: the run's own start-up line."""
    monkeypatch.chdir(docs_dir)
    result = CliRunner().invoke(main, ["train", "--set", "data.source=reasoning-gym:gsm_symbolic", "--set",
                                       "reward.kind=rule", "--set", "reward.rule=reasoning-gym", "--set",
                                       "rollout.env=calculator", "--set", "run.out_dir=runs/calculator", "--check"])
    assert result.exit_code == 2
    assert "tokens > data.max_prompt_tokens 96" in result.output and "Traceback" not in result.output


if __name__ == "__main__":  # list what the test finds
    for where, command in COMMANDS:
        print(where, command, sep="\t")
    sys.exit(0)
