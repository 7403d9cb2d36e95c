"""Progress display: one line per step with ETA when piped, a tqdm bar on a terminal."""

from __future__ import annotations

import io
import re

from colocate.monitor.progress import Progress, _eta


def rec(step, **extra):
    return {"step": step, "reward_mean": 0.25, "kl": 0.01, "step_s": 2.0, "time/generate": 1.0,
            "time/actor": 0.5, "time/critic": 0.25, **extra}


def test_plain_lines_carry_step_reward_and_eta():
    out = io.StringIO()
    p = Progress(4, stream=out, bar=False)
    p.phase("rollout")  # no bar: phases are not printed
    p(rec(1))
    p(rec(2, skipped="non-finite reward"))
    lines = out.getvalue().splitlines()
    assert re.match(r"step +1/4 +reward \+0\.250 +kl 0\.010 .* eta \d+m\d\ds$", lines[0])
    assert lines[1].strip() == "step    2/4  skipped: non-finite reward".strip()
    assert p.done == 2 and p.eta_s() >= 0


def test_bar_shows_phase_and_postfix():
    out = io.StringIO()
    p = Progress(3, start=1, stream=out, bar=True)
    p.phase("train")
    p(rec(2))
    p.close()
    text = out.getvalue()
    assert "train" in text and "reward=+0.250" in text and "2/3" in text


def test_eta_format():
    assert _eta(float("nan")) == "?"
    assert _eta(75) == "1m15s" and _eta(3700) == "1h01m"
