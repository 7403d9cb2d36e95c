"""Bench report with the contention guard: contended steps left out of the medians and
counted, kept with a warning when a mode has nothing else; the workloads' overrides; which TRL
peer (classic PPO, or GRPO for a critic-free estimator) runs and how the report names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from colocate.bench.report import contention_line, markdown, peer_ratio, summarize, uncontended
from colocate.bench.suite import BenchOptions, _config, _peer_command, peer_dtype, peer_group, peer_key, peer_shape
from colocate.bench.workloads import PRESETS, workload_overrides
from colocate.errors import ConfigError


def _rec(mode: str, rep: int, samples_per_s: float, others: float | None = None, limit: float = 0.25) -> dict:
    rec = {"mode": mode, "repeat": rep, "trained_samples_per_s": samples_per_s, "response_tokens_per_s": 10.0,
           "response_len": 8.0, "step_s": 8 / samples_per_s, "reward_mean": 0.0, "trained_samples": 8}
    if others is not None:
        rec |= {"others_cores": others, "others_cpu_s": others * rec["step_s"], "contended": others > limit}
    return rec


def test_contended_steps_are_left_out_of_medians_and_ratios():
    records = [_rec("sequential", 0, 1.0, 0.0), _rec("sequential", 0, 0.2, 1.5),  # a neighbour halved a step
               _rec("oppo", 0, 2.0, 0.1), _rec("oppo", 0, 2.2, 0.05)]
    s = summarize(records, {}, ["sequential", "oppo"])
    assert s["sequential"]["trained_samples_per_s"]["n"] == 1 and s["sequential"]["trained_samples_per_s"]["median"] == 1.0
    assert s["oppo"]["vs_sequential"]["median"] == pytest.approx(2.1)
    c = s["sequential"]["contention"]
    assert (c["steps"], c["contended"], c["excluded"]) == (2, 1, 1) and c["others_cores"]["max"] == 1.5
    assert s["oppo"]["contention"]["excluded"] == 0


def test_a_mode_whose_every_step_was_contended_keeps_them_with_a_warning():
    records = [_rec("sequential", 0, 1.0, 0.9), _rec("oppo", 0, 2.0, 0.0)]
    kept, info = uncontended(records, ["sequential", "oppo"])
    assert len(kept) == 2 and info["sequential"] == {**info["sequential"], "contended": 1, "excluded": 0}
    s = summarize(records, {}, ["sequential", "oppo"])
    assert s["oppo"]["vs_sequential"]["n"] == 1  # a ratio is still there, flagged
    line = contention_line(s, 0.25)
    assert "0 of 2 steps left out" in line and "(others > 0.25 cores)" in line
    assert "WARNING: every step of sequential was contended" in line
    assert "WARNING" in markdown("short", s, None, {}, 0.25)


def test_records_without_measurements_report_no_guard_line():
    s = summarize([_rec("sequential", 0, 1.0), _rec("oppo", 0, 2.0)], {}, ["sequential", "oppo"])
    assert s["oppo"]["vs_sequential"]["median"] == 2.0
    assert contention_line(s) == "" and "contention guard" not in markdown("short", s, None, {})


def test_guard_line_counts_excluded_steps_per_mode():
    records = [_rec("sequential", 0, 1.0, 0.0), _rec("sequential", 1, 1.0, 0.3), _rec("oppo", 0, 2.0, 0.5),
               _rec("oppo", 1, 2.0, 0.1), _rec("oppo", 1, 2.0, 0.2)]
    line = contention_line(summarize(records, {}, ["sequential", "oppo"]), 0.25)
    assert line.startswith("contention guard: other processes used sequential 0.15 [max 0.30] cores, 1/2 contended; "
                           "oppo 0.20 [max 0.50] cores, 1/3 contended; 2 of 5 steps left out")


def test_peer_line_flags_a_contended_trl_run():
    s = summarize([_rec("oppo", 0, 2.0, 0.0)], {}, ["oppo"])
    s["oppo"]["response_len"] = {"median": 8.0, "min": 8.0, "max": 8.0, "n": 1}
    peer = {"median": 2.0, "min": 2.0, "max": 2.0, "n": 1, "trl_samples_per_s": 1.0, "trl_response_len": 8.0,
            "trl_version": "1.12.0", "contention": {"others_cores": 0.8, "contended": True}}
    assert "others used 0.80 cores during the TRL run (CONTENDED" in markdown("short", s, peer, {})


def test_peer_line_flags_a_colocate_run_in_another_precision_than_the_float32_peer():
    s = summarize([_rec("oppo", 0, 2.0)], {}, ["oppo"])
    peer = {**peer_ratio(s, {"batch_size": 8, "update_seconds": [8.0], "response_tokens": [64],
                             "response_tokens_per_s": 8.0}), "trl_version": "1.12.0"}
    assert "NOT LIKE FOR LIKE" not in markdown("short", s, peer, {})  # no dtype recorded: float32
    assert "NOT LIKE FOR LIKE" not in markdown("short", s, {**peer, "colocate_dtype": "float32"}, {})
    flagged = markdown("short", s, {**peer, "colocate_dtype": "bfloat16"}, {})
    assert "NOT LIKE FOR LIKE: colocate's trainer computes in bfloat16, the TRL peer in float32" in flagged


def test_peer_line_is_like_for_like_when_the_peer_computes_in_colocates_precision():
    s = summarize([_rec("oppo", 0, 2.0)], {}, ["oppo"])
    peer = {**peer_ratio(s, {"batch_size": 8, "update_seconds": [8.0], "response_tokens": [64],
                             "response_tokens_per_s": 8.0}), "trl_version": "1.12.0"}
    both = markdown("short", s, {**peer, "colocate_dtype": "bfloat16", "trl_dtype": "bfloat16"}, {})
    assert "NOT LIKE FOR LIKE" not in both and "; both in bfloat16" in both
    forced = markdown("short", s, {**peer, "colocate_dtype": "float32", "trl_dtype": "bfloat16"}, {})
    assert "NOT LIKE FOR LIKE: colocate's trainer computes in float32, the TRL peer in bfloat16" in forced


def test_reasoning_workload_stops_at_eos_on_reasoning_gym_prompts_with_a_long_cap():
    for name in ("quick", "full"):  # the gpu preset runs the synthetic long tail only (random weights, ignore_eos)
        preset = PRESETS[name]
        assert "reasoning" in preset.workloads
        o = workload_overrides(preset, "reasoning")
        assert "rollout.ignore_eos=false" in o and f"data.source=reasoning-gym:{preset.reasoning_task}" in o
        assert f"rollout.max_new_tokens={preset.reasoning_tokens}" in o
        assert peer_shape(preset, "reasoning") == (preset.reasoning_tokens, True)  # TRL: same cap, EOS
    assert PRESETS["full"].reasoning_tokens >= 256 and PRESETS["quick"].reasoning_tokens < 256
    assert peer_shape(PRESETS["full"], "short") == (32, False) and peer_shape(PRESETS["full"], "task") == (128, True)
    assert peer_key(256, True, "reasoning-gym:gsm_symbolic") == "256-eos-gsm_symbolic"
    assert peer_key(128, False, "sentiment-prompts") == "128"


def test_preset_overrides_come_last_so_trainer_switches_apply_to_every_workload():
    import dataclasses

    preset = dataclasses.replace(PRESETS["quick"], overrides=("ppo.epochs=1",))
    for workload in preset.workloads:
        assert workload_overrides(preset, workload)[-1] == "ppo.epochs=1"


def _workload_config(*overrides: str):
    """The `task` workload's config as the bench builds it (preset, then ``--set``)."""
    opts = BenchOptions(overrides=overrides)
    return _config(PRESETS["quick"], opts, "task", "actor-dir", "rm-dir", Path("/tmp/bench-unit"))


