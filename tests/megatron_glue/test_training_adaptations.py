"""The "training" adaptations: source edits that must match megatron-core's text, each one needed."""

from __future__ import annotations

import pytest
import torch

import megatron_glue.capture.training_adaptations as ta
from megatron_glue.capture import adapt
from megatron_glue.capture.adaptations import megatron_core_in, registry
from megatron_glue.capture.testing import adaptations_reverted


class _Base:
    def __init__(self, x):
        self.x = x


class _Child(_Base):
    def __init__(self, x):
        super().__init__(x)
        self.where = torch.zeros(1, device='meta').device.type


def _literal():
    return torch.zeros(2, device="meta").device.type


def test_source_edit_substitutes_and_keeps_super():
    edited = ta.source_edit(_literal, [(('device="meta"', "device='meta'"), "device='cpu'")], "here")
    assert _literal() == "meta" and edited() == "cpu"
    init = ta.source_edit(_Child.__init__, [("device='meta'", "device='cpu'")], "here")
    child = _Child.__new__(_Child)
    init(child, 3)  # zero-argument super() spelled out: it still reaches _Base.__init__
    assert (child.x, child.where) == (3, "cpu")


def test_source_edit_that_no_longer_matches_fails_loudly():
    with pytest.raises(RuntimeError) as info:
        ta.source_edit(_literal, [("device='cuda'", "device='cpu'")], "tests._literal")
    assert str(info.value) == ("adaptation of tests._literal: \"device='cuda'\" is no longer in its source; this "
                               "megatron-core release needs the adaptation revised")


@pytest.fixture
def training_group():
    """The job's adaptation groups applied for the test, and what it added taken off after."""
    before = set(registry.applied())
    yield adapt(("cpu", "compile", "sp", "training"))
    registry.revert(*[name for name in registry.applied() if name not in before])


def test_every_training_adaptation_applies_on_this_line(training_group):
    applied = training_group
    assert set(registry.known("training")) <= set(applied)
    assert registry.known("training")  # and there are some


def test_grad_scaler_needs_its_edit(training_group):
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    kwargs = dict(initial_scale=2.0 ** 16, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                  growth_interval=1000, hysteresis=2)
    scaler = DynamicGradScaler(**kwargs)
    scaler.update(found_inf=True)
    scaler.update(found_inf=True)  # hysteresis 2: the second overflow halves the scale
    assert scaler.scale.item() == 2.0 ** 15 and scaler.scale.device.type == "cpu"
    with adaptations_reverted("grad_scaler_on_device", "dynamic_grad_scaler_on_device"):
        with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
            DynamicGradScaler(**kwargs)


@pytest.mark.skipif(not megatron_core_in(">=0.15"), reason="before 0.15 a synchronous save writes in a forked "
                    "process (dist_checkpointing/strategies/base.py, AsyncSaveShardedStrategy.save), which needs "
                    "megatron-core's cross-process queue")
def test_a_checkpoint_save_starts_no_results_process(training_group, tmp_path):
    """megatron-core's writer returns its results through a multiprocessing Manager's queue, a process it spawns at
    the first save (the job's main module imported again) and keeps for the rest of the job; the job saves
    synchronously, in the saving process, so an in-process queue holds them. A save and load round trip, and no
    process left."""
    import multiprocessing

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_glue.capture import models

    models.init_single_process()
    weight = torch.arange(12.0).reshape(3, 4)
    sharded = {"w": dist_checkpointing.ShardedTensor.from_rank_offsets("w", weight, replica_id=0)}
    before = {p.pid for p in multiprocessing.active_children()}
    dist_checkpointing.save(sharded, str(tmp_path))
    assert {p.pid for p in multiprocessing.active_children()} == before
    assert isinstance(filesystem_async._get_write_results_queue(), ta._InProcessResultsQueue)
    template = {"w": dist_checkpointing.ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)}
    assert torch.equal(dist_checkpointing.load(template, str(tmp_path))["w"], weight)
    with pytest.raises(TypeError) as info:
        multiprocessing.get_context("spawn").Process(target=print, args=(ta._WRITE_RESULTS,)).start()
    assert str(info.value) == (
        "the checkpoint writer's results queue is in-process (adaptation 'checkpoint_write_results_in_process'): an "
        "asynchronous save, whose writer runs in another process, needs megatron-core's own queue; revert that "
        "adaptation to save asynchronously")
