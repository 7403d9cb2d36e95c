"""Item 6 of issue 50 (its disk half): a checkpoint written to a full disk is one line naming
the folder, "no space left on device", and the newest earlier checkpoint, which is intact;
the partial write is removed. On a real full filesystem (a 1 MiB tmpfs, where this test
may mount one: root) or, where it cannot mount, under a file-size limit (RLIMIT_FSIZE in
a subprocess: the same write fails with EFBIG, "file too large")."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate.errors import USER_ERRORS
from colocate.run import checkpoint

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"trainer": {"w": torch.zeros(1000)}, "run": {"step": 1}}  # ~4 KB
BIG = {"trainer": {"w": torch.zeros(1 << 19)}, "run": {"step": 2}}  # 2 MiB: more than the disk holds


def _line(root: Path, step: int, why: str) -> str:
    return (f"checkpoint of step {step} not written to '{root}': {why} (its partial files removed); the earlier "
            f"checkpoints are intact, the newest is '{root / 'step_00000001'}'; free space there, then continue "
            f"with --resume {root.parent}")


@contextlib.contextmanager
def _tmpfs(where: Path, size: str = "1m"):
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                             capture_output=True, text=True)
    try:
        yield mounted.returncode == 0
    finally:
        if mounted.returncode == 0:
            subprocess.run(["umount", "--lazy", str(where)], check=True)  # lazy: a failed write may still hold a file


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_last_one_survives(tmp_path):
    with _tmpfs(tmp_path / "disk") as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (not root): the file-size-limit test covers it")
        root = tmp_path / "disk" / "run" / "checkpoints"
        checkpoint.save(root, 1, SMALL)
        with pytest.raises(checkpoint.CheckpointError) as full:
            checkpoint.save(root, 2, BIG)
        assert isinstance(full.value, USER_ERRORS)  # the CLI prints it as one line, exit status 2
        assert str(full.value) == _line(root, 2, "no space left on device")
        assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]  # no partial folder left
        step, parts = checkpoint.load(checkpoint.latest(root.parent))  # verifies every checksum
        assert step == 1 and torch.equal(parts["trainer"]["w"], SMALL["trainer"]["w"])


LIMITED = """
import resource, signal, sys
from pathlib import Path
import torch
from colocate.run import checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
root = Path(sys.argv[1])
checkpoint.save(root, 1, {"trainer": {"w": torch.zeros(1000)}, "run": {"step": 1}})
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    checkpoint.save(root, 2, {"trainer": {"w": torch.zeros(1 << 19)}, "run": {"step": 2}})
except checkpoint.CheckpointError as exc:
    print(exc)
"""


def test_a_file_size_limit_during_a_checkpoint_is_one_line_and_the_last_one_survives(tmp_path):
    root = tmp_path / "run" / "checkpoints"
    done = subprocess.run([sys.executable, "-c", LIMITED, str(root)], cwd=str(ROOT), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == _line(root, 2, "file too large")
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]
    step, _ = checkpoint.load(checkpoint.latest(root.parent))
    assert step == 1


def _records_line(path: Path, why: str) -> str:
    return (f"records not written to '{path}': {why} (the file is as it was before); the checkpoints are intact: "
            f"free space there, then continue with --resume {path.parent}")


def test_a_full_disk_on_a_metrics_line_is_one_line_and_no_torn_record(tmp_path):
    """A step's line in metrics.jsonl on a full disk: one line (a colocate error: the CLI's
    exit 2), and the file holds exactly the earlier steps' lines, none cut in half."""
    from colocate.monitor.metrics import MetricsLog
    from colocate.monitor.records import RecordsNotWrittenError

    with _tmpfs(tmp_path / "disk", size="64k") as mounted:
        if not mounted:
            pytest.skip("cannot mount a tmpfs here (not root): the file-size-limit test covers it")
        run = tmp_path / "disk" / "run"
        log = MetricsLog(run, enabled=True)
        log._tb = None  # only the JSONL file is under test (TensorBoard's event file would share the disk)
        log.write({"step": 1, "reward_mean": 0.5})
        before = (run / "metrics.jsonl").read_bytes()
        with pytest.raises(RecordsNotWrittenError) as full:
            log.write({"step": 2, "pad": "x" * (1 << 17)})  # 128 KiB: more than the disk holds
        assert isinstance(full.value, USER_ERRORS)
        assert str(full.value) == _records_line(run / "metrics.jsonl", "no space left on device")
        assert (run / "metrics.jsonl").read_bytes() == before


RECORDS_LIMITED = """
import resource, signal, sys
from pathlib import Path
from colocate.monitor.records import RecordsNotWrittenError, append_jsonl
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
path = Path(sys.argv[1])
append_jsonl(path, [{"step": 1}])
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    append_jsonl(path, [{"step": 2, "pad": "x" * 8192}])
except RecordsNotWrittenError as exc:
    print(exc)
"""


def test_a_file_size_limit_on_a_records_line_is_one_line_and_no_torn_record(tmp_path):
    path = tmp_path / "run" / "samples.jsonl"
    path.parent.mkdir()
    done = subprocess.run([sys.executable, "-c", RECORDS_LIMITED, str(path)], cwd=str(ROOT), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == _records_line(path, "file too large")
    assert path.read_text() == '{"step": 1}\n'
