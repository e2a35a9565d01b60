"""The job's checkpoint settings, checked at the argument check (in process, no job run): a job that could not
save is refused before it trains, never at its first save."""

from __future__ import annotations

import pytest

from megatron_glue.training.arguments import ArgumentError, parse_args
from pretrain_runs import TINY

BASE = [*TINY, "--train-iters", "4", "--save-interval", "2"]


def test_save_into_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"")
    with pytest.raises(ArgumentError) as e:
        parse_args([*BASE, "--save", str(tmp_path / "ckpt.pt")])
    assert str(e.value) == (f"pretrain_gpt: error: --save {tmp_path}/ckpt.pt is a file; --save names the folder the "
                            "checkpoints go in")
    with pytest.raises(ArgumentError) as e:
        parse_args([*BASE, "--save", str(tmp_path / "ckpt.pt" / "run1")])
    assert str(e.value) == (f"pretrain_gpt: error: --save {tmp_path}/ckpt.pt/run1 lies under {tmp_path}/ckpt.pt, "
                            "which is a file; give a folder path")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_distributed_optimizer_saves_in_either_format(fmt, tmp_path):
    """--ckpt-format torch with --use-distributed-optimizer (MindSpeed-LLM's scripts) passes: it saves
    (test_pretrain_checkpoints.py runs it); a folder that does not exist yet is made at the first save."""
    args = parse_args([*BASE, "--use-distributed-optimizer", "--ckpt-format", fmt,
                       "--save", str(tmp_path / "new" / "ckpt")], world_size=2)
    assert (args.ckpt_format, args.use_distributed_optimizer, args.data_parallel_size) == (fmt, True, 2)
    assert not (tmp_path / "new").exists()
