"""Which model a folder holds, wherever the folder is: a resume may find its models moved.

Owns: :func:`fingerprint` of a model folder: a SHA-256 over its ``config.json``, its
tokenizer files and, of each weight file (``*.safetensors``, ``*.bin``, ``*.pt``), its
name, its size and :data:`SAMPLES` blocks of :data:`BLOCK` bytes read at evenly spaced
offsets (the first holds a safetensors header: every tensor's name, dtype, shape and
offset). Reading a few MiB, not the weights, it takes milliseconds for any model size. Two
folders with equal fingerprints hold the same configuration, tokenizer and weight files'
layout, and equal bytes at every sampled place: for weights that differ broadly (another
checkpoint, another fine-tune) the samples differ; a change of a few tensors between the
samples would not be seen. Leaves out: where fingerprints are recorded and compared
(``colocate.run.session``'s checkpoint meta, ``colocate.run.resume``).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MODEL_FOLDERS = ("actor", "reward", "critic")  # the models.* fields that name a model (a folder, or a name)
WEIGHTS = ("*.safetensors", "*.bin", "*.pt")
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
             "special_tokens_map.json")
SAMPLES = 64  # blocks read of each weight file
BLOCK = 1 << 16  # bytes per block: 4 MiB read at most per weight file


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
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with path.open("rb") as f:
            for k in range(SAMPLES):
                f.seek(k * max(0, size - BLOCK) // max(1, SAMPLES - 1))
                digest.update(f.read(BLOCK))
    return digest.hexdigest()
