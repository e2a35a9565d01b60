"""A rank that is gone ends the others within the watchdog's seconds, with an error that names it.

Two ranks as plain processes of this test (not run_on_ranks, which would end the survivor itself, nor torchrun,
whose agent does): rank 1 goes away in the middle of a step, rank 0 is in a collective waiting for it.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from megatron_glue.capture.distributed import watch_ranks, watchdog_seconds

WATCHDOG_S = 4  # $NPU_COMPILE_RANK_WATCHDOG_S of the ranks
SLACK_S = 6  # beyond it: the watchdog's polling and grace, a loaded 2-core machine


# -- runs in each rank's process ------------------------------------------------------------------------------

def _compiled_tp2_step(how, store):
    """adapt(), a process group and Megatron's TP=2 state as a user sets them up, the watchdog; one compiled
    TP=2 + SP training step, then a second in which rank 1 goes (`how`: "exit" or "stop") after its forward,
    while rank 0's backward all-gathers and reduce-scatters with it."""
    import json
    import warnings

    import torch
    import torch.distributed as dist

    import megatron_glue

    warnings.filterwarnings("ignore")
    rank = int(os.environ["RANK"])
    megatron_glue.adapt()  # first, here; test_tensor_parallel.py calls it after the parallel state
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    with megatron_glue.quiet_megatron():
        from megatron.core import parallel_state, tensor_parallel

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    watch_ranks()

    from megatron_glue.capture.models import build_gpt_model, gpt_config, synthetic_batch, train_step
    from npu_compile.debug.report import collect

    model = build_gpt_model(gpt_config(num_layers=1, hidden_size=64, tensor_model_parallel_size=2,
                                       sequence_parallel=True), 128, 32)
    compiled = torch.compile(model, backend="ascend", options={"target": "reference"})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with collect() as reports:
        train_step(compiled, synthetic_batch(2, 32, 128, seed=0), optimizer)
    counters = torch._dynamo.utils.counters
    print("STEP1", json.dumps(dict(graphs=counters["stats"]["unique_graphs"],
                                   breaks=sum(counters["graph_break"].values()),
                                   fusions={k: v for r in reports for k, v in r.fusions.items() if v})), flush=True)
    loss = compiled(**synthetic_batch(2, 32, 128, seed=1)).mean()
    if rank == 1:
        print("GOING", os.getpid(), time.time(), flush=True)
        if how == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, its sockets open, silent
    loss.backward()
    print("rank 0 ran its backward without rank 1", flush=True)