def test_a_critic_free_workload_gets_the_grpo_peer_with_its_group_size():
    grpo = _workload_config("ppo.advantage=grpo", "rollout.group_size=4", "ppo.kl_in=loss")
    assert peer_group(grpo) == 4 and peer_group(_workload_config("ppo.advantage=rloo", "rollout.group_size=2")) == 2
    assert peer_group(_workload_config()) == 0  # gae: the classic PPO peer, keys unchanged
    assert peer_key(128, True, "sentiment-prompts", peer_group(grpo)) == "grpo4-128-eos"
    assert peer_key(128, True, "sentiment-prompts", 0) == "128-eos"
    cmd = _peer_command("a", "r", PRESETS["quick"], Path("o"), 64, True, 1, 2, "sentiment-prompts", 4, 0.05)
    assert cmd[2] == "colocate.bench.peers.trl_grpo" and cmd[cmd.index("--group-size") + 1] == "4"
    assert cmd[cmd.index("--beta") + 1] == "0.05" and cmd[-1] == "--stop-at-eos"
    ppo = _peer_command("a", "r", PRESETS["quick"], Path("o"), 64, False, 1, 2, "sentiment-prompts", 0, 0.05)
    assert ppo[2] == "colocate.bench.peers.trl_ppo" and "--group-size" not in ppo and "--beta" not in ppo
    assert "--bf16" not in cmd + ppo  # float32 unless colocate's trainer computes in bfloat16
    bf16 = _peer_command("a", "r", PRESETS["quick"], Path("o"), 64, True, 1, 2, "sentiment-prompts", 4, 0.05, "bfloat16")
    assert bf16[-1] == "--bf16" and bf16[:-1] == cmd
    assert (peer_dtype("bfloat16"), peer_dtype("float32"), peer_dtype("float16")) == ("bfloat16", "float32", "float32")


