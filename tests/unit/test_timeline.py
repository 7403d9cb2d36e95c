"""colocate/monitor/timeline.py and bench/requests.py: the running batch and where a rollout's seconds
go, against hand-computed timelines."""

import pytest

from colocate.bench import requests
from colocate.monitor.timeline import STEP, Timeline, running_batch


def ev(t, event, index=STEP, **info):
    return {"t": t, "step": 1, "index": index, "event": event, **info}


# three requests: 0 short; 1 long, parked at the cut; 2 resumed from a 5-token partial
EVENTS = [
    ev(0.0, "rollout"),
    ev(0.0, "launch", 0, prior=0), ev(0.0, "launch", 1, prior=0), ev(0.1, "launch", 2, prior=5),
    ev(0.2, "first_token", 0), ev(0.2, "first_token", 1), ev(0.5, "first_token", 2),
    ev(1.0, "end", 0, reason="stop", tokens=4),
    ev(2.0, "end", 2, reason="stop", tokens=9),
    ev(4.0, "cut"),
    ev(4.1, "parked", 1, tokens=30),
    ev(4.2, "rollout_end"),
    ev(4.2, "trained", 0), ev(4.2, "trained", 2), ev(4.2, "deferred", 1),
]


def test_running_batch_counts_requests_from_launch_or_adoption_to_end_or_park():
    assert running_batch(EVENTS) == [(0.0, 2), (0.1, 3), (1.0, 2), (2.0, 1), (4.1, 0)]
    later = [ev(9.0, "adopt", 1), ev(9.5, "end", 1, reason="stop", tokens=40)]
    assert running_batch(EVENTS + later)[-2:] == [(9.0, 1), (9.5, 0)]
    # a parked stream that ends unseen (between steps) is not counted twice
    assert running_batch(EVENTS + [ev(5.0, "end", 1)])[-1] == (4.1, 0)


def test_breakdown_by_hand():
    row = requests.breakdown(EVENTS)
    assert row["until_cut_s"] == pytest.approx(4.0)
    # batch 2 on [0, .1) and [1, 2), 3 on [.1, 1), 1 on [2, 4): at most 2 for .1 + 1 + 2 s
    assert row["tail_s"] == pytest.approx(3.1)
    assert row["mean_batch"] == pytest.approx((2 * 0.1 + 3 * 0.9 + 2 * 1.0 + 1 * 2.0) / 4.0)
    assert row["first_token_fresh_s"] == pytest.approx(0.2)
    assert row["first_token_resumed_s"] == pytest.approx(0.4)
    assert row["resumed"] == 1 and row["reprefilled_tokens"] == 5 and row["adopted"] == 0


def test_summary_takes_medians_per_mode_and_the_table_has_a_row_each():
    tagged = [{**e, "mode": "inter", "repeat": r} for r in range(3) for e in EVENTS]
    tagged += [{**e, "mode": "sequential", "repeat": 0} for e in EVENTS if e["event"] != "cut"]
    table = requests.summary(tagged, ["sequential", "inter"])
    assert list(table) == ["sequential", "inter"]
    assert table["inter"]["until_cut_s"] == pytest.approx(4.0)
    assert table["sequential"]["until_cut_s"] == pytest.approx(4.2)  # no cut: to the rollout's end
    lines = requests.markdown(table)
    assert len(lines) == 4 and lines[2].startswith("| sequential |")


def test_timeline_marks_relative_times_under_the_current_step_and_hands_them_out_once():
    tl = Timeline(step=3)
    tl.mark("rollout")
    tl.mark("launch", 7, prior=0)
    got = tl.take()
    assert [(e["step"], e["index"], e["event"]) for e in got] == [(3, STEP, "rollout"), (3, 7, "launch")]
    assert got[1]["prior"] == 0 and 0 <= got[0]["t"] <= got[1]["t"] < 5
    assert tl.take() == []


def test_plot_draws_one_panel_per_mode_with_events(tmp_path):
    tagged = [{**e, "mode": "inter", "repeat": 0} for e in EVENTS]
    assert requests.plot(tagged, ["sequential", "inter"], tmp_path / "r.png", "t").stat().st_size > 1000
    assert requests.plot([], ["inter"], tmp_path / "none.png", "t") is None
