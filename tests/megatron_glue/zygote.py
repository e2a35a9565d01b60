"""A launcher for the job's tests that starts each rank by forking an interpreter that has already imported what the
job imports (torch, megatron-core, npu_compile, megatron_glue), instead of starting `python -m torch.distributed.run`
and a fresh interpreter per rank.

Measured on this machine, a tiny job's wall time is mostly imports (torch, megatron-core's modules, whose fusions call
torch.compile at import, and the backend): a 3-iteration eager run spent 93% of its time importing. Each test launch
pays that once per rank plus once for torchrun's own process; forked ranks pay none of it. What runs after the fork is
the job as `python -m megatron_glue.pretrain_gpt` runs it (`runpy.run_module` as `__main__`, the test's argv, cwd and
environment, RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT set as torchrun sets them),
and a rank that fails stops the others, as torchrun does. Tests that are about the launch itself (the seed script,
MindSpeed-LLM's scripts, rank failures) keep torchrun (`pretrain(..., launcher="torchrun")`).

The server (`python tests/megatron_glue/zygote.py`) reads one JSON request per line on stdin and answers one JSON
line on stdout: {"returncode": int}. It never runs a job itself, so every fork starts from the same imported state;
nothing it imports starts a thread (checked at start: a forked child has only the thread that forked it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

PRELOAD = ("torch", "torch._dynamo", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
           "megatron.core.pipeline_parallel", "megatron.core.datasets.gpt_dataset", "megatron.core.distributed",
           "megatron.core.dist_checkpointing", "npu_compile", "megatron_glue.training.gpt",
           "megatron_glue.training.training", "megatron_glue.pretrain_gpt", "megatron_glue.posttrain_gpt",
           "matplotlib.pyplot")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(request: dict, rank: int, port: int) -> int:
    """In the forked rank: its stdio, cwd, environment and argv, then the module as `python -m` runs it."""
    import runpy
    import traceback

    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # `python -m` puts the working directory first on the path
    env = dict(request["env"])
    if request["nproc"] > 1:  # as torchrun --standalone sets them; one process is a plain `python -m`
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(request["nproc"]),
                   LOCAL_WORLD_SIZE=str(request["nproc"]), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            return 1
        return code
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _serve(request: dict) -> int | tuple[str, int]:
    """Fork the ranks; wait for them. Returns the job's return code, or ("child", code) inside a forked rank."""
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            return "child", _child(request, rank, port)
        pids[pid] = rank
    deadline = time.monotonic() + request["timeout"]
    returncode = 0
    stopping_at = None
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.monotonic()
            if now > deadline and stopping_at is None:
                returncode = returncode or -signal.SIGKILL
                stopping_at = now
                for other in pids:
                    os.kill(other, signal.SIGKILL)
            elif stopping_at is not None and now - stopping_at > 30:
                for other in pids:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.05)
            continue
        pids.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and stopping_at is None:  # torchrun: one rank failed, the others are stopped, the run fails
            returncode = 1 if request["nproc"] > 1 else code
            stopping_at = time.monotonic()
            for other in pids:
                os.kill(other, signal.SIGTERM)
    return returncode


def main() -> int:
    # The job's end draws its loss curve with matplotlib's Agg backend (megatron_glue/training/log.py); importing
    # pyplot took 1.2 of a 6.8 s eager launch's seconds (a machine at load 25). Chosen here as the job chooses it,
    # before pyplot's import resolves a backend.
    import matplotlib

    matplotlib.use("Agg")
    for name in PRELOAD:
        __import__(name)
    if threading.active_count() != 1:
        names = [t.name for t in threading.enumerate()]
        print(json.dumps({"error": f"threads started by the imports, unsafe to fork: {names}"}), flush=True)
        return 1
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        result = _serve(json.loads(line))
        if isinstance(result, tuple):  # a forked rank: leave the server's loop and exit as `python -m` would
            sys.stdout.flush()
            return result[1]
        print(json.dumps({"returncode": result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
