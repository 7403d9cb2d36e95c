"""CLI surface through click's runner: help everywhere, config errors as one line."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from colocate.cli import main


@pytest.mark.parametrize("cmd", [[], ["train"], ["bench"], ["doctor"], ["prepare"], ["export"], ["generate"]])
def test_help_everywhere(cmd):
    result = CliRunner().invoke(main, [*cmd, "--help"])
    assert result.exit_code == 0 and "Usage:" in result.output


@pytest.mark.parametrize("args,said", [
    (["export", "/no/such/run"], "error: colocate export: Invalid value for 'RUN': Directory '/no/such/run' does not "
                                 "exist. (colocate export --help)"),
    (["generate"], "error: colocate generate: Missing argument 'MODEL'. (colocate generate --help)"),
    (["train", "--nproc", "abc"], "error: colocate train: Invalid value for '--nproc': 'abc' is not a valid integer "
                                  "range. (colocate train --help)"),
    (["train", "--bogus"], "error: colocate train: No such option '--bogus'. (colocate train --help)"),
    (["nosuch"], "error: colocate: No such command 'nosuch'. (colocate --help)"),
])
def test_a_usage_error_is_one_line_naming_the_command(args, said):
    """Before: click's usage line, a hint, a blank line and its 'Error: ...'."""
    result = CliRunner().invoke(main, args, prog_name="colocate")
    assert result.exit_code == 2 and result.output.strip() == said, result.output


def test_a_bare_command_shows_the_help_and_version_exits_zero():
    bare = CliRunner().invoke(main, [], prog_name="colocate")
    assert bare.exit_code == 2 and bare.output.startswith("Usage: colocate [OPTIONS] COMMAND"), bare.output
    version = CliRunner().invoke(main, ["--version"], prog_name="colocate")
    assert version.exit_code == 0 and version.output.startswith("colocate, version "), version.output


def test_train_print_config_applies_overrides():
    result = CliRunner().invoke(main, ["train", "--print-config", "--set", "run.steps=7", "--set", "overlap.mode=oppo"])
    assert result.exit_code == 0
    assert "steps: 7" in result.output and "mode: oppo" in result.output


