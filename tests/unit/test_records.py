"""Reading a run's records back (``colocate.monitor.records.read_jsonl``): a last line a
kill cut short is left out, as if never written (before: ``--resume`` and the summary
stopped on a JSONDecodeError traceback); any other damaged line is one line naming the file
and the line."""

from __future__ import annotations

import json

import pytest

from colocate.monitor.records import RecordsDamagedError, append_jsonl, read_jsonl


def test_records_read_back_as_written_and_a_missing_file_has_none(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert read_jsonl(path) == []
    append_jsonl(path, [{"step": 1, "x": 0.5}, {"step": 2, "x": float("inf")}])
    append_jsonl(path, [{"step": 3}])
    assert read_jsonl(path) == [{"step": 1, "x": 0.5}, {"step": 2, "x": float("inf")}, {"step": 3}]


def test_a_last_line_cut_short_is_left_out_and_the_next_append_cuts_it_off(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, [{"step": 1}, {"step": 2}])
    with path.open("a") as f:
        f.write(json.dumps({"step": 3, "reward_mean": 0.25})[:13])  # killed while it wrote
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    append_jsonl(path, [{"step": 3}])  # the resumed run's: on a line of its own, the torn one gone
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    path.write_text('{"step": 1')  # torn with no line before it
    append_jsonl(path, [{"step": 1}])
    assert path.read_text() == '{"step": 1}\n'
    path.write_text('{"step": 1}\n{"step": 2}')  # a whole record, only its newline lost: kept
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    append_jsonl(path, [{"step": 3}])
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'


@pytest.mark.parametrize("line, said", [
    ('{"step": 2', "line 2 is not a JSON record (Expecting ',' delimiter: line 1 column 11 (char 10)); remove that "
                   "line (the checkpoints do not depend on it) and run again"),
    ("[1, 2]", "line 2 is a JSON list, not a record; remove that line (the checkpoints do not depend on it) and "
               "run again"),
])
def test_any_other_damaged_line_is_one_line_naming_it(tmp_path, line, said):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"step": 1}\n' + line + '\n{"step": 3}\n')
    with pytest.raises(RecordsDamagedError) as e:
        read_jsonl(path)
    assert str(e.value) == f"{path}: {said}"
