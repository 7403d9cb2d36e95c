"""Text a model or a dataset produced, printed as data: a terminal never runs it as commands.

Owns: :func:`visible`, which every path that prints such text applies (``colocate show``,
``colocate generate``, progress lines, the CLI's one-line errors, which may quote a
dataset's values or a reward function's message). A completion holding ``ESC[2J`` would
clear the screen, ``ESC]52;c;…`` write the clipboard, ``ESC]0;…`` set the window title,
``ESC]8;;…`` plant a hyperlink, ``\\r`` or backspaces overwrite what was printed before it,
a bidi override reorder the line; shown visibly they are text. Leaves out: what is written
to files (``samples.jsonl`` keeps the text exact; JSON escapes its controls), TensorBoard
and W&B (not a terminal).
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls (0x9b is a one-byte CSI), the bidi controls that reorder a
# line (U+061C, U+200E/F, U+202A-E, U+2066-9) and the Unicode line/paragraph separators
_HIDDEN = "\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"


LAYOUT = "\n\t"  # what a multi-line text (a response) keeps as it is: its line breaks and tabs
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}  # as Python writes them; the others by their code


def _shown(char: str) -> str:
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def _pattern(keep: str) -> re.Pattern[str]:
    kept = "".join(re.escape(c) for c in keep)
    hidden = f"[{_HIDDEN}]" if not kept else f"(?![{kept}])[{_HIDDEN}]"
    return re.compile(r"\r\n|" + hidden if "\n" in keep else hidden)


def visible(text: str, keep: str = "") -> str:
    """``text`` with every control character written as its escape (ESC as ``\\x1b``, the
    bidi override U+202E as ``\\u202e``, a carriage return as ``\\r``): nothing in it moves the cursor, styles, titles,
    links or reorders. ``keep``: controls the layout uses as they are (``"\\n\\t"`` for a
    multi-line response; a CRLF then ends a line like ``\\n``, while a lone ``\\r``, which
    would overwrite the line, is escaped). Other text (letters of any script, emoji, a
    backslash) is unchanged."""
    return _pattern(keep).sub(lambda m: "\n" if m[0] == "\r\n" else _shown(m[0]), text)
