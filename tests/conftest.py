"""Shared fixtures: tiny random models built per session, and real SGLang engines on CPU.

Engines are session-scoped (a start costs ~13 s on 2 cores); tests that change engine
state (weights) restore it or use their own engine. Runs (``api.train``, ``builder.build``)
that leave their engines alive take them from :func:`engine_pool`, so the suite starts
each engine configuration once instead of once per run; ``tiny_pair`` builds one folder
pair per seed pair, so modules with the same seeds share models (and so engines), and a
module that names its seeds (``SEEDS``) runs right after the first module with the same
ones (``pytest_collection_modifyitems``), so the pool still holds their engines.

Pinned to CPU, on a CUDA machine too: the shared engines start with ``device="cpu"`` and
every run the tests build carries :data:`CPU` (``engines.device=cpu``, which also puts
the trainer on CPU). What these tests check is the CPU path's facts (fp32 exactness
against HF, release/resume a no-op, gloo); with ``device=auto`` a CUDA machine would give
the shared engines CUDA and a test that releases one would leave later tests an engine
with its KV cache and CUDA graphs unmapped. The CUDA path's own tests say so in their
names and skip without CUDA (``tests/integration/test_trainer.py``); its decisions are
unit-tested on CPU (``tests/unit/test_timesharing.py``, ``tests/unit/test_placement.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from colocate.assets.random_models import build_tiny_causal_lm, build_tiny_reward_model
from colocate.engine.pool import EnginePool
from colocate.quick_exit import skip_last_collection

CPU = "engines.device=cpu"  # every run of the suite: engines and trainer on CPU (see above)
# and in float32: models.dtype=auto picks bfloat16 on CPUs that multiply it natively
# (trainer/precision.py), which would make the suite's exact comparisons depend on the machine
FLOAT32 = "models.dtype=float32"
# and one thread per engine: the auto budget (run/builder.engine_threads, unit-tested in
# tests/unit/test_engine_threads.py) gives a sequential run's engines every core and an
# overlapped one's half, and an engine's threads are fixed when it starts, so with it a
# sequential and an oppo run on the same models could not share the pool's engines
THREADS = ("engines.actor_threads=1", "engines.reward_threads=1")
POOL = pytest.StashKey[EnginePool]()  # the session's engine pool, for the summary line


def pytest_terminal_summary(terminalreporter, config):
    """One line: engines the pool started and those it handed to a later run (the suite's
    time is mostly engine and process starts)."""
    pool = config.stash.get(POOL, None)
    if pool is not None:
        terminalreporter.write_line(f"engine pool: {pool.started} engines started ({pool.again} of them for a config "
                                    f"an earlier run had started), {pool.reused} handed over to a later run, "
                                    f"{pool.evicted} shut down to keep at most {pool.max_idle} idle")
        for label, modules in pool.restarted():  # where the suite's time goes: starts a bigger pool would save
            terminalreporter.write_line(f"  started {len(modules)}x: {label} by {', '.join(modules)}")


class _SuitePool(EnginePool):
    """The session's pool, also counting the starts of a config an earlier run had started
    (its engine shut down meanwhile: more than ``max_idle`` were kept, or it could not be)
    and the engines shut down only to keep at most ``max_idle`` idle."""

    def __init__(self, max_idle: int) -> None:
        super().__init__(max_idle)
        self.configs: dict[str, tuple[str, list[str]]] = {}  # config -> (label, test modules that started it)
        self.again = 0
        self.evicted = 0

    def give_back(self, eng) -> None:
        before, was_idle = self.idle(), eng in self.kept()
        super().give_back(eng)
        if not was_idle and eng in self.kept():  # kept: the oldest idle ones may have made room
            self.evicted += before + 1 - self.idle()

    def take(self, cfg, *, field: str = "model_path"):
        eng, reused = super().take(cfg, field=field)
        if not reused:
            self.again += repr(cfg) in self.configs
            label = f"{cfg.role} {Path(cfg.model_path).parent.name}/{Path(cfg.model_path).name}"
            module = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0].rsplit("/", 1)[-1]
            self.configs.setdefault(repr(cfg), (label, []))[1].append(module)
        return eng, reused

    def restarted(self) -> list[tuple[str, list[str]]]:
        """(label, test modules) of each engine config started more than once, most starts first."""
        again = [(label, modules) for label, modules in self.configs.values() if len(modules) > 1]
        return sorted(again, key=lambda x: -len(x[1]))


def pytest_collection_modifyitems(config, items):
    """Modules that run on the same pooled engines run one after another: a module's
    ``SEEDS`` (the seeds of the ``tiny_pair`` its runs use) pulls every later module with
    equal seeds up behind it, so their engines are handed over instead of being shut down
    between them by the pool's ``max_idle`` and started again. Tests keep their order within
    a module, and modules without ``SEEDS`` keep their places."""
    modules: dict[Path, list] = {}  # each test file's items, in collection order
    seeds: dict[Path, tuple] = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
        if getattr(getattr(item, "module", None), "SEEDS", None) is not None:
            seeds[item.path] = tuple(item.module.SEEDS)
    order: list[Path] = []
    for path in modules:
        if path not in order:
            key = seeds.get(path)
            order += [p for p in modules if p not in order and (p == path or (key and seeds.get(p) == key))]
    items[:] = [item for path in order for item in modules[path]]


def pytest_unconfigure(config):
    skip_last_collection()  # the exit's last collection would walk every object the suite made


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def tiny_actor_path(tiny_dir):
    return str(build_tiny_causal_lm(tiny_dir / "actor", arch="llama", seed=0))


@pytest.fixture(scope="session")
def tiny_qwen_path(tiny_dir):
    return str(build_tiny_causal_lm(tiny_dir / "qwen", arch="qwen2", seed=1))


@pytest.fixture(scope="session")
def tiny_rm_path(tiny_dir):
    return str(build_tiny_reward_model(tiny_dir / "rm", arch="llama", seed=2))


@pytest.fixture(scope="session")
def actor_engine(tiny_actor_path):
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    # one of SGLang's own arguments (engines.sglang), not its default: read back in test_engine_errors
    eng = SglangEngine(EngineConfig(tiny_actor_path, role="actor", device="cpu", max_total_tokens=16384,
                                    server_args={"watchdog_timeout": 600.0}))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def reward_engine(tiny_rm_path):
    from colocate.engine.engine_config import EngineConfig
    from colocate.engine.runtime import SglangEngine

    # the one engine of the test process with SGLang metrics on (they are process-global)
    eng = SglangEngine(EngineConfig(tiny_rm_path, role="reward", device="cpu", max_total_tokens=16384,
                                    enable_metrics=True))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def world1():
    """A one-process gloo group for trainers in this process (torch.distributed's, made here
    unless one exists; destroyed after the module if made here)."""
    import torch.distributed as dist

    from colocate.trainer.distributed import init_distributed

    created = not dist.is_initialized()
    info = init_distributed("cpu")
    yield info
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _few_threads():
    torch.set_num_threads(2)
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory, tiny_actor_path, tiny_rm_path):
    """Builds a tiny (actor, reward model) pair of folders: ``tiny_pair(name, actor_seed,
    rm_seed)``; the same seeds give the same folders (built once, under the first name;
    seeds 0 and 2: the session's ``tiny_actor_path`` and ``tiny_rm_path``, so runs on either
    share the pool's engines)."""
    built: dict[tuple[int, int], tuple[str, str]] = {(0, 2): (tiny_actor_path, tiny_rm_path)}

    def build(name: str, actor_seed: int, rm_seed: int) -> tuple[str, str]:
        if (actor_seed, rm_seed) not in built:
            root = tmp_path_factory.mktemp(name)
            built[actor_seed, rm_seed] = (str(build_tiny_causal_lm(root / "actor", seed=actor_seed)),
                                          str(build_tiny_reward_model(root / "rm", seed=rm_seed)))
        return built[actor_seed, rm_seed]

    return build


@pytest.fixture(scope="session")
def engine_pool(request):
    """Engines kept across the suite's runs (``colocate.engine.pool``): a run on models and
    engine settings an earlier run used takes its engines instead of starting its own."""
    with _SuitePool(max_idle=4) as pool:
        request.config.stash[POOL] = pool
        yield pool


@pytest.fixture(scope="session")
def run_overrides():
    """``run_overrides(models, out_dir, *extra)``: config overrides of a small PPO run on a
    tiny (actor, rm) pair: batch 4 in 2 minibatches, small KV pools."""
    return _run_overrides


def _run_overrides(models: tuple[str, str], out_dir, *extra: str) -> list[str]:
    actor, rm = models
    return [f"models.actor={actor}", f"models.reward={rm}", f"run.out_dir={out_dir}",
            "rollout.batch_size=4", "ppo.minibatches=2", "data.max_prompt_tokens=512",
            "engines.actor_max_total_tokens=8192", "engines.reward_max_total_tokens=8192", CPU, FLOAT32, *THREADS,
            *extra]