def test_peer_line_names_the_trl_trainer():
    s = summarize([_rec("oppo", 0, 2.0)], {}, ["oppo"])
    peer = {"batch_size": 8, "update_seconds": [8.0], "response_tokens": [64], "response_tokens_per_s": 8.0,
            "trl_version": "1.12.0"}
    ppo = peer_ratio(s, peer)
    grpo = peer_ratio(s, {**peer, "trainer": "grpo", "group_size": 4})
    assert (ppo["trl_trainer"], grpo["trl_trainer"], grpo["trl_group_size"]) == ("ppo", "grpo", 4)
    assert grpo["median"] == ppo["median"] == 2.0
    for info in (ppo, grpo):
        info["trl_version"] = "1.12.0"
    assert "TRL PPO (trl 1.12.0, same models/batch, responses of 8 tokens" in markdown("short", s, ppo, {})
    assert "TRL GRPO (trl 1.12.0, same models/batch, groups of 4, responses" in markdown("short", s, grpo, {})


def test_tools_workload_runs_the_calculator_or_on_random_models_the_scripted_environment():
    full, quick = workload_overrides(PRESETS["full"], "tools"), workload_overrides(PRESETS["quick"], "tools")
    assert "rollout.env=calculator" in full and "rollout.env=scripted" not in full
    assert quick.index("rollout.env=scripted") > quick.index("rollout.env=calculator")  # the later one wins
    for o, preset in ((full, PRESETS["full"]), (quick, PRESETS["quick"])):
        assert f"data.source=reasoning-gym:{preset.reasoning_task}" in o and "rollout.ignore_eos=false" in o
        assert f"rollout.max_new_tokens={preset.reasoning_tokens}" in o


def test_multi_turn_rows_report_turns_and_tool_calls_per_mode():
    rows = [_rec(m, r, 1.0 + r) | {"rollout/turns": 2.0 + r, "rollout/tool_calls": 1.0, "rollout/tool_call_rate": 0.5,
                                   "rollout/env_tokens": 20.0} for m in ("sequential", "oppo") for r in (0, 1)]
    s = summarize(rows, {}, ["sequential", "oppo"])
    assert s["oppo"]["trajectories"]["turns"]["median"] == 2.5 and s["oppo"]["trajectories"]["tool_call_rate"]["max"] == 0.5
    text = markdown("tools", s, None, {})
    assert "| mode | model turns / trajectory | tool calls / trajectory | tool-call rate |" in text
    assert "| oppo | 2.50 [2.00–3.00] | 1.00 [1.00–1.00] | 0.50 [0.50–0.50] | 20.0 [20.0–20.0] |" in text
    assert "trajectories" not in summarize([_rec("oppo", 0, 1.0)], {}, ["oppo"])["oppo"]  # single responses: no table


