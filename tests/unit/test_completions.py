"""colocate.monitor.completions: a row per sample, samples.jsonl read back, printed readably."""

from __future__ import annotations

import json

import pytest

from colocate.rollout.sample import Sample
from colocate.errors import ConfigError
from colocate.monitor import completions


def _decode(ids):
    return "".join(chr(ord("a") + i % 26) for i in ids)


def _sample(index, out, versions, group=None, attempts=1, parts=None):
    s = Sample(index, [0, 1, 2], 16, group=group)
    s.output_ids, s.versions, s.attempts = list(out), list(versions), attempts
    s.logprobs = [-1.0] * len(out)
    s.finish_reason, s.reward_parts = "stop", dict(parts or {"model": 0.5, "env": 0.0, "fn": 0.25})
    s.score = sum(s.reward_parts.values())
    return s


@pytest.mark.parametrize("versions,spans", [
    ([], []), ([3], [[3, 1]]), ([1, 1, 2, 2, 2], [[1, 2], [2, 3]]), ([0, 1, 0], [[0, 1], [1, 1], [0, 1]])])
def test_version_spans_against_a_loop(versions, spans):
    assert completions.version_spans(versions) == spans
    assert sum(n for _, n in spans) == len(versions)


def test_a_row_says_what_the_model_wrote_and_its_fate():
    carried = _sample(7, [3, 4, 5], [1, 2, 2], group=3, attempts=2)
    r = completions.row(4, carried, _decode, weight_version=2)
    assert (r["step"], r["index"], r["group"], r["prompt"], r["response"]) == (4, 7, 3, "abc", "def")
    assert r["reward"] == 0.75 and r["reward_parts"] == {"model": 0.5, "env": 0.0, "fn": 0.25}
    assert (r["length"], r["model_tokens"], r["turns"], r["finish_reason"]) == (3, 3, 1, "stop")
    assert r["deferred"] and r["resumed"] and r["versions"] == [[1, 1], [2, 2]]
    fresh = completions.row(4, _sample(8, [1], [2]), _decode, weight_version=2)
    assert not fresh["deferred"] and not fresh["resumed"] and fresh["group"] == 8
    json.dumps(r)  # JSON-safe


def test_rows_keep_whole_groups_first_and_respect_the_limit():
    samples = [_sample(i, [i], [0], group=g) for i, g in ((5, 2), (1, 1), (4, 2), (0, 1))]
    assert [r["index"] for r in completions.rows(1, samples, _decode, 0, -1)] == [0, 1, 4, 5]
    assert [r["index"] for r in completions.rows(1, samples, _decode, 0, 3)] == [0, 1, 4]
    assert completions.rows(1, samples, _decode, 0, 0) == []


def test_append_read_and_show(tmp_path, capsys):
    rows = [completions.row(s, _sample(i, [i, i + 1], [0, 0]), _decode, 0) for s, i in ((1, 0), (1, 1), (2, 2))]
    completions.append(tmp_path / completions.TRAIN_FILE, rows)
    assert completions.read(tmp_path) == rows and completions.read(tmp_path, step=2) == rows[2:]
    lines = []
    completions.show(rows[:1], echo=lines.append, rich=False)
    assert lines[0] == "step 1 sample 0 (group 0): reward +0.750 [model +0.5 fn +0.25], 2 tokens, stop"
    assert lines[1] == "  prompt:   abc" and lines[2] == "  response: ab"
    completions.show(rows, rich=True)  # a rich table: every response printed
    out = capsys.readouterr().out
    assert all(r["response"] in out for r in rows)
    table = completions.markdown([dict(rows[0], response="a|b")])
    assert table.count("\n") == 2 and "a\\|b" in table


def test_a_missing_file_is_one_line_naming_the_setting(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # a run folder: it wrote no samples
    for evaluation in (False, True):
        with pytest.raises(ConfigError) as info:
            completions.read(tmp_path, evaluation=evaluation)
        assert "\n" not in str(info.value) and "run.log_samples" in str(info.value)


def test_a_folder_that_is_no_run_says_so(tmp_path):
    """Before: it read as a run that wrote no samples ("runs write it with run.log_samples != 0")."""
    with pytest.raises(ConfigError, match=r"not a run folder \(no config.json, which a run writes as it starts\)"):
        completions.read(tmp_path)


@pytest.mark.parametrize("steps,said", [([1, 2, 3, 4], "steps 1-4"), ([5], "step 5"), ([2, 5, 9], "steps 2, 5, 9"),
                                        ([], "no step (the file is empty)")])
def test_the_written_steps_in_short(steps, said):
    assert completions.written_steps([{"step": s} for s in steps]) == said


def test_show_of_a_step_not_written_names_those_that_are(tmp_path):
    from click.testing import CliRunner
    from colocate.cli import main

    (tmp_path / "config.json").write_text("{}")
    rows = [completions.row(s, _sample(i, [i, i + 1], [0, 0]), _decode, 0) for s, i in ((1, 0), (2, 1))]
    completions.append(tmp_path / completions.TRAIN_FILE, rows)
    result = CliRunner().invoke(main, ["show", str(tmp_path), "--step", "999"])
    assert result.exit_code == 2 and result.output.strip() == f"error: no samples of step 999 in {tmp_path}; it has steps 1-2"
    assert CliRunner().invoke(main, ["show", str(tmp_path), "--step", "2"]).output.startswith("step 2 sample 1")
    narrow = CliRunner().invoke(main, ["show", str(tmp_path), "--width", "-5"], prog_name="colocate")
    assert narrow.exit_code == 2 and narrow.output.strip() == (
        "error: colocate show: Invalid value for '--width': -5 is not in the range x>=1. (colocate show --help)")
