"""What makes a user's data file unreadable, said in the one line that refuses it.

Owns: :func:`not_utf8`, where the first byte of a file that UTF-8 cannot decode is (line,
byte offset, the byte), read in blocks so a large file is never held whole; and
:func:`library_errors_held`, which keeps the warning and error lines the ``datasets`` and
``huggingface_hub`` libraries log while a load runs (datasets' errors just before it raises,
the Hub client's line for each retry of an unreachable Hub): a failed load is then one line
of colocate's that quotes the cause (``colocate.assets.tasks``), a load that succeeds still
prints them, after it.
Leaves out: which sources exist and how rows become prompts (``colocate.assets.tasks``).
"""

from __future__ import annotations

import codecs
import contextlib
import logging
from pathlib import Path
from typing import Iterator

BLOCK = 1 << 20  # bytes read at a time
NEWLINE = b"\n"


def not_utf8(path: str | Path) -> str:
    """Where ``path`` stops being UTF-8: "line 2 has byte 0xe9 (byte offset 35 of the file)";
    "" when all of it decodes (a byte-order mark is UTF-8 too)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, lines = 0, 1  # bytes before this block; the line this block starts on
    with open(path, "rb") as f:
        while True:
            block = f.read(BLOCK)
            pending = len(decoder.getstate()[0])  # a character's first bytes, from the block before
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as exc:  # exc.object: those pending bytes + this block
                line = lines + exc.object[:exc.start].count(NEWLINE)
                return (f"line {line} has byte 0x{exc.object[exc.start]:02x} "
                        f"(byte offset {offset - pending + exc.start} of the file)")
            if not block:
                return ""
            offset, lines = offset + len(block), lines + block.count(NEWLINE)


class _Held(logging.Filter):
    """Keeps the records of WARNING and above instead of letting a handler print them."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[logging.Handler, logging.LogRecord]] = []
        self.handler: logging.Handler | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        self.records.append((self.handler, record))
        return False


@contextlib.contextmanager
def library_errors_held(*libraries: str) -> Iterator[None]:
    """While the block runs, the warning and error lines of ``libraries`` (their loggers'
    handlers: a child logger's records reach them too) are held: printed after it if it
    succeeds, dropped if it raises (the caller's one line quotes the cause)."""
    handlers = list(dict.fromkeys(h for name in libraries for h in logging.getLogger(name).handlers))
    filters = {h: _Held() for h in handlers}
    for handler, held in filters.items():
        held.handler = handler
        handler.addFilter(held)
    try:
        yield
    finally:
        for handler, held in filters.items():
            handler.removeFilter(held)
    for held in filters.values():  # reached only when the block succeeded
        for handler, record in held.records:
            handler.handle(record)