def test_the_trl_peer_runs_as_many_rounds_as_a_mode_measures_and_the_report_shows_their_spread():
    from colocate.bench.suite import _preset, peer_rounds

    for preset in ("quick", "full"):
        p = PRESETS[preset]
        assert _preset(BenchOptions(preset=preset)).peer_updates == max(4, p.repeats * p.steps) >= 4
    assert _preset(BenchOptions(preset="quick", repeats=1, steps=2)).peer_updates == 4 == peer_rounds(1, 2)
    s = summarize([_rec("oppo", 0, 2.0)], {}, ["oppo"])
    peer = {"batch_size": 8, "update_seconds": [8.0, 4.0, 2.0, 16.0], "response_tokens": [64] * 4,
            "trl_version": "1.12.0"}
    info = peer_ratio(s, peer)
    assert (info["trl_min"], info["trl_max"], info["trl_rounds"]) == (0.5, 4.0, 4)
    assert info["trl_samples_per_s"] == 1.5 and info["median"] == 2.0 / 1.5  # the median of 0.5, 1, 2, 4
    assert "1.500 [0.500–4.000] trained samples/s over 4 updates" in markdown("short", s, info, {})


def test_the_report_gives_trainer_tokens_computed_against_the_samples_tokens():
    recs = [dict(_rec("oppo", 0, 2.0), **{"train/tokens_computed": 400, "train/tokens_samples": 800}),
            dict(_rec("oppo", 1, 2.0), **{"train/tokens_computed": 600, "train/tokens_samples": 1000})]
    s = summarize(recs, {}, ["oppo"])
    assert s["oppo"]["train_tokens"]["computed"]["median"] == 500
    assert "oppo 500 of 900 sample tokens (0.56x)" in markdown("reasoning", s, None, {})
    assert "Trainer tokens" not in markdown("reasoning", summarize([_rec("oppo", 0, 2.0)], {}, ["oppo"]), None, {})


def test_the_gpu_preset_is_the_issue_53_workload_and_a_dry_run_shrinks_it_without_changing_its_shape():
    """One lent GPU: Qwen2.5-0.5B-shaped random actor and reward model, batch 64, lognormal
    budgets up to 1,024 tokens with ignore_eos, GRPO (groups of 4) first then PPO; every mode
    on one session (fixed engine threads); the TRL peers to the cap, compared in tokens/s."""
    from colocate.bench.suite import _preset, peer_group
    from colocate.config import load_config

    p = _preset(BenchOptions(preset="gpu"))
    assert (p.models, p.batch_size, p.max_new_tokens, p.workloads) == ("qwen2.5-0.5b", 64, 1024,
                                                                       ("longtail-grpo", "longtail"))
    assert p.peer_updates == 2 and "no vLLM" in p.note and "response tokens/s" in p.note
    grpo, ppo = (load_config(overrides=workload_overrides(p, w)) for w in p.workloads)
    assert (grpo.rollout.length_dist, grpo.rollout.ignore_eos, grpo.rollout.max_new_tokens) == ("lognormal", True, 1024)
    assert (peer_group(grpo), peer_group(ppo)) == (4, 0)  # TRL's GRPOTrainer, then TRL's PPO
    assert grpo.engines.actor_threads == grpo.engines.reward_threads == 1 and grpo.engines.cuda_graph is True
    assert peer_shape(p, "longtail-grpo") == (1024, False)  # the peer runs every response to the cap
    dry = _preset(BenchOptions(preset="gpu", shape="tiny", batch_size=8, max_new_tokens=16))
    assert (dry.models, dry.batch_size, dry.max_new_tokens, dry.workloads) == ("tiny", 8, 16, p.workloads)


def test_a_plot_that_fails_is_named_in_one_line_and_the_report_goes_on(tmp_path):
    """On the GPU kit a plot's failure once took the whole report down (its numbers measured,
    none written): a failed plot is one line of the log, and the next one is still drawn."""
    from colocate.bench import plots, suite

    def broken(records, modes, path, title):
        raise AttributeError("module 'IPython' has no attribute 'get_ipython'\nmore")

    said = []
    suite._draw(said.append, broken, [], ["sequential"], tmp_path / "w_timeline.png", "t")
    assert said == ["plot w_timeline.png not drawn: AttributeError: module 'IPython' has no attribute 'get_ipython'"]
    rec = [{"mode": "sequential", "repeat": 0, "step_s": 1.0, "wall_s": 1.0, "reward_mean": 0.0}]
    suite._draw(said.append, plots.reward_curve, rec, ["sequential"], tmp_path / "r.png", "t")
    assert len(said) == 1 and (tmp_path / "r.png").stat().st_size > 1000


