"""run.fault_at, the test hook: parsed and validated in one line, each fault fired once per run folder."""

from __future__ import annotations

import pytest

from colocate import faults
from colocate.config import load_config
from colocate.errors import ConfigError


def test_off_by_default_and_validated_in_one_line():
    assert load_config().run.fault_at == ""
    assert faults.parse("generate:2, update:3:1") == [("generate", 2, None), ("update", 3, 1)]
    for bad in ("gen:2", "score", "score:0", "score:x", "score:1:2:3"):
        with pytest.raises(ConfigError, match="run.fault_at") as info:
            load_config(overrides=[f"run.fault_at={bad}"])
        assert "\n" not in str(info.value)


def test_a_fault_fires_once_on_its_rank(tmp_path):
    spec = "sync:2:1,checkpoint:3"
    assert faults.due(spec, "sync", 2, 0, []) is None  # rank 1 only
    assert faults.due(spec, "sync", 2, 1, []) == "sync:2:1"
    assert faults.due(spec, "sync", 2, 1, ["sync:2:1"]) is None  # fired: a resume passes it
    faults.fire(spec, "raise", "score", 2, 0, tmp_path)  # not a fault point of this spec: nothing
    with pytest.raises(faults.FaultInjected, match="sync of step 2 on rank 1"):
        faults.fire(spec, "raise", "sync", 2, 1, tmp_path)
    faults.fire(spec, "raise", "sync", 2, 1, tmp_path)  # once
    assert (tmp_path / faults.FIRED).read_text().split() == ["sync:2:1"]
