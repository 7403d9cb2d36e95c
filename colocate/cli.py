"""The `colocate` command line: a thin click layer over the Python API.

Owns: argument parsing, printing, and turning every error of :data:`~colocate.errors.USER_ERRORS`
(and a collective broken by another rank going away) into one line on stderr with exit
status 2; as the process's owner, the libraries' loading bars off for the commands that
load models unless ``engines.log_level`` asks for them (``colocate.monitor.quiet``), their
one-line replacements on stderr; a quick exit (``colocate.quick_exit``). Leaves out: all
behaviour (``colocate.api``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import sys

import click

from colocate import api, launch
from colocate.assets.tasks import reads_dataset
from colocate.config import EnginesConfig, dump_yaml, load_config
from colocate.errors import USER_ERRORS, ColocateError, in_config_terms
from colocate.monitor import completions
from colocate.monitor.quiet import hide_library_bars
from colocate.monitor.stack_dump import install as print_stacks_on_sigusr1
from colocate.monitor.visible import LAYOUT, visible
from colocate.quick_exit import skip_last_collection
from colocate.tools import doctor as doc
from colocate.tools.export import log_level_of
from colocate.tools.sample import DEVICES, DTYPES, Generation, SampleOptions


def _friendly(fn):
    """Run ``fn``; an error of USER_ERRORS becomes a one-line message, not a traceback (what
    it quotes of a dataset or a reward function shown as data: ``colocate.monitor.visible``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as exc:
            click.echo(f"error: {visible(str(in_config_terms(exc)))}", err=True)
            sys.exit(2)
        except RuntimeError as exc:
            from colocate.trainer.distributed import lost_peer  # not at the top: torch.distributed is slow to import

            if not lost_peer(exc):
                raise
            first = visible(str(exc).strip().splitlines()[0][:160])
            click.echo(f"error: another rank went away during a collective ({first}); the rank that failed "
                       "first says why (the launcher's last line names it)", err=True)
            sys.exit(2)

    return wrapper


def _note(message: str) -> None:
    """A line about the command's progress (on stderr: stdout stays its result)."""
    click.echo(message, err=True)


class _Commands(click.Group):
    """colocate's commands, with click's usage errors (a missing argument, an option's bad
    value, an unknown option) in the CLI's one-line form and exit 2, as every other bad input:
    ``error: colocate export: Invalid value for 'RUN': ... (colocate export --help)``; before,
    click's usage line, a hint line, a blank line and its message."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: ANN001
        if not standalone_mode:  # a caller that handles click's exceptions itself
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:  # a bare `colocate`: the help, as click shows it
            exc.show()
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "colocate"
            click.echo(f"error: {where}: {visible(exc.format_message())} ({where} --help)", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="colocate")
def main() -> None:
    """colocate: SGLang-native PPO with generation, reward scoring and FSDP training
    time-sharing one node.

    \b
    Quick start (CPU is fine):
      colocate doctor          # check the machine, start a tiny engine
      colocate prepare         # convert SmolLM2 + build the default reward model (once)
      colocate train           # PPO on the default sentiment task
      colocate generate runs/default --prompt "Hi!"   # sample the trained actor
    """
    skip_last_collection()  # before the command's own exit hooks: the freeze runs after them all
    print_stacks_on_sigusr1()  # kill -USR1 PID: where a run that seems stuck waits (colocate.monitor.stack_dump)


@main.command()
@click.argument("config", required=False, type=click.Path(dir_okay=False))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config field, e.g. --set run.steps=5 --set ppo.epochs=2.")
@click.option("--resume", type=click.Path(file_okay=False), default=None,
              help="Continue a run folder (or one of its checkpoints) with its own config.json; "
                   "CONFIG and --set apply on top of it.")
@click.option("--print-config", is_flag=True, help="Print the resolved config and exit.")
@click.option("--check", is_flag=True,
              help="Run every check a run makes before its first engine starts (config, models, reward "
                   "functions, prompts loaded and tokenized, context lengths), print one line and exit.")
@click.option("--nproc", type=click.IntRange(min=1), default=1, show_default=True,
              help="Training processes on this node, started by torchrun (one FSDP shard each). "
                   "Several nodes: run torchrun yourself (README, \"Several processes and nodes\").")
@_friendly
def train(config, overrides, resume, print_config, check, nproc):
    """Run PPO. With no arguments: SmolLM2-135M-Instruct learns to answer positively,
    scored by a reward model served in the same SGLang runtime.

    \b
    Examples:
      colocate train
      colocate train my.yaml --set run.steps=50 --set rollout.batch_size=16
      colocate train --resume runs/default
      colocate train --resume runs/default --set run.steps=40
      colocate train --nproc 2
      colocate train --set data.source=prompts.jsonl --check   # would it start?
    """
    from colocate.run.resume import load_run_config  # here, not at the top: it brings torch.distributed

    cfg = load_run_config(resume, config, overrides) if resume else load_config(config, list(overrides))
    if print_config:
        click.echo(dump_yaml(cfg))
        return
    # one line per model loaded instead of the libraries' bars, unless engines.log_level asks for more
    hide_library_bars(cfg.engines.log_level, datasets=reads_dataset(cfg.data.source))
    if check:
        click.echo(api.check(cfg, resume=resume, nproc=nproc).describe())
        return
    if nproc != 1 and not launch.under_torchrun():
        from colocate.run import run_folder  # rank 0 holds the folder; refused here first, without torchrun's lines

        run_folder.check(cfg, resume)
        args = [*([config] if config else []), *(f"--set={o}" for o in overrides),
                *([f"--resume={resume}"] if resume else [])]
        launch.run_torchrun(nproc, args)
        return
    summary = api.train(cfg, resume=resume)
    if summary.is_main:  # under --nproc every rank returns; rank 0 speaks for the run
        click.echo(summary.describe())


def _bench_default(module: str, cls: str, field: str):
    """A bench option's default, read from its options dataclass when the command runs
    (so `colocate train` never imports the bench)."""
    return lambda: getattr(getattr(importlib.import_module(f"colocate.bench.{module}"), cls)(), field)


_COUNT = click.IntRange(min=0)  # 0: the preset's (a negative count is refused, not read as unset)
_NON_NEGATIVE = click.FloatRange(min=0)


@main.command()
@click.option("--quick", is_flag=True, help="Small models, a few minutes on 2 CPU cores (default).")
@click.option("--full", is_flag=True, help="SmolLM2 + the sentiment RM, real prompts; much longer.")
@click.option("--gpu", is_flag=True, help="One GPU: Qwen2.5-0.5B-shaped random actor and reward model, "
              "GRPO and PPO, batch 64, long-tailed budgets up to 1,024 tokens (scripts/gpu_bench.sh).")
@click.option("--shape", default="", help="Random actor and reward model of this shape instead of the preset's models "
              "(e.g. tiny for a dry run, qwen2.5-0.5b).")
@click.option("--batch", "batch_size", type=_COUNT, default=0, help="Batch size (default: the preset's).")
@click.option("--max-new-tokens", type=_COUNT, default=0, help="Response cap (default: the preset's).")
@click.option("--budget-s", type=_NON_NEGATIVE, default=0.0, help="Seconds for the whole bench (0: no limit); modes, "
              "peers and workloads that no longer fit are left out and named in the report.")
@click.option("--workloads", default="", help="Comma list of short,longtail,longtail-grpo,pareto,task,reasoning,tools (default: the preset's; tools: multi-turn with the calculator).")
@click.option("--modes", default="sequential,intra,inter,oppo", show_default=True, help="Comma list of modes.")
@click.option("--repeats", type=_COUNT, default=0, help="Repeats per mode (default: the preset's).")
@click.option("--steps", type=_COUNT, default=0, help="Measured steps per mode and repeat (default: the preset's).")
@click.option("--no-peer", is_flag=True, help="Skip the TRL PPO peer.")
@click.option("--peer-dtype", type=click.Choice(["float32", "bfloat16"]), default=None,
              help="The TRL peers' precision (default: the one colocate's trainer computes in, like for like).")
@click.option("--chunk-size", type=_COUNT, default=16, show_default=True,
              help="Streamed-scoring chunk (tokens; 0: the tuner picks among overlap.chunk_candidates).")
@click.option("--delta", type=_COUNT, default=2, show_default=True, help="Extra requests launched per step (Δ).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Config override of every bench run (repeatable), e.g. --set ppo.epochs=1.")
@click.option("--contended-above", type=_NON_NEGATIVE,
              default=_bench_default("contention", "GuardOptions", "limit_cores"),
              show_default="0.25", help="Cores other processes may use during a step before it is contended "
              "(left out of the medians).")
@click.option("--quiet-wait", type=_NON_NEGATIVE, default=_bench_default("contention", "GuardOptions", "quiet_wait_s"),
              show_default="10", help="Seconds to wait at most for a quiet machine before each step (0: never).")
@click.option("--convergence", is_flag=True,
              help="Time to reward instead of throughput: sequential vs oppo (or --modes) on the default task, "
              "held-out reward vs training seconds.")
@click.option("--convergence-steps", type=int,
              default=_bench_default("convergence", "ConvergenceOptions", "steps"), show_default="30",
              help="--convergence: PPO steps per mode.")
@click.option("--eval-every", type=int,
              default=_bench_default("convergence", "ConvergenceOptions", "eval_every"), show_default="3",
              help="--convergence: held-out evaluation every N steps.")
@click.option("--variant", "variants", multiple=True, metavar='"NAME KEY=VALUE ..."',
              help="--convergence: one more run named NAME with these config overrides (sequential unless "
              'they set overlap.mode), e.g. --variant "grpo ppo.advantage=grpo rollout.group_size=4 '
              'ppo.kl_in=loss". Repeatable.')
@click.option("--seeds", type=int, default=_bench_default("convergence", "ConvergenceOptions", "seeds"),
              show_default="1", help="--convergence: runs of each mode and variant, under run.seed s, s+1, ...; "
              "the report gives the median and range over them.")
@click.option("--out", default="", help="Run folder (default: runs/bench-<preset>-<time>).")
@_friendly
def bench(quick, full, gpu, shape, batch_size, max_new_tokens, budget_s, workloads, modes, repeats, steps, no_peer, peer_dtype, chunk_size, delta, overrides,
          contended_above, quiet_wait, convergence, convergence_steps, eval_every, variants, seeds, out):
    """Throughput benchmark: every mode side by side (interleaved, repeated), the TRL
    peer, the lower bound; writes report.md, results.json and plots. With
    --convergence: time to reward (sequential vs oppo) instead.

    \b
    Examples:
      colocate bench --quick
      colocate bench --full --workloads reasoning --repeats 5
      colocate bench --gpu --budget-s 420        # one lent GPU (scripts/gpu_bench.sh)
      colocate bench --full --convergence --convergence-steps 30
      colocate bench --full --convergence --variant "grpo ppo.advantage=grpo rollout.group_size=4"
      colocate bench --full --convergence --modes sequential --seeds 3 --variant "bf16 models.dtype=bfloat16"
    """
    # here, not at the top: `colocate train` never imports the bench
    from colocate.bench.contention import GuardOptions
    from colocate.bench.convergence import ConvergenceOptions
    from colocate.bench.suite import BenchOptions, run
    from colocate.assets.random_models import MODEL_SHAPES
    from colocate.bench.workloads import MODES, PAUSE_MODES, WORKLOADS, valid_mode

    presets = [name for name, on in (("--quick", quick), ("--full", full), ("--gpu", gpu)) if on]
    if len(presets) > 1:  # before: the last one given won, silently
        raise ColocateError(f"{' and '.join(presets)}: one preset at a time")
    preset = presets[0].removeprefix("--") if presets else "quick"
    mode_list = tuple(m.strip() for m in modes.split(",") if m.strip())
    wl = tuple(w.strip() for w in workloads.split(",") if w.strip())
    bad = [m for m in mode_list if not valid_mode(m)] + [w for w in wl if w not in WORKLOADS]
    if not mode_list:  # before: a ZeroDivisionError from the runner's order of modes
        raise ColocateError(f"--modes: empty; give a comma list of {list(MODES)} or auto")
    if bad:
        raise ColocateError(f"--modes/--workloads: unknown {bad}; modes {list(MODES)} or auto (inter, oppo and auto also as "
                            f"MODE/PAUSE, PAUSE one of {list(PAUSE_MODES)}), workloads {sorted(WORKLOADS)}")
    if shape and shape not in MODEL_SHAPES:
        raise ColocateError(f"--shape: unknown {shape!r}; choose from {sorted(MODEL_SHAPES)}")
    if convergence and (convergence_steps < 1 or eval_every < 1 or seeds < 1):
        raise ColocateError("--convergence-steps, --eval-every and --seeds must be >= 1")
    if seeds != 1 and not convergence:
        raise ColocateError("--seeds repeats the --convergence study's runs; add --convergence")
    parsed = tuple((v.split()[0], tuple(v.split()[1:])) for v in variants if v.split())
    if parsed and not convergence:
        raise ColocateError("--variant is a run of the --convergence study; add --convergence")
    if any(not extra or not all("=" in x for x in extra) for _, extra in parsed):
        raise ColocateError('--variant: expected "NAME KEY=VALUE ...", e.g. "grpo ppo.advantage=grpo rollout.group_size=4"')
    names = [name for name, _ in parsed]
    clash = [n for i, n in enumerate(names) if n in MODES or n == "auto" or n in names[:i]]
    if clash:
        raise ColocateError(f"--variant {clash[0]!r}: already the name of a mode or another variant; pick another")
    # --convergence runs sequential and oppo unless --modes names its own (e.g. sequential alone beside variants)
    given = click.get_current_context().get_parameter_source("modes") != click.core.ParameterSource.DEFAULT
    conv = (ConvergenceOptions(steps=convergence_steps, eval_every=eval_every, variants=parsed, seeds=seeds,
                               **({"modes": mode_list} if given else {}))
            if convergence else None)
    opts = BenchOptions(preset=preset, workloads=wl, modes=mode_list, repeats=repeats, steps=steps,
                        peer=not no_peer, peer_dtype=peer_dtype or "", out_dir=out, chunk_size=chunk_size,
                        delta=delta, overrides=tuple(overrides), shape=shape, budget_s=budget_s,
                        batch_size=batch_size, max_new_tokens=max_new_tokens,
                        guard=GuardOptions(limit_cores=contended_above, quiet_wait_s=quiet_wait), convergence=conv)
    folder = run(opts, log=lambda m: click.echo(m, err=True))
    click.echo((folder / "report.md").read_text())
    plots = "convergence.png" if convergence else "*_timeline.png, *_reward.png"
    click.echo(f"\nwritten: {folder}/report.md, results.json, {plots}")


@main.command()
@click.option("--skip-rm", is_flag=True, help="Only convert the actor model.")
@_friendly
def prepare(skip_rm):
    """Convert the packaged SmolLM2-135M-Instruct to safetensors and build the default
    sentiment reward model; both are cached and reused."""
    hide_library_bars(EnginesConfig().log_level)  # the steps print their own lines
    for name, path in api.prepare(with_reward_model=not skip_rm).items():
        click.echo(f"{name}: {path}")


@main.command()
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Folder to write: a new or empty one, or an earlier export (it holds colocate_export.json), "
                   "which it replaces (default: RUN/export/actor_step_XXXXXXXX).")
@click.option("--adapter", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="A LoRA run: also write its adapters as a PEFT adapter folder DIR "
                   "(peft.PeftModel.from_pretrained(base, DIR) loads it).")
@_friendly
def export(run, out, adapter):
    """Write the trained actor of RUN's newest checkpoint (or of one checkpoint folder
    step_*) as a Hugging Face folder that transformers and SGLang load; a LoRA run's
    actor is written merged (base + adapters).

    \b
    Examples:
      colocate export runs/default
      colocate export runs/default/checkpoints/step_00000010 --out my-actor
      colocate export runs/lora --adapter my-adapter
    """
    hide_library_bars(log_level_of(run))  # the run's engines.log_level: bars only at info or debug
    click.echo(api.export_actor(run, out, adapter=adapter, log=_note))
    if adapter is not None:
        click.echo(adapter)


_SAMPLE = SampleOptions()


@main.command()
@click.argument("model")
@click.option("--prompt", "prompts", multiple=True, metavar="TEXT", help="A prompt (repeatable).")
@click.option("--prompts-file", type=click.File("r"), default=None,
              help="A text file with one prompt per line (blank lines skipped).")
@click.option("--max-new-tokens", type=int, default=_SAMPLE.max_new_tokens, show_default=True)
@click.option("--temperature", type=float, default=_SAMPLE.temperature, show_default=True, help="0: greedy.")
@click.option("--top-p", type=float, default=_SAMPLE.top_p, show_default=True)
@click.option("--seed", type=int, default=_SAMPLE.seed, show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default=_SAMPLE.device, show_default=True)
@click.option("--dtype", type=click.Choice(DTYPES), default=_SAMPLE.dtype, show_default=True)
@click.option("--no-chat", is_flag=True, help="Send the prompt text as is, without the chat template.")
@click.option("--jsonl", "as_jsonl", is_flag=True, help="One JSON object per prompt instead of text.")
@_friendly
def generate(model, prompts, prompts_file, max_new_tokens, temperature, top_p, seed, device, dtype, no_chat,
             as_jsonl):
    """Sample responses from MODEL: a run folder or checkpoint (its trained actor is
    exported once into RUN/export/), a model folder, or `smollm2`.

    \b
    Examples:
      colocate generate runs/default --prompt "What do you think of Mondays?"
      colocate generate smollm2 --prompts-file prompts.txt --temperature 0.7 --jsonl
    """
    from_file = [line.strip() for line in prompts_file if line.strip()] if prompts_file else []
    if prompts_file is not None and not from_file and not prompts:
        raise ColocateError(f"--prompts-file {prompts_file.name}: no prompts in it (one a line, blank lines skipped)")
    texts = list(prompts) + from_file
    hide_library_bars(log_level_of(model))  # a run's engines.log_level (the default for a model folder)
    out = api.generate(model, texts, log=_note, max_new_tokens=max_new_tokens, temperature=temperature,
                       top_p=top_p, seed=seed, device=device, dtype=dtype, chat=not no_chat)
    for g in out:
        if as_jsonl:
            click.echo(json.dumps(dataclasses.asdict(g)))
        else:
            click.echo(generation_lines(g))


def generation_lines(g: Generation) -> str:
    """A generation as `colocate generate` prints it, prompt and response shown as data."""
    return (f"### {visible(g.prompt, keep=LAYOUT)}\n{visible(g.response, keep=LAYOUT)}\n"
            f"[{len(g.token_ids)} tokens, {visible(g.finish_reason)}]\n")


@main.command()
@click.argument("run", type=click.Path(exists=True, file_okay=False))
@click.option("--step", type=int, default=None, help="Only this step (default: the last step written).")
@click.option("--all-steps", is_flag=True, help="Every step written.")
@click.option("--eval", "evaluation", is_flag=True, help="The held-out evaluations' completions.")
@click.option("--width", type=click.IntRange(min=1), default=100, show_default=True,
              help="Characters of a prompt shown.")
@_friendly
def show(run, step, all_steps, evaluation, width):
    """Print what the model wrote in RUN: each sample's prompt, response, reward and its
    parts, length and fate (samples.jsonl, eval_samples.jsonl with --eval).

    \b
    Examples:
      colocate show runs/default
      colocate show runs/default --step 3
      colocate show runs/default --eval --all-steps
    """
    written = completions.read(run, None, evaluation)
    rows = [r for r in written if step is None or r["step"] == step]
    if step is None and not all_steps and rows:
        rows = [r for r in rows if r["step"] == rows[-1]["step"]]
    if not rows:
        asked = f"of step {step} " if step is not None else ""
        raise ColocateError(f"no samples {asked}in {run}; it has {completions.written_steps(written)}")
    completions.show(rows, width=width, echo=click.echo)


@main.command()
@click.option("--no-smoke", is_flag=True, help="Skip starting a tiny engine.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@_friendly
def doctor(no_smoke, device):
    """Print device, versions, the CPU op stand-in status and the model cache, then
    start and stop a tiny SGLang engine as a smoke test."""
    hide_library_bars(EnginesConfig().log_level)  # its smoke test writes and serves a tiny model
    report = doc.run(device=device, smoke=not no_smoke, progress=lambda m: click.echo(m, err=True))
    width = max(len(k) for k in report.facts)
    for key, value in report.facts.items():
        click.echo(f"{key:<{width}}  {value}")
    if report.smoke_ok is not None:
        status = "ok" if report.smoke_ok else "FAILED"
        click.echo(f"{'smoke test':<{width}}  {status}: {report.smoke_detail}")
        if not report.smoke_ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
