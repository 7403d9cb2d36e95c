"""Bench mode order and the memory rule for keeping two sessions alive."""

from __future__ import annotations

from colocate.bench.runner import fits_beside, grouped_order

MODES = ["sequential", "intra", "inter", "oppo"]
BUDGET = {"sequential": (2, 2), "inter": (2, 2), "intra": (1, 1), "oppo": (1, 1)}.get


def test_modes_rotate_across_repeats_and_group_by_session():
    orders = [grouped_order(MODES, rep, BUDGET) for rep in range(4)]
    assert orders[0] == ["sequential", "inter", "intra", "oppo"]
    assert orders[1] == ["intra", "oppo", "inter", "sequential"]
    assert orders[2] == ["inter", "sequential", "oppo", "intra"]
    assert orders[3] == ["oppo", "intra", "sequential", "inter"]
    for order in orders:  # every mode once; at most one switch of session per repeat
        assert sorted(order) == sorted(MODES)
        assert sum(BUDGET(a) != BUDGET(b) for a, b in zip(order, order[1:])) == 1
    assert {order[0] for order in orders} == set(MODES)  # each mode goes first once
    assert grouped_order(MODES, 1, lambda m: 0) == ["intra", "inter", "oppo", "sequential"]  # one session: plain rotation


def test_a_second_session_is_kept_only_with_room_to_spare():
    assert fits_beside(session_mb=4000, free=16000)
    assert not fits_beside(session_mb=10000, free=12000)  # the full preset on 24 GiB
    assert not fits_beside(session_mb=4000, free=6000)


def test_peak_rss_counts_memory_this_process_held_and_gave_back():
    import gc

    from colocate.bench.runner import peak_rss_mb
    from colocate.monitor.metrics import rss_mb

    block = bytearray(300 * 2**20)  # 300 MiB resident, then freed
    block[:: 4096] = b"x" * len(block[:: 4096])
    del block
    gc.collect()
    assert peak_rss_mb() >= rss_mb() and peak_rss_mb() - rss_mb() > 200


def test_a_bad_override_is_refused_before_any_model_is_built(tmp_path):
    """Every run's config is loaded before the models are built (the full preset prepares
    SmolLM2, the gpu one builds 0.5B-shaped models) and before a budget is spent: a bad
    --set (a workload's run, or a --convergence variant's) is the one line at once."""
    import pytest

    from colocate.bench.convergence import ConvergenceOptions
    from colocate.bench.suite import BenchOptions, run
    from colocate.errors import ConfigError

    out = tmp_path / "bench"
    with pytest.raises(ConfigError, match="unknown config key 'nope'"):
        run(BenchOptions(preset="quick", overrides=("nope.x=1",), out_dir=str(out), budget_s=5))
    conv = ConvergenceOptions(variants=(("bad", ("rollout.group_size=3",)),))
    with pytest.raises(ConfigError, match="must be a multiple of rollout.group_size 3"):
        run(BenchOptions(preset="quick", out_dir=str(out), convergence=conv))
    assert not (tmp_path / ".bench-models").exists()  # nothing was built