@pytest.mark.parametrize("args,needle", [
    (["--set", "run.stepz=3"], "did you mean 'run.steps'"),
    (["--set", "ppo.epochs=abc"], "ppo.epochs: expected int"),
    (["--set", "rollout.batch_size=3"], "divisible by ppo.minibatches"),
    (["--set", "overlap.mode=fast"], "overlap.mode"),
    (["--set", "noequals"], "expected section.field=value"),
    (["does-not-exist.yaml"], "does not exist"),
    (["--set", "ppo.kl_coef=-1"], "ppo.kl_coef must be > 0"),
    (["--set", "ppo.kl_horizon=0"], "ppo.kl_horizon must be > 0"),
    (["--set", "reward.fn_timeout_s=-1"], "reward.fn_timeout_s must be >= 0 and finite (0: no deadline)"),
    (["--set", "reward.fn_timeout_s=inf"], "reward.fn_timeout_s: expected a finite number, got 'inf'"),
    # found by hand (2026-11-29): each of these passed the checks or was a traceback
    (["--set", "ppo.actor_lr=nan"], "ppo.actor_lr: expected a finite number, got 'nan'"),  # trained NaN weights
    (["--set", "reward.scale=-inf"], "reward.scale: expected a finite number"),
    (["--set", "rollout.group_size=0"], "rollout.group_size must be >= 1"),  # ZeroDivisionError
    (["--set", "engines.device=tpu"], "engines.device: 'tpu' is not one of ['auto', 'cpu', 'cuda']"),  # torch's
    (["--set", "run.seed=-1"], "run.seed and data.seed must be in [0, 2**32)"),  # SGLang's ValueError at start
    (["--set", "rollout.top_p=0"], "rollout.top_p: 0.0 must be in (0, 1]"),
    (["--set", "rollout.top_p=1.5"], "rollout.top_p: 1.5 must be in (0, 1]"),
    (["--set", "engines.mem_fraction_static=1"], "engines.mem_fraction_static: 1.0 must be in (0, 1)"),
    (["--set", "overlap.mode=oppo", "--set", "reward.kind=rule", "--set", "reward.rule=vader"],
     "with reward.kind=rule use overlap.mode=inter"),
])
def test_bad_config_is_one_line(args, needle):
    result = CliRunner().invoke(main, ["train", *args, "--print-config"])
    assert result.exit_code == 2
    err = result.output.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  steps: [1,\n")
    result = CliRunner().invoke(main, ["train", str(bad), "--print-config"])
    assert result.exit_code == 2 and "not valid YAML" in result.output


@pytest.mark.parametrize("text,said", [
    ("run:\n  steps: 3\n  steps: 4\n", "run.steps is given twice (lines 2 and 3); keep one"),
    # a second section replaced the first whole: ppo.epochs went back to its default unsaid
    ("ppo:\n  epochs: 3\nrollout:\n  batch_size: 4\nppo:\n  actor_lr: 1.0e-6\n", "ppo is given twice (lines 1 and 5)"),
    ("engines:\n  sglang:\n    - {a: 1, a: 2}\n", "engines.sglang.a is given twice (lines 3 and 3)"),
])
def test_a_key_given_twice_in_the_yaml_is_one_line(tmp_path, text, said):
    """Before: YAML's last one won, silently."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    result = CliRunner().invoke(main, ["train", str(path), "--print-config"])
    assert result.exit_code == 2 and f"error: config file '{path}': {said}" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_bench_rejects_unknown_mode():
    result = CliRunner().invoke(main, ["bench", "--modes", "sequential,turbo"])
    assert result.exit_code == 2 and "turbo" in result.output


@pytest.mark.parametrize("option", ["--repeats", "--steps", "--batch", "--max-new-tokens", "--budget-s", "--quiet-wait",
                                    "--delta", "--chunk-size"])
def test_bench_refuses_a_negative_count_before_running(option):
    """Before (2026-11-29): --repeats -1 and --budget-s -5 ran the bench as if unset."""
    result = CliRunner().invoke(main, ["bench", option, "-1"])
    assert result.exit_code == 2 and f"Invalid value for '{option}': -1" in result.output, result.output


@pytest.mark.parametrize("flags", [["--quick", "--full"], ["--full", "--gpu"], ["--gpu", "--quick"]])
def test_bench_takes_one_preset(flags):
    """Before: the last preset flag given won, silently."""
    result = CliRunner().invoke(main, ["bench", *flags])
    assert (result.exit_code, result.output) == (2, f"error: {' and '.join(sorted(flags, key=PRESET_ORDER.index))}: "
                                                    "one preset at a time\n")


PRESET_ORDER = ["--quick", "--full", "--gpu"]


def test_bench_rejects_no_mode():
    result = CliRunner().invoke(main, ["bench", "--modes", " , "])
    assert result.exit_code == 2 and result.output.startswith("error: --modes: empty; give a comma list of")


@pytest.mark.parametrize("args,needle", [
    (["--variant", "grpo ppo.advantage=grpo"], "add --convergence"),
    (["--convergence", "--variant", "grpo"], "NAME KEY=VALUE"),
    (["--convergence", "--variant", "oppo ppo.advantage=grpo"], "already the name"),
    (["--convergence", "--modes", "sequential", "--variant", "inter ppo.epochs=1"], "already the name"),
    (["--convergence", "--variant", "a ppo.epochs=1", "--variant", "a ppo.epochs=2"], "already the name"),
    (["--seeds", "3"], "--seeds repeats the --convergence study's runs; add --convergence"),
    (["--convergence", "--seeds", "0"], "--seeds must be >= 1"),
])
def test_bench_variant_errors_are_one_line(args, needle):
    result = CliRunner().invoke(main, ["bench", *args])
    assert result.exit_code != 0 and needle in result.output and "Traceback" not in result.output


def test_a_rank_killed_by_a_signal_is_named_in_one_line():
    from colocate.launch import failure_line

    assert failure_line(1, 2, 2) == "rank 1 (exit code 2) of 2 failed first; its error is printed above"
    killed = failure_line(0, -9, 2)
    assert killed.startswith("rank 0 of 2 was killed by SIGKILL (most likely the kernel's out-of-memory killer")
    assert "\n" not in killed
    assert failure_line(0, -15, 4) == "rank 0 of 4 was killed by SIGTERM; the other ranks stopped after it"


def test_a_collective_broken_by_a_lost_rank_is_one_line_and_other_errors_are_not_hidden():
    from colocate import cli
    from colocate.trainer.distributed import lost_peer

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
                        "[127.0.0.1]:35251: Connection reset by peer. This is typically caused by a remote worker")
    assert lost_peer(gloo) and not lost_peer(RuntimeError("CUDA error: out of memory"))

    def broken():
        raise gloo

    with pytest.raises(SystemExit) as ended:
        cli._friendly(broken)()
    assert ended.value.code == 2

    def bug():
        raise RuntimeError("a real bug")

    with pytest.raises(RuntimeError, match="a real bug"):  # not every RuntimeError becomes a line
        cli._friendly(bug)()


def test_the_lost_rank_line_names_the_collective_error(capsys):
    from colocate import cli

    def broken():
        raise RuntimeError("Connection closed by peer [127.0.0.1]:5000\nmore")

    with pytest.raises(SystemExit):
        cli._friendly(broken)()
    err = capsys.readouterr().err.strip()
    assert err == ("error: another rank went away during a collective (Connection closed by peer [127.0.0.1]:5000); "
                   "the rank that failed first says why (the launcher's last line names it)")


def test_a_section_is_checked_once_the_file_and_the_overrides_both_apply(tmp_path):
    """ppo.kl_coef=0 alone is refused (0 only with ppo.kl_kind=fixed): from the file with
    the other half in --set, the section is built once, from both."""
    cfg = tmp_path / "my.yaml"
    cfg.write_text("ppo:\n  kl_coef: 0\n")
    result = CliRunner().invoke(main, ["train", str(cfg), "--set", "ppo.kl_kind=fixed", "--print-config"])
    assert result.exit_code == 0 and "kl_kind: fixed" in result.output
    result = CliRunner().invoke(main, ["train", str(cfg), "--print-config"])
    assert result.exit_code == 2 and "ppo.kl_coef must be > 0" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA says")
@pytest.mark.parametrize("args,said", [
    (["train", "--set", "engines.device=cuda", "--check"], "error: engines.device=cuda: torch sees no CUDA device"),
    (["generate", "smollm2", "--prompt", "hi", "--device", "cuda"], "error: --device cuda: torch sees no CUDA device"),
    (["doctor", "--device", "cuda"], "error: --device cuda: torch sees no CUDA device"),
])
def test_cuda_asked_of_a_machine_without_it_is_one_line(args, said):
    """Before: train ended in a traceback from the process group's start ("ProcessGroupNCCL is
    only supported with GPUs"), generate and doctor in torch's "Found no NVIDIA driver"."""
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and result.output.startswith(said), result.output
    assert len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("option,value", [("--device", "tpu"), ("--dtype", "float8")])
def test_generate_names_its_own_option_for_a_bad_choice(option, value):
    """Before: the line named the config field it was passed on as (engines.device, models.dtype)."""
    result = CliRunner().invoke(main, ["generate", "smollm2", "--prompt", "hi", option, value])
    assert result.exit_code == 2 and f"Invalid value for '{option}': '{value}' is not one of" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA says")
@pytest.mark.parametrize("hidden", ["", "-1"])
def test_hidden_gpus_are_named_as_the_reason(monkeypatch, hidden):
    from colocate.run.builder import cuda_missing

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    assert cuda_missing() == (f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU" if torch.version.cuda else
                              f"this torch ({torch.__version__}) is built without CUDA")


@pytest.mark.parametrize("n", ["0", "-1"])
def test_nproc_below_one_is_refused_by_check_too(n):
    """Before: --nproc 0 --check was a ZeroDivisionError, --nproc -1 --check said ok."""
    result = CliRunner().invoke(main, ["train", "--nproc", n, "--check"])
    assert result.exit_code == 2 and f"Invalid value for '--nproc': {n} is not in the range x>=1" in result.output


@pytest.mark.parametrize("override,said", [
    ("ppo.clip_eps=-0.2", "ppo.clip_eps must be > 0"),
    ("ppo.value_clip_eps=0", "ppo.value_clip_eps must be > 0"),
    ("ppo.gamma=1.5", "ppo.gamma and ppo.lam must be in [0, 1]"),
    ("ppo.lam=-0.1", "ppo.gamma and ppo.lam must be in [0, 1]"),
    ("ppo.actor_lr=-1e-5", "ppo.actor_lr and ppo.critic_lr must be >= 0"),
    ("ppo.weight_decay=-0.1", "ppo.weight_decay must be >= 0"),
    ("ppo.max_grad_norm=0", "ppo.max_grad_norm must be > 0"),
    ("ppo.value_coef=-1", "ppo.value_coef must be >= 0"),
    ("run.save_every=-1", "run.save_every and run.keep_checkpoints must be >= 0"),
    ("run.keep_checkpoints=-2", "run.save_every and run.keep_checkpoints must be >= 0"),
    ("run.train_threads=-1", "run.train_threads must be >= 0"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens must be >= 1"),
    ("rollout.length_sigma=0", "rollout.length_sigma and rollout.pareto_alpha > 0"),
    ("rollout.length_median=-4", "rollout.length_median must be >= 0"),
    ("engines.actor_max_total_tokens=0", "engines.actor_max_total_tokens and engines.reward_max_total_tokens must be"),
    ("engines.sync_bucket_mb=0", "engines.sync_bucket_mb must be >= 1"),
    ("engines.reward_threads=-1", "engines.actor_threads and engines.reward_threads must be >= 0"),
    ("overlap.feeder_timeout_s=0", "overlap.feeder_timeout_s must be > 0"),
    ("overlap.is_cap=0", "overlap.is_cap must be > 0"),
])
def test_a_number_out_of_its_range_is_one_line(override, said):
    """Before: each was accepted (a negative learning rate trained away from the reward, a
    negative save_every wrote no checkpoint, a 0 KV pool failed later in another line)."""
    result = CliRunner().invoke(main, ["train", "--set", override, "--print-config"])
    assert result.exit_code == 2 and said in result.output and len(result.output.strip().splitlines()) == 1, \
        result.output


@pytest.mark.parametrize("override", ["ppo.actor_lr=0", "ppo.gamma=0", "ppo.lam=1", "run.save_every=0",
                                      "run.keep_checkpoints=0", "overlap.max_staleness=0", "rollout.length_median=0"])
def test_the_edges_that_mean_something_stay(override):
    assert CliRunner().invoke(main, ["train", "--set", override, "--print-config"]).exit_code == 0


def test_the_cli_starts_without_the_run_builder():
    """Every command (--help, a config error) imports colocate.cli first; the run's builder
    (transformers, the rollout wing) comes only with the command that needs it. A doctor
    import at the top once doubled the CLI's start (1.3 -> 2.9 s here)."""
    import subprocess
    import sys

    code = "import sys, colocate.cli; print(sorted(m for m in ('colocate.run.builder', 'transformers') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
