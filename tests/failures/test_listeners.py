"""Item 3 of issue 50: nothing a run opens listens on an address other than loopback.

During a real run (tiny models, the suite's engine pool), every TCP socket in the LISTEN
state owned by this process or one of its children (SGLang's schedulers and detokenizers)
is read from /proc (``tests/failures/listeners.py``); 0.0.0.0 and :: count as
non-loopback. ``colocate train --nproc 2`` is watched the same way through the launch of
``tests/integration/test_launch.py`` (torchrun's launcher, its ranks and their engines;
no launch of its own: the suite's time).

Where the machine's hostname resolves to 127.0.0.1 (as here) gloo listens on loopback
anyway; on one whose hostname resolves to its external address gloo would not, unless
told (``trainer.distributed.loopback_transports``): checked by hand in a private UTS and
mount namespace (``unshare -m -u``, the hostname bound to an external address in a private
/etc/hosts), where these tests pass too."""

from __future__ import annotations

import os

import pytest

from colocate import api
from colocate.config import load_config
from tests.failures.listeners import beyond_loopback, listeners_of

pytestmark = pytest.mark.slow
SEEDS = (0, 2)  # the session's tiny_actor_path and tiny_rm_path: modules with equal seeds run one after another on the pool's engines (conftest)


def test_a_run_listens_on_loopback_only(tiny_pair, run_overrides, engine_pool, tmp_path):
    seen = []

    def look(record):
        seen.extend(listeners_of(os.getpid()))

    models = tiny_pair("listen", 0, 2)
    cfg = load_config(overrides=run_overrides(models, tmp_path / "run", "run.steps=1", "rollout.max_new_tokens=8"))
    api.train(cfg, callbacks=[look], quiet=True, engines=engine_pool)
    assert any("scheduler" in cmd for _, cmd, _, _ in seen), seen  # the look sees the engines' sockets
    wide = beyond_loopback(seen)
    assert not wide, "listening beyond loopback: " + "; ".join(wide)
