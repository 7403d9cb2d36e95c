"""Which model or data set a path holds, wherever the path is: a resume may find its files moved.

Owns: :func:`fingerprint` of a model folder: a SHA-256 over its ``config.json``, its
tokenizer files and, of each weight file (``*.safetensors``, ``*.bin``, ``*.pt``), its
name, its size and :data:`SAMPLES` blocks of :data:`BLOCK` bytes read at evenly spaced
offsets (the first holds a safetensors header: every tensor's name, dtype, shape and
offset); and :func:`data_fingerprint` of a data file or folder (``data.source``): each
file's name under the folder, its size and its bytes (whole up to :data:`WHOLE` bytes,
else sampled the same way). Reading a few MiB at most per file, they take milliseconds
for any size. Equal fingerprints mean the same configuration, tokenizer and file layout,
and equal bytes at every sampled place: for weights that differ broadly (another
checkpoint, another fine-tune) the samples differ; a change of a few tensors between the
samples would not be seen. Leaves out: where fingerprints are recorded and compared
(``colocate.run.session``'s checkpoint meta, ``colocate.run.resume``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

WEIGHTS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
             "special_tokens_map.json")
SAMPLES = 64  # blocks read of each weight file
BLOCK = 1 << 16  # bytes per block: 4 MiB read at most per weight file
WHOLE = 1 << 24  # a data file up to this size is read whole


def fingerprint(folder: str | Path) -> str | None:
    """The fingerprint of the model folder ``folder``; None where it is no folder with a
    ``config.json`` (a name colocate resolves, a folder gone)."""
    root = Path(folder).expanduser()
    if not (root / "config.json").is_file():
        return None
    digest = hashlib.sha256()
    for name in ("config.json", *TOKENIZER):
        if (root / name).is_file():
            digest.update(name.encode() + b"\0" + (root / name).read_bytes() + b"\0")
    for path in sorted({p for pattern in WEIGHTS for p in root.glob(pattern) if p.is_file()}):
        _file(digest, path.name, path)
    return digest.hexdigest()


def data_fingerprint(source: str) -> str | None:
    """The fingerprint of the data file or folder ``source`` (``data.source``); None where it
    is none (a name: ``sentiment-prompts``, ``hf:...``, ``reasoning-gym:...``)."""
    root = Path(source).expanduser()
    if root.is_file():
        files = [("", root)]
    elif root.is_dir():
        files = sorted((str(p.relative_to(root)), p) for p in root.rglob("*") if p.is_file())
    else:
        return None
    digest = hashlib.sha256()
    for name, path in files:
        _file(digest, name, path, whole=path.stat().st_size <= WHOLE)
    return digest.hexdigest()


def _file(digest, name: str, path: Path, whole: bool = False) -> None:
    """``name``, the size and the bytes of ``path`` (whole, or :data:`SAMPLES` blocks) into ``digest``."""
    size = path.stat().st_size
    digest.update(f"{name}\0{size}\0".encode())
    with path.open("rb") as f:
        if whole:
            digest.update(f.read())
            return
        for k in range(SAMPLES):
            f.seek(k * max(0, size - BLOCK) // max(1, SAMPLES - 1))
            digest.update(f.read(BLOCK))
