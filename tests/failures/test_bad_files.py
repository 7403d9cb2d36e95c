"""Item 6 of issue 50 (its data half): a data file colocate cannot read is one line, exit 2.

``colocate train --check`` (it starts no engine) on a prompt file that is not UTF-8 (.jsonl,
.json, .csv: Latin-1 bytes), a truncated and a garbled parquet file, a truncated .json file and
a .jsonl line that is valid JSON but not an object: each is refused with one line on
stderr naming ``data.source``, the file, where (line and byte offset) and the fix; nothing
else is printed (no traceback, no library log line). A UTF-8 .jsonl with a byte-order mark
and Unicode line breaks inside its strings loads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from click.testing import CliRunner

from colocate.cli import main

LATIN1 = "café au lait".encode("latin-1")  # é is byte 0xe9, which UTF-8 cannot start a character with here


@pytest.fixture()
def library_errors():
    """The error lines the datasets library logs meanwhile (its own handler would print them)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger = logging.getLogger("datasets")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _check(source: Path, actor: str):
    return CliRunner().invoke(main, [
        "train", "--set", f"models.actor={actor}", "--set", "reward.kind=rule", "--set", "reward.rule=vader",
        "--set", "engines.device=cpu", "--set", f"data.source={source}", "--set", f"run.out_dir={source}.run",
        "--check"])


def _refused(result, line: str, library_errors: list | None = None) -> None:
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"error: {line}\n"), result.output
    assert not library_errors, f"and datasets printed: {[r.getMessage() for r in library_errors]}"


@pytest.mark.parametrize("suffix, body, where", [
    (".jsonl", b'{"prompt": "hello"}\n{"prompt": "' + LATIN1 + b'"}\n', "line 2 has byte 0xe9 (byte offset 35"),
    (".json", b'[{"prompt": "' + LATIN1 + b'"}]', "line 1 has byte 0xe9 (byte offset 16"),
    (".csv", b"prompt,answer\nhello,1\n" + LATIN1 + b",2\n", "line 3 has byte 0xe9 (byte offset 25"),
])
def test_a_data_file_that_is_not_utf8_is_one_line(tmp_path, tiny_actor_path, library_errors, suffix, body, where):
    source = tmp_path / f"latin1{suffix}"
    source.write_bytes(body)
    _refused(_check(source, tiny_actor_path),
             f"data.source: {source} is not UTF-8: {where} of the file); save the file as UTF-8", library_errors)


def test_a_utf8_jsonl_with_a_byte_order_mark_and_unicode_line_breaks_in_its_text_loads(tmp_path, tiny_actor_path):
    """Lines end at \\n only: U+2028 and U+0085 inside a JSON string are text (as JSON says)."""
    source = tmp_path / "bom.jsonl"
    lines = [json.dumps({"prompt": f"caf\u00e9 {i}\u2028second line\x85third"}, ensure_ascii=False) for i in range(20)]
    source.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode())
    result = _check(source, tiny_actor_path)
    assert result.exit_code == 0 and result.stdout.startswith("check ok: 15 training + 5 held-out prompts"), result.output
    # data.eval_prompts (16 by default) asked for more than a quarter of 20: the check says so
    assert result.stdout.rstrip().endswith("; data.eval_prompts=16: only 5 of the source's 20 prompts held out (at most "
                                           "a quarter; none from fewer than 4), training on 15"), result.output


def test_a_jsonl_line_that_is_not_an_object_is_one_line(tmp_path, tiny_actor_path):
    source = tmp_path / "lines.jsonl"
    source.write_text('{"prompt": "fine"}\n[1, 2]\n')
    _refused(_check(source, tiny_actor_path),
             f'data.source: {source} line 2 is a list, not a JSON object with a "prompt" field (data.prompt_key)')


def test_a_jsonl_line_without_the_prompt_field_names_its_fields(tmp_path, tiny_actor_path):
    """A chat dataset's "messages" rows: the line says which field to name (data.prompt_key)."""
    source = tmp_path / "chat.jsonl"
    source.write_text('{"messages": [{"role": "user", "content": "hi"}], "id": 3}\n')
    _refused(_check(source, tiny_actor_path),
             f'data.source: {source} line 1 has no "prompt" field (data.prompt_key); its fields: messages, id')


def _parquet(path: Path) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(100)]}), path)
    return path.read_bytes()


def test_a_truncated_parquet_is_one_line(tmp_path, tiny_actor_path, library_errors):
    source = tmp_path / "cut.parquet"
    source.write_bytes(_parquet(tmp_path / "whole.parquet")[:300])
    _refused(_check(source, tiny_actor_path),
             f"data.source: cannot load {source}: Parquet magic bytes not found in footer. Either the file is "
             "corrupted or this is not a parquet file.", library_errors)


def test_a_truncated_json_file_is_one_line_with_its_cause(tmp_path, tiny_actor_path, library_errors):
    source = tmp_path / "cut.json"
    source.write_text('[{"prompt": "a"}, {"prompt": ')
    _refused(_check(source, tiny_actor_path),
             f"data.source: cannot load {source}: Expected object or value at position 28", library_errors)


def test_a_garbled_parquet_is_one_line(tmp_path, tiny_actor_path, library_errors):
    whole = _parquet(tmp_path / "whole.parquet")
    source = tmp_path / "garbled.parquet"
    source.write_bytes(whole[:4] + bytes(range(256)) * 4 + whole[-8:])  # its magic and footer length, garbage between
    result = _check(source, tiny_actor_path)
    assert result.exit_code == 2 and result.stdout == "", result.output
    assert result.stderr.startswith(f"error: data.source: cannot load {source}: ") and result.stderr.count("\n") == 1, \
        result.stderr
    assert not library_errors, f"and datasets printed: {[r.getMessage() for r in library_errors]}"
