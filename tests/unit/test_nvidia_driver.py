"""The NVIDIA driver check of `colocate doctor` and scripts/install.sh, on nvidia-smi's
output as given (no GPU needed), and the script as install.sh runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.tools.nvidia_driver import driver_note

SCRIPT = Path(__file__).resolve().parents[2] / "colocate" / "tools" / "nvidia_driver.py"


@pytest.mark.parametrize("output, ok, said", [
    ("580.65.06\n", True, "580.65.06 (CUDA 13 needs >= 580: ok)"),
    ("590.44.01\n590.44.01\n", True, "590.44.01 (CUDA 13 needs >= 580: ok)"),  # one line per GPU
    ("550.54.15\n", False, "550.54.15 is older than 580, which CUDA 13"),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.", False,
     "instead of a driver version; is the NVIDIA driver loaded?"),
    (None, True, "none (no nvidia-smi): CPU only"),
    ("", True, "none (no nvidia-smi): CPU only"),
])
def test_driver_note_is_one_line(output, ok, said):
    got_ok, line = driver_note(output)
    assert got_ok is ok and said in line and "\n" not in line
    if not ok and "older" in line:
        assert "update the NVIDIA driver, or install for CPU (COLOCATE_DEVICE=cpu)" in line


def test_install_sh_stops_on_an_old_driver_in_one_line(tmp_path):
    """install.sh runs the file by its path (colocate is not installed yet) with whatever
    nvidia-smi the machine has: here a stand-in reporting driver 550."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 550.54.15\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 1 and done.stderr == ""
    assert done.stdout.count("\n") == 1 and done.stdout.startswith("[install] NVIDIA driver: 550.54.15 is older than 580")
    fake.write_text("#!/bin/sh\necho 580.82.07\n")
    assert subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, env=env, cwd=tmp_path).returncode == 0
    assert "$PY colocate/tools/nvidia_driver.py" in (SCRIPT.parents[2] / "scripts" / "install.sh").read_text()
