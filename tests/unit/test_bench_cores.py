"""bench/cores.py's report and argument checks (the measurement itself starts engines: run by hand)."""

from __future__ import annotations

import pytest

from colocate.bench import cores


def _spread(x: float) -> dict[str, float]:
    return {"median": x, "min": x - 1, "max": x + 1, "n": 3}


def test_markdown_has_a_row_per_split_and_policy_with_its_numbers():
    out = {"cores": 2, "options": {"preset": "quick", "batch": 8, "new_tokens": 96, "prompt_tokens": 64, "scores": 8,
                                   "score_tokens": 128, "gap": 0.15, "repeats": 3, "reward_nice": 0},
           "results": [{"split": s, "wait": w, "decode_tokens_per_s": _spread(v), "both_tokens_per_s": _spread(v / 2),
                        "score_latency_s": _spread(0.5), "both_score_latency_s": _spread(0.75),
                        "decode_wall_s": _spread(1.0), "both_wall_s": _spread(2.0)}
                       for s, w, v in (("1/1", "default", 800.0), ("2/2", "passive", 400.0))]}
    text = cores.markdown(out)
    rows = [line for line in text.splitlines() if line.startswith("| 1/1") or line.startswith("| 2/2")]
    assert len(rows) == 2
    assert rows[0].startswith("| 1/1 | default | 800.0 [799.0–801.0] | 400.0 [399.0–401.0] | 0.500")
    assert rows[1].startswith("| 2/2 | passive | 400.0 [399.0–401.0] | 200.0 [199.0–201.0]")
    assert "niceness 0" in text and "2 cores" in text


@pytest.mark.parametrize("argv", [["--splits", "2-1"], ["--splits", "0/1"], ["--wait", "spin"]])
def test_bad_splits_or_policies_are_refused_before_any_engine_starts(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cores.main(argv)
    assert exc.value.code == 2
    assert "--splits takes A/R thread counts" in capsys.readouterr().err