def test_peer_micro_batch_is_the_largest_divisor_of_the_minibatch_that_fits_the_token_budget():
    from colocate.bench.peers.trl_ppo import peer_micro_batch

    assert peer_micro_batch(32, 1024, 8192) == 8  # the GPU preset: 64 samples, 2 minibatches, 1,024 tokens
    assert peer_micro_batch(32, 1000, 8192) == 8
    assert peer_micro_batch(12, 300, 1024) == 3  # 3 fits (900 tokens), 4 would not; 3 divides 12
    assert peer_micro_batch(8, 128, 1024) == 8  # a whole minibatch fits: no accumulation
    assert peer_micro_batch(6, 4096, 1024) == 1  # not even one fits: one sample a pass
    for minibatch, tokens, budget in [(16, 100, 1000), (10, 7, 30), (9, 50, 200)]:
        fits = [d for d in range(1, minibatch + 1) if minibatch % d == 0 and d * tokens <= budget]
        assert peer_micro_batch(minibatch, tokens, budget) == max(fits or [1])


def test_the_decode_bound_is_the_weights_read_once_at_the_measured_bandwidth_and_the_report_says_it():
    """Issue 53's decode target: the step against reading the actor's weights once per step
    (the H100 numbers: 0.99 GB of bf16 Qwen2.5-0.5B weights at ~3 TB/s, ~0.33 ms)."""
    from colocate.bench.limit import decode_bound

    got = decode_bound(0.99e9, 3.0e12, step_ms=3.96)
    assert got["decode_bound_ms"] == pytest.approx(0.33)
    assert got["decode_vs_bound"] == pytest.approx(12.0)
    assert (got["weights_gb"], got["device_read_gb_per_s"]) == (pytest.approx(0.99), pytest.approx(3000.0))
    probe = {"decode_tokens_per_s": 16000.0, "probe_batch": 64, "decode_step_ms": 3.96, **got}
    text = markdown("w", summarize([], probe, ["sequential"]), None, probe)
    assert "decode step at batch 64: 3.96 ms, 12.0x its bound of 0.33 ms" in text
    assert "decode step at batch" not in markdown("w", summarize([], {}, ["sequential"]), None,
                                                  {"decode_tokens_per_s": 1.0, "probe_batch": 1})


def test_the_gpu_memory_table_gives_the_release_beyond_the_engines_cuda_contexts():
    """Issue 53's release target counts the memory the engines hold beyond their processes'
    CUDA contexts: the H100 run's steps (5.69 GiB at start, 4.58 and 4.49 released) against
    two contexts of 0.5 GiB give 4.58 / 4.69 and 4.49 / 4.69. A CPU run has no table."""
    gpu = [{"gpu/engines_started_gib": 5.69, "gpu/released_gib": got, "gpu/released_frac": got / 5.69,
            "gpu/free_gib_for_training": 75.65, "gpu/train_peak_allocated_gib": 29.5} for got in (4.58, 4.49)]
    records = [_rec("sequential", 0, 6.0) | gpu[0], _rec("sequential", 0, 6.2) | gpu[1]]
    probe = {"decode_tokens_per_s": 1.0, "probe_batch": 64, "cuda_context_gib": 0.5, "engine_processes": 2}
    text = markdown("w", summarize(records, probe, ["sequential"]), None, probe)
    assert "| sequential | 5.69 [5.69–5.69] | 4.54 [4.49–4.58] | 0.797 [0.789–0.805] | 0.967 [0.957–0.977] |" in text
    assert "2 engine processes × 0.50 GiB" in text
    no_ctx = markdown("w", summarize(records, {}, ["sequential"]), None, {})
    assert "| 0.797 [0.789–0.805] | n/a | 75.65 [75.65–75.65] | 29.50 [29.50–29.50] |" in no_ctx
    assert "released GiB" not in markdown("w", summarize([_rec("sequential", 0, 6.0)], {}, ["sequential"]), None, {})


def test_a_report_folder_that_cannot_be_made_is_one_line_before_any_model(tmp_path):
    """Before: a FileExistsError/FileNotFoundError traceback from the folder's mkdir."""
    from colocate.bench.suite import run

    (tmp_path / "afile").write_text("x")
    for out, why in ((tmp_path / "afile", "a file is there"), (tmp_path / "afile" / "sub", "a file is there")):
        with pytest.raises(ConfigError) as e:
            run(BenchOptions(out_dir=str(out)), log=lambda line: None)
        assert str(e.value) == f"--out '{out}': cannot make the report folder ({why}); give a folder you can write"
