"""The training job restarted on its compile cache: every rank loads its stored compiles (Dynamo captures no graph)
and trains bitwise as the first run did, at TP=2 where each layer holds its tensor-parallel process group.
Evaluation is left out: its compiles come after a training step, when Dynamo's guard state reaches the optimizer's
state, which torch cannot load back (npu_compile/precompile.py, ``_Artifacts.store``); they compile as before."""

import json

import pytest

from pretrain_runs import pretrain

pytestmark = pytest.mark.training


def test_restarted_job_traces_nothing_and_trains_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("NPU_COMPILE_CACHE_DIR", str(tmp_path / "cache"))
    flags = ("--tensor-model-parallel-size", "2", "--train-iters", "3", "--eval-iters", "0")
    cold = pretrain(tmp_path / "cold", *flags, nproc=2).check()
    stored = sorted(p.name for p in (tmp_path / "cache" / "precompiled").rglob("*"))
    warm = pretrain(tmp_path / "warm", *flags, nproc=2).check()
    assert not list((tmp_path / "cache" / "precompiled").rglob("fallback.txt")), stored
    assert sorted(p.name for p in (tmp_path / "cache" / "precompiled").rglob("*")) == stored  # nothing new
    (cold_end,), (warm_end,) = cold.rows("end"), warm.rows("end")
    assert cold_end["graphs"] > 0 and warm_end["graphs"] == 0, (cold_end, warm_end)
    a = [{k: r.get(k) for k in ("lm loss", "grad norm")} for r in cold.rows("train")]
    b = [{k: r.get(k) for k in ("lm loss", "grad norm")} for r in warm.rows("train")]
    assert len(a) == 3 and a == b, json.dumps([a, b])
