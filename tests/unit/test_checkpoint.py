"""Checkpoints are atomic and verified: a writer killed mid-write never damages the last one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from colocate.run import checkpoint
from colocate.run.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[2]


def test_save_load_roundtrip_and_prune(tmp_path):
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, {"w": torch.full((3,), float(step)), "meta": {"s": step}}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    step, parts = checkpoint.load(checkpoint.latest(tmp_path))
    assert step == 3 and torch.equal(parts["w"], torch.full((3,), 3.0)) and parts["meta"] == {"s": 3}


def test_corrupt_file_is_refused_with_one_line(tmp_path):
    path = checkpoint.save(tmp_path, 1, {"w": torch.zeros(4)})
    (path / "w.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="fails its checksum") as e:
        checkpoint.load(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, said", [
    ("{", "has an unreadable manifest.json (Expecting property name enclosed in double quotes: line 1 column 2 "
          "(char 1))"),
    ("[]", "has a damaged manifest.json (not the step, files and meta colocate writes)"),
    ('{"step": "two", "files": {}}', "has a damaged manifest.json (not the step, files and meta colocate writes)"),
    ('{"step": 2, "files": {"w.pt": 3}}', "has a damaged manifest.json (not the step, files and meta colocate writes)"),
])
def test_a_damaged_manifest_is_one_line_naming_the_checkpoint_before_it(tmp_path, text, said):
    """Before: a JSONDecodeError, KeyError or TypeError traceback (a hand-edited manifest)."""
    checkpoint.save(tmp_path, 1, {"w": torch.zeros(4)}, keep=5)
    newest = checkpoint.save(tmp_path, 2, {"w": torch.ones(4)}, keep=5)
    (newest / checkpoint.MANIFEST).write_text(text)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(newest)
    assert str(e.value) == f"--resume: checkpoint '{newest}' {said}; the one before it: --resume {tmp_path / 'step_00000001'}"


def test_a_deleted_part_is_said_before_anything_starts_and_is_not_called_corrupt(tmp_path):
    path = checkpoint.save(tmp_path, 1, {"w": torch.zeros(4), "v": torch.zeros(1)})
    checkpoint.check_complete(path)  # all there
    (path / "w.pt").unlink()
    said = f"--resume: checkpoint '{path}' is incomplete (w.pt missing); no earlier checkpoint is there"
    with pytest.raises(CheckpointError) as e:
        checkpoint.check_complete(path)  # (resume.check_resume, before any engine)
    assert str(e.value) == said
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path)
    assert str(e.value) == said


def test_missing_checkpoint_is_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="--resume: no checkpoint"):
        checkpoint.latest(tmp_path)


def test_writer_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path):
    checkpoint.save(tmp_path, 1, {"w": torch.ones(8)})
    code = ("import sys, torch; sys.path.insert(0, %r); from colocate.run import checkpoint; "
            "checkpoint.save(__import__('pathlib').Path(%r), 2, "
            "{f'p{i}': torch.randn(4_000_000) for i in range(40)})" % (str(ROOT), str(tmp_path)))
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".tmp_step_00000002_*/p*.pt")) and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(tmp_path.glob(".tmp_step_00000002_*")), "the writer was killed before it started writing"
    latest = checkpoint.latest(tmp_path)
    assert latest.name == "step_00000001"
    step, parts = checkpoint.load(latest)
    assert step == 1 and torch.equal(parts["w"], torch.ones(8))


class _Planted:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_part_that_pickles_an_object_is_refused_in_one_line_and_never_run(tmp_path):
    """Issue 38.1: tensors and plain data only (torch's weights_only); the checksums match,
    as a tampered folder's would."""
    marker = tmp_path / "planted-ran"
    path = checkpoint.save(tmp_path / "c", 3, {"trainer": {"w": torch.ones(2), "x": _Planted(marker)},
                                               "run": {"step": 3}})
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(path, what="export")
    msg = str(e.value)
    assert msg.startswith("export: checkpoint") and "refused: trainer.pt holds an object" in msg
    assert "(io.open)" in msg and "\n" not in msg and not marker.exists()
    step, parts = checkpoint.load(path, only=("run",))  # the plain parts still read
    assert step == 3 and parts == {"run": {"step": 3}}