def _init_distributed_all_reduce(how, store):
    """megatron_glue's own set-up, the watchdog's seconds as its argument (the environment says 0: off); rank 1
    goes between two all-reduces over Megatron's TP group."""
    import torch
    import torch.distributed as dist

    from megatron_glue.capture.distributed import init_distributed

    rank = int(os.environ["RANK"])
    init_distributed(2, rank=rank, world_size=2, store=dist.FileStore(store, 2), rank_watchdog_s=WATCHDOG_S)
    from megatron.core import parallel_state

    x = torch.ones(8)
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    print("STEP1 {}", flush=True)
    if rank == 1:
        print("GOING", os.getpid(), time.time(), flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(x, group=parallel_state.get_tensor_model_parallel_group())
    print("rank 0 all-reduced without rank 1", flush=True)


def _eager_all_reduce(how, store):
    """Without Megatron: rank 1 goes between two all-reduces of a plain gloo group ("leave": rank 1 ends
    normally and rank 0 works on alone, with no collective, for twice the watchdog's seconds)."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    watch_ranks()
    x = torch.ones(8)
    dist.all_reduce(x)
    print("STEP1 {}", flush=True)
    if rank == 1:
        print("GOING", os.getpid(), time.time(), flush=True)
        if how == "leave":
            return  # the interpreter ends as a program does, without destroying the process group
        if how == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGSTOP)
    if how == "leave":
        time.sleep(2 * float(os.environ["NPU_COMPILE_RANK_WATCHDOG_S"]))
        print("rank 0 finished alone", flush=True)
        return
    dist.all_reduce(x)
    print("rank 0 all-reduced without rank 1", flush=True)


# -- the tests ------------------------------------------------------------------------------------------------

def _run_pair(job, how, watchdog=WATCHDOG_S, bound=None, start_timeout=300, env_watchdog=None):
    """Start the 2 ranks of `job`; return (rank 0's exit code, its stdout, its stderr, rank 1's pid, seconds
    from rank 1 going to rank 0 ending). Rank 0 gets `bound` seconds after rank 1 went; both are killed after."""
    bound = watchdog + SLACK_S if bound is None else bound
    with tempfile.TemporaryDirectory(prefix="rank_failure_") as tmp:
        env = dict(os.environ, WORLD_SIZE="2", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                   NPU_COMPILE_RANK_WATCHDOG_S=str(watchdog if env_watchdog is None else env_watchdog),
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        code = ("import sys; from megatron_glue.capture.distributed import _find; "
                "_find('test_rank_failure', sys.argv[2], sys.argv[1])(sys.argv[3], sys.argv[4])")
        logs = [(f"{tmp}/out{r}", f"{tmp}/err{r}") for r in range(2)]
        ranks = [subprocess.Popen([sys.executable, "-c", code, __file__, job.__name__, how, f"{tmp}/store"],
                                  env=dict(env, RANK=str(r)), stdout=open(logs[r][0], "w"),
                                  stderr=open(logs[r][1], "w")) for r in range(2)]
        read = lambda path: open(path).read()  # noqa: E731
        try:
            deadline = time.monotonic() + start_timeout
            while not (going := re.search(r"^GOING (\d+) (\S+)$", read(logs[1][0]), re.M)):
                if ranks[1].poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"rank 1 did not reach the point where it goes:\n{read(logs[1][1])[-3000:]}")
                time.sleep(0.1)
            pid, went = int(going[1]), float(going[2])
            try:
                ranks[0].wait(timeout=max(0.0, bound - (time.time() - went)))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank 0 still waited for rank 1 {bound} s after it went:\n"
                                     f"{read(logs[0][1])[-3000:]}") from None
            return ranks[0].returncode, read(logs[0][0]), read(logs[0][1]), pid, time.time() - went
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()  # a stopped process too
                p.wait()


@pytest.mark.gloo
def test_a_compiled_tp2_step_ends_when_a_rank_exits_mid_step():
    code, out, err, pid, seconds = _run_pair(_compiled_tp2_step, "exit")
    # the step before: one graph, no break, the fusions of one process (adapt() before the parallel state), the
    # vocab-parallel loss among them
    assert re.search(r'STEP1 \{"graphs": 1, "breaks": 0, "fusions": \{"attention": 1, "add_layer_norm": 2, '
                     r'"bias_gelu": 1, "vocab_parallel_cross_entropy": 1\}\}', out), out
    assert code != 0 and seconds <= WATCHDOG_S + SLACK_S, (code, seconds)
    # gloo's own error (the closed socket), then the one naming the rank
    assert f"RankLostError: rank 1 (pid {pid}) is gone: its process has exited" in err, err[-3000:]
    assert "rank 0 ran its backward" not in out


@pytest.mark.gloo
def test_a_stopped_rank_ends_the_other_within_the_watchdogs_seconds():
    # A stopped (or hung, or cut-off) rank keeps its sockets open: gloo alone would wait out the process
    # group's timeout (30 minutes here). Its heartbeat stops: the watchdog ends rank 0 after WATCHDOG_S.
    # Set up by init_distributed, whose rank_watchdog_s wins over the environment's 0.
    code, out, err, pid, seconds = _run_pair(_init_distributed_all_reduce, "stop", env_watchdog=0)
    assert code != 0 and WATCHDOG_S <= seconds <= WATCHDOG_S + SLACK_S, (code, seconds)
    assert re.search(rf"\[rank 0\] RankLostError: rank 1 \(pid {pid}\) is gone: no heartbeat for \d+\.\d s "
                     rf"\(stopped, hung, or its host is unreachable\) \(found by rank 0\); ending rank 0 rather "
                     rf"than wait for it in a collective \(the rank watchdog's {WATCHDOG_S} s, "
                     rf"\$NPU_COMPILE_RANK_WATCHDOG_S\)", err), err
    assert "all-reduced without rank 1" not in out


@pytest.mark.gloo
@pytest.mark.any_megatron_line  # a plain gloo group and the watchdog, no megatron-core
def test_a_rank_that_ends_normally_is_not_reported():
    code, out, err, pid, seconds = _run_pair(_eager_all_reduce, "leave", watchdog=2, bound=4 + SLACK_S)
    assert code == 0 and "rank 0 finished alone" in out, err[-3000:]
    assert "RankLostError" not in err


@pytest.mark.parametrize("value, message", [
    ("soon", "NPU_COMPILE_RANK_WATCHDOG_S='soon' is not a number of seconds; give e.g. 30, or 0 to turn the "
             "rank watchdog off"),
    ("-1", "NPU_COMPILE_RANK_WATCHDOG_S='-1' must be a finite number of seconds >= 0 (0 turns the rank "
           "watchdog off)"),
    ("nan", "NPU_COMPILE_RANK_WATCHDOG_S='nan' must be a finite number of seconds >= 0 (0 turns the rank "
            "watchdog off)"),
])
def test_a_bad_watchdog_setting_is_refused(monkeypatch, value, message):
    monkeypatch.setenv("NPU_COMPILE_RANK_WATCHDOG_S", value)
    with pytest.raises(ValueError) as error:
        watchdog_seconds()
    assert str(error.value) == message


def test_watchdog_seconds(monkeypatch):
    monkeypatch.delenv("NPU_COMPILE_RANK_WATCHDOG_S", raising=False)
    assert watchdog_seconds() == 60.0
    assert watchdog_seconds(2.5) == 2.5
    monkeypatch.setenv("NPU_COMPILE_RANK_WATCHDOG_S", "7")
    assert watchdog_seconds() == 7.0 and watchdog_seconds(0) == 0.0  # the argument wins
    with pytest.raises(ValueError, match=r"^rank_watchdog_s=-3 must be a finite number"):
        watchdog_seconds(-3)


def test_the_training_job_takes_the_watchdogs_seconds_from_the_environment(monkeypatch):
    from megatron_glue.training.arguments import ArgumentError, parse_args
    from megatron_glue.training.device import placement
    from pretrain_runs import TINY

    args = parse_args([*TINY, "--train-iters", "1"])
    monkeypatch.setenv("NPU_COMPILE_RANK_WATCHDOG_S", "12.5")
    assert placement(args).rank_watchdog_s == 12.5
    monkeypatch.setenv("NPU_COMPILE_RANK_WATCHDOG_S", "1m")
    with pytest.raises(ArgumentError) as error:
        placement(args)
    assert error.value.message == ("pretrain_gpt: error: NPU_COMPILE_RANK_WATCHDOG_S='1m' is not a number of "
                                   "seconds; give e.g. 30, or 0 to turn the rank watchdog off")
