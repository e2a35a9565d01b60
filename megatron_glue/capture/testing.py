"""Pytest fixtures for any test folder that runs megatron-core on CPU in one process.

Import the ones you need into that folder's conftest.py:

    from megatron_glue.capture.testing import megatron_cpu, fresh_dynamo  # noqa: F401

As a pytest plugin (`-p megatron_glue.capture.testing`) it adds `--megatron-only DIR`: of the tests collected under
DIR, run only those that use megatron-core (they ask for `megatron_cpu`, or their name says Megatron); tests
elsewhere run as collected. `make test-mcore012` gives it tests/passes, where Megatron tests sit beside others, to
run just those on megatron-core 0.12.1 in the same session as the Megatron folders' tests.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from megatron_glue.capture import adapt
from megatron_glue.capture.adaptations import megatron_core_in, registry


@pytest.fixture(scope="session")
def megatron_cpu():
    """Adaptation groups "cpu" and "compile" applied, and a gloo process group at TP=PP=1, for the session."""
    from megatron_glue.capture import models  # imports Megatron (seconds), so only when a test asks for it

    global SESSION
    adapt(("cpu", "compile"))
    models.init_single_process()
    SESSION = True
    yield
    SESSION = False
    models.teardown_single_process()


SESSION = False  # whether megatron_cpu's state is the session's (a block that tears it down puts it back)


@contextlib.contextmanager
def fake_process_group(world_size: int = 8):
    """A fake default process group of ``world_size`` ranks (torch's ``fake`` backend: collectives trace, nothing
    runs) for the block, yielding the group. The session's single-process Megatron state (:func:`megatron_cpu`),
    where an earlier test set it up, is taken down for the block and put back after it."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    megatron_state = dist.is_initialized()
    if megatron_state:
        from megatron_glue.capture import models

        models.teardown_single_process()
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
        if megatron_state:
            models.init_single_process()


@pytest.fixture
def fresh_dynamo():
    """Dynamo caches cleared before and after: every test compiles its own model, and GPTModel.forward
    compiled for many models in one process would otherwise run into the recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def megatrons_own_rng_tracker() -> None:
    """Build Megatron's own (CUDA) RNG tracker again, replacing the one in place, as a fresh process would have
    it; with the "cpu" adaptation "inference_rng_tracker[_0_12]" taken off, the next dropout needs CUDA."""
    from megatron.core.tensor_parallel import random

    if megatron_core_in(">=0.13"):
        random.initialize_rng_tracker(force_reset=True)
    else:  # 0.12 keeps the first tracker built (0.12.1: tensor_parallel/random.py:243) and has no force_reset
        random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        random.initialize_rng_tracker()


@contextlib.contextmanager
def adaptations_reverted(*names: str):
    """Run a block with the named adaptations taken off (to show each is needed), then put them back. An
    adaptation applied later over the same target (one wrapping the other) comes off with it and back after."""
    applied = list(registry.applied())
    was_applied = [n for n in names if n in applied]
    targets = {registry.get(n).target for n in was_applied}
    start = min((applied.index(n) for n in was_applied), default=len(applied))
    off = set(was_applied) | {n for n in applied[start:] if registry.get(n).target in targets}
    taken = [n for n in applied if n in off]  # application order
    registry.revert(*taken)
    try:
        yield
    finally:
        registry.apply(*taken)


# -- as a pytest plugin ------------------------------------------------------------------------------------

def pytest_addoption(parser):
    parser.addoption("--megatron-only", action="append", default=[], metavar="DIR",
                     help="under DIR (a folder; repeatable) run only the tests that use megatron-core: those that ask "
                     "for the megatron_cpu fixture or whose name says megatron (megatron_glue.capture.testing)")


def uses_megatron(item) -> bool:
    """Whether a collected test uses megatron-core, as far as collection can tell: it asks for `megatron_cpu`
    (directly or through another fixture), or its name says so (e.g. test_megatron_rope_equals_eager)."""
    return "megatron_cpu" in getattr(item, "fixturenames", ()) or "megatron" in item.name.lower()


def pytest_collection_modifyitems(config, items):
    folders = [Path(config.invocation_params.dir, folder).resolve() for folder in config.getoption("--megatron-only")]
    for folder in folders:
        if not folder.is_dir():
            raise pytest.UsageError(f"--megatron-only {folder}: not a folder (give the folder whose tests it limits "
                                    "to those using megatron-core, e.g. tests/passes)")
    if not folders:
        return
    kept = [item for item in items
            if uses_megatron(item) or not any(item.path.is_relative_to(folder) for folder in folders)]
    if len(kept) < len(items):
        kept_ids = set(map(id, kept))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept_ids])
        items[:] = kept
