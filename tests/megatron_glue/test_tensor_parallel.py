"""megatron-core at tensor-parallel size 2, with and without sequence parallelism, on 2 gloo processes, compiled
with backend="ascend": one graph and no break per rank, the fusions of one process, collectives in it as
`_c10d_functional` ops, and training equal to TP=1 eager.

The ranks are set up as a Megatron user sets them up under torchrun, with nothing of megatron_glue but
`adapt()`, called last: `init_process_group("gloo")` from the environment, `initialize_model_parallel(2)`,
`megatron_glue.adapt()`, `model_parallel_cuda_manual_seed`.

All cases run inside one launch of 2 processes (a launch costs tens of seconds of start-up on 2 cores); the
tests below only read its results. The TP=1 reference runs in this pytest process.
"""

import collections
import pathlib
import re
import socket
import tempfile
import time

import pytest
import torch

from megatron_glue.capture.distributed import run_on_ranks

pytestmark = [
    pytest.mark.gloo,
    # Dynamo traces through RotaryEmbedding.forward's lru_cache and says so; tracing it is exact.
    pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`"),
]

VOCAB, SEQ, BATCH, HIDDEN, STEPS = 128, 32, 2, 64, 3
KINDS = ("gpt", "llama")
CASES = [(kind, sp) for kind in KINDS for sp in (False, True)]
OPTIONS = {"target": "reference", "overlap": True}

# Collectives Dynamo captures per model (2 layers), by kind, in the forward and in the backward graph, as the
# partitioned graphs hold them (vocab-parallel cross-entropy's 3 all-reduces are inside its fused op by then):
#   TP:  forward: embedding all-reduce, 2 RowParallel all-reduces per layer;
#        backward: the dgrad all-reduce of each ColumnParallel linear (qkv and fc1 per layer, output layer).
#   SP:  forward: the embedding's all-reduce + split (GPT, learned positions) or reduce-scatter (Llama), an
#        all-gather before each ColumnParallel linear (qkv, fc1 per layer, output layer), a reduce-scatter
#        after each RowParallel one (proj, fc2 per layer); backward: the
#        transposes (reduce-scatter for each all-gather, all-gather for each reduce-scatter or split). The
#        ColumnParallel backward gathers its input again for the weight grad, the same all-gather as the
#        forward's: aot_autograd's CSE keeps one.
EXPECTED_CAPTURED = {
    ("gpt", False): ({"all_reduce": 5}, {"all_reduce": 5}),
    ("llama", False): ({"all_reduce": 5}, {"all_reduce": 5}),
    ("gpt", True): ({"all_reduce": 1, "all_gather_into_tensor": 5, "reduce_scatter_tensor": 4},
                    {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5}),
    ("llama", True): ({"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5},
                      {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5}),
}
# The fusions of each model at TP=2, with or without SP: every norm, activation and (Llama) rotary site of the
# 2 layers, as in one process, and the loss with the output layer (its 3 all-reduces inside the fused op). GPT's attention is left unfused at TP=2: each rank holds one query group of the
# two (num_query_groups=2), and the attention rule matches no GPT attention with a single group; report.json
# says so for both softmaxes (checked below).
EXPECTED_FUSIONS = {
    "gpt": {"attention": 2, "add_layer_norm": 4, "bias_gelu": 2, "vocab_parallel_cross_entropy": 1},
    "llama": {"attention": 2, "add_rms_norm": 4, "rms_norm": 1, "swiglu": 2, "rotary": 4,
              "vocab_parallel_cross_entropy": 1},
}


def _config(kind, tp, sp):
    from megatron_glue.capture.models import gpt_config, llama_config

    make = gpt_config if kind == "gpt" else llama_config
    return make(hidden_size=HIDDEN, num_query_groups=2, tensor_model_parallel_size=tp, sequence_parallel=sp)


def _train(model, steps=STEPS):
    """[(loss, {name: full grad}), ...] over `steps` SGD steps; grads gathered to their TP=1 shape."""
    from megatron_glue.capture.distributed import full_grads
    from megatron_glue.capture.models import synthetic_batch, train_step

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(steps):
        loss = train_step(model, synthetic_batch(BATCH, SEQ, VOCAB, seed=step), optimizer)
        history.append((loss, full_grads(model)))
    return history


# -- runs on each of the 2 ranks ----------------------------------------------------------------------------

def _captured_collectives(graph_dir):
    """{collective: count} in the first dumped stage of a graph, as aot_autograd handed it to the backend."""
    first = sorted(graph_dir.glob("*.py"))[0]
    found = re.findall(r"torch\.ops\._c10d_functional\.(\w+)\.default\(", first.read_text())
    return dict(collections.Counter(op for op in found if op != "wait_tensor"))


def _compiled_case(kind, sp):
    from megatron_glue.capture.models import build_gpt_model
    from npu_compile.debug.report import collect

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build_gpt_model(_config(kind, 2, sp), VOCAB, SEQ, seed=0)
    with tempfile.TemporaryDirectory() as dump, collect() as reports:
        history = _train(torch.compile(model, backend="ascend", options=dict(OPTIONS, dump_dir=dump)))
        (graph_dir,) = pathlib.Path(dump).iterdir()  # <dump_dir>/<graph id>/, one graph
        captured = tuple(_captured_collectives(graph_dir / graph) for graph in ("forward", "backward"))
    counters = torch._dynamo.utils.counters
    return dict(
        history=history,
        unique_graphs=counters["stats"]["unique_graphs"],
        dynamo_breaks=sum(counters["graph_break"].values()),
        reports=[r.to_json() for r in reports],
        captured=captured,
    )


def _eager_case(kind, sp):
    from megatron_glue.capture.models import build_gpt_model

    return _train(build_gpt_model(_config(kind, 2, sp), VOCAB, SEQ, seed=0))


def _without(names, kind, sp):
    """Dynamo's explain of a forward with the named adaptations taken off: (graphs, breaks, reasons), each reason
    with the file:line of the Megatron frame nearest to its break ("" when none)."""
    from megatron.core.tensor_parallel import layers

    from megatron_glue.capture.models import build_gpt_model, synthetic_batch
    from megatron_glue.capture.testing import adaptations_reverted

    torch._dynamo.reset()
    model = build_gpt_model(_config(kind, 2, sp), VOCAB, SEQ, seed=0)
    with adaptations_reverted(*names):
        if "no_cuda_max_connections_warning" in names:
            # The flag is state: Megatron sets it once it has warned (an earlier run here did), so put it back as
            # a fresh process has it.
            layers.linear_with_grad_accumulation_and_async_allreduce.warned = False
        explanation = torch._dynamo.explain(model)(**synthetic_batch(BATCH, SEQ, VOCAB))
    torch._dynamo.reset()
    reasons = []
    for reason in explanation.break_reasons:
        megatron_frames = [f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno}" for f in reason.user_stack
                           if "/megatron/core/" in f.filename]
        reasons.append((reason.reason, megatron_frames[-1] if megatron_frames else ""))
    return explanation.graph_count, explanation.graph_break_count, reasons


def _error_without(name, kind):
    """The error an SP model meets without adaptation `name` (building it, or its first forward), or None."""
    from megatron_glue.capture.models import build_gpt_model, synthetic_batch
    from megatron_glue.capture.testing import adaptations_reverted

    with adaptations_reverted(name):
        try:
            build_gpt_model(_config(kind, 2, True), VOCAB, SEQ)(**synthetic_batch(BATCH, SEQ, VOCAB))
        except Exception as e:  # noqa: BLE001 - the error is the result
            return f"{type(e).__name__}: {e}"
    return None


def _error_with_cached_buffer():
    """SP compiled with Megatron's own (cached) GlobalMemoryBuffer: the error of its second step, or None."""
    from megatron_glue.capture.models import build_gpt_model, synthetic_batch, train_step
    from megatron_glue.capture.testing import adaptations_reverted

    torch._dynamo.reset()
    model = build_gpt_model(_config("gpt", 2, True), VOCAB, SEQ, seed=0)
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with adaptations_reverted("fresh_global_buffer"):
        try:
            for step in range(2):
                train_step(compiled, synthetic_batch(BATCH, SEQ, VOCAB, seed=step), optimizer)
        except Exception as e:  # noqa: BLE001 - the error is the result
            return f"{type(e).__name__}: {e}"
        finally:
            torch._dynamo.reset()
    return None


def _tp2_worker(cases):
    import warnings

    import torch.distributed as dist

    import megatron_glue
    from megatron_glue.capture import quiet_megatron
    from megatron_glue.capture.adaptations import registry

    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    # A Megatron user's set-up under torchrun ($RANK, $WORLD_SIZE, $MASTER_ADDR, $MASTER_PORT), adapt() last.
    dist.init_process_group("gloo")
    with quiet_megatron():
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    megatron_glue.adapt()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    results, seconds = {}, {}
    for kind, sp in cases:
        start = time.perf_counter()
        results[kind, sp] = dict(compiled=_compiled_case(kind, sp))
        seconds[f"{kind}{'+sp' if sp else ''} compiled"] = time.perf_counter() - start
        start = time.perf_counter()
        results[kind, sp]["eager"] = _eager_case(kind, sp)
        seconds[f"{kind}{'+sp' if sp else ''} eager"] = time.perf_counter() - start
    start = time.perf_counter()
    results["without_tp_compile"] = _without(registry.known("tp_compile"), "gpt", False)
    # One by one too: on 0.12 the warning's break comes first and hides the async collectives' (0.16 shows both).
    async_collectives = [n for n in registry.known("tp_compile") if n.startswith("capturable_async_")]
    results["without_async_collectives"] = _without(async_collectives, "gpt", False)
    results["without_warned_flag"] = _without(["no_cuda_max_connections_warning"], "gpt", False)
    results["sp_errors"] = {name: _error_without(name, "gpt") for name in registry.known("sp")}
    results["sp_errors"]["fresh_global_buffer"] = _error_with_cached_buffer()
    seconds["adaptations taken off"] = time.perf_counter() - start
    results["seconds"] = seconds
    return results


# -- the tests: read the 2 ranks' results -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp2():
    """Both ranks' results for every case; one launch for the whole module."""
    start = time.perf_counter()
    with socket.socket() as s, pytest.MonkeyPatch.context() as env:
        s.bind(("127.0.0.1", 0))  # a free port for rank 0's TCPStore, as torchrun would pick it
        env.setenv("MASTER_ADDR", "127.0.0.1")
        env.setenv("MASTER_PORT", str(s.getsockname()[1]))
        s.close()
        results = run_on_ranks(_tp2_worker, CASES, world_size=2, timeout=600)
    print(f"\n2 ranks: {time.perf_counter() - start:.0f} s in all; rank 0:",
          ", ".join(f"{k} {v:.1f} s" for k, v in results[0]["seconds"].items()))
    return results


@pytest.fixture(scope="module")
def tp1(megatron_cpu):
    """TP=1 eager training of each kind, in this process."""
    from megatron_glue.capture.models import build_gpt_model

    return {kind: _train(build_gpt_model(_config(kind, 1, False), VOCAB, SEQ, seed=0)) for kind in KINDS}


@pytest.mark.parametrize("kind, sp", CASES)
def test_compiled_tp2_is_one_graph_with_its_fusions_and_functional_collectives(tp2, kind, sp):
    for rank, results in enumerate(tp2):
        compiled = results[kind, sp]["compiled"]
        assert compiled["unique_graphs"] == 1 and compiled["dynamo_breaks"] == 0, f"rank {rank}"
        (report,) = compiled["reports"]
        assert report["graph_breaks"] == 0 and report["graphs"] == ["forward", "backward"], f"rank {rank}"
        assert {k: v for k, v in report["fusions"].items() if v} == EXPECTED_FUSIONS[kind], f"rank {rank}"
        unfused = [(u["op"], u["rule"]) for u in report["unfused"]]
        assert unfused == [], unfused
        assert compiled["captured"] == EXPECTED_CAPTURED[kind, sp], f"rank {rank}"
        # After the backend's stages (overlap scheduling may bucket some together): still functional collectives
        # of the captured kinds, each with its wait_tensor in the graph.
        ops = report["lowered_ops"]
        after = {op.removeprefix("_c10d_functional."): n for op, n in ops.items()
                 if op.startswith("_c10d_functional.") and op != "_c10d_functional.wait_tensor"}
        captured_kinds = set(EXPECTED_CAPTURED[kind, sp][0]) | set(EXPECTED_CAPTURED[kind, sp][1])
        assert set(after) == captured_kinds, f"rank {rank}: {after}"
        assert 0 < report["comm"]["collectives"] == sum(after.values()) <= sum(
            sum(c.values()) for c in EXPECTED_CAPTURED[kind, sp])
        assert ops["_c10d_functional.wait_tensor"] == sum(after.values()), f"rank {rank}"


@pytest.mark.parametrize("kind, sp", CASES)
def test_compiled_tp2_training_equals_tp1_eager(tp2, tp1, kind, sp):
    for rank, results in enumerate(tp2):
        for mode in ("compiled", "eager"):
            history = results[kind, sp][mode]
            history = history["history"] if mode == "compiled" else history
            for step, ((loss, grads), (loss1, grads1)) in enumerate(zip(history, tp1[kind], strict=True)):
                where = f"rank {rank}, {mode}, step {step}"
                assert abs(loss - loss1) <= 1e-6, f"{where}: loss {loss} vs TP=1 {loss1}"
                assert grads.keys() == grads1.keys(), where
                for name, g1 in grads1.items():
                    # Relative to the grad's scale: TP splits the reductions inside matmuls differently.
                    error = (grads[name] - g1).abs().max() / g1.abs().max().clamp_min(1e-12)
                    assert error <= 1e-5, f"{where}: grad of {name} off by {error:.2e} relative"


def test_without_tp_compile_megatron_breaks_the_graph(tp2):
    graphs, breaks, _ = tp2[0]["without_tp_compile"]
    assert breaks > 0 and graphs > 1


def test_without_tp_compile_async_collectives_break_the_graph(tp2):
    graphs, breaks, reasons = tp2[0]["without_async_collectives"]
    assert breaks > 0 and graphs > 1
    # Megatron's linear backward, traced with the forward (tensor_parallel/layers.py:544; 0.12.1: :489).
    assert any("async_op=True" in r and where.startswith("megatron/core/tensor_parallel/layers.py:")
               for r, where in reasons), reasons


def test_without_the_warned_flag_the_max_connections_warning_breaks_the_graph(tp2):
    graphs, breaks, reasons = tp2[0]["without_warned_flag"]
    assert breaks > 0 and graphs > 1
    # warnings.warn in linear_with_grad_accumulation_and_async_allreduce (tensor_parallel/layers.py:728-741;
    # 0.12.1: :651-664)
    assert any(where.startswith("megatron/core/tensor_parallel/layers.py:") for _, where in reasons), reasons


@pytest.mark.parametrize("name, expected", [
    ("sequence_parallel_torch_norm", "sequence parallel not supported by torch LayerNorm"),
    ("current_device_stand_in", "Torch not compiled with CUDA enabled"),
    ("fresh_global_buffer", "Trying to backward through the graph a second time"),  # a "cpu" one SP relies on
])
def test_each_sp_adaptation_is_needed(tp2, name, expected):
    # Each taken off in turn on the GPT + SP model: building it, or training it, fails the way its reason says.
    error = tp2[0]["sp_errors"][name]
    assert error is not None and expected in error, error
