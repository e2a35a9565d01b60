"""Pytest fixtures for any test folder that runs megatron-core on CPU in one process.

Import the ones you need into that folder's conftest.py:

    from megatron_glue.testing import megatron_cpu, fresh_dynamo  # noqa: F401
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_glue import adapt
from megatron_glue.adaptations import registry


@pytest.fixture(scope="session")
def megatron_cpu():
    """Adaptation groups "cpu" and "compile" applied, and a gloo process group at TP=PP=1, for the session."""
    from megatron_glue import models  # imports Megatron (seconds), so only when a test asks for it

    adapt(("cpu", "compile"))
    models.init_single_process()
    yield
    models.teardown_single_process()


@pytest.fixture
def fresh_dynamo():
    """Dynamo caches cleared before and after: every test compiles its own model, and GPTModel.forward
    compiled for many models in one process would otherwise run into the recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@contextlib.contextmanager
def adaptations_reverted(*names: str):
    """Run a block with the named adaptations taken off (to show each is needed), then put them back."""
    was_applied = [n for n in names if n in registry.applied()]
    registry.revert(*was_applied)
    try:
        yield
    finally:
        registry.apply(*was_applied)
