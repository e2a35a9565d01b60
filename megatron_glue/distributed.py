"""Megatron-core on several processes: set-up of a worker, a launcher for tests, and the tensor-parallel grad
work that Megatron's DDP would otherwise do.

A worker calls `init_distributed(tp, sp)` (gloo; rank and world size from the arguments or torchrun's
environment). Tests start workers with `run_on_ranks(fn, ...)`: one fresh Python process per rank, a FileStore
rendezvous (no port to pick), each rank's return value handed back, and every process killed on the first
failure or at the timeout.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_glue import adapt, quiet_megatron


def adaptation_groups(tp: int, sp: bool) -> tuple[str, ...]:
    """The adaptation groups a CPU worker needs at tensor-parallel size `tp`, with or without SP."""
    return ("cpu", "compile") + (("tp_compile",) if tp > 1 else ()) + (("sp",) if sp else ())


def init_distributed(tp: int, sp: bool = False, rank: int | None = None, world_size: int | None = None,
                     store: dist.Store | None = None, groups: Sequence[str] | None = None,
                     **model_parallel: Any) -> None:
    """In a worker: apply the adaptations (`groups`, default `adaptation_groups(tp, sp)`), join the gloo process
    group (rank and world size default to $RANK/$WORLD_SIZE, the store to run_on_ranks' FileStore or else
    env://), and set Megatron's model-parallel state to TP=tp, PP=1 (data parallel takes the remaining ranks;
    `model_parallel` goes to Megatron's initialize_model_parallel). SP itself is a model-config switch
    (`sequence_parallel=True`); `sp` here only selects its adaptations. A process group initialised before
    (e.g. a fake one) is kept."""
    adapt(adaptation_groups(tp, sp) if groups is None else groups)
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if store is None and "NPU_COMPILE_STORE" in os.environ:  # started by run_on_ranks
            store = worker_store()
        rank = int(os.environ["RANK"]) if rank is None else rank
        world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    with quiet_megatron():
        parallel_state.initialize_model_parallel(tp, 1, **model_parallel)


# -- what Megatron's DDP / finalize_model_grads would do, for a model without that wrapper ----------------

def allreduce_sequence_parallel_grads(model: torch.nn.Module) -> int:
    """Sum, over the TP group, the grads of params tagged `.sequence_parallel` (norms, RowParallel biases):
    under SP each rank saw only its sequence shard. Megatron does this in finalize_model_grads
    (distributed/finalize_model_grads.py:354), which needs its DDP. Returns how many grads were reduced."""
    from megatron.core import parallel_state

    grads = [p.grad for p in model.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads:  # no SP (nothing is tagged without it)
        return 0
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1:
        return 0
    flat = torch._utils._flatten_dense_tensors(grads)  # one collective for all, as Megatron does
    dist.all_reduce(flat, group=group)
    for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(synced)
    return len(grads)


def gather_tensor_parallel(tensor: torch.Tensor, like: torch.nn.Parameter) -> torch.Tensor:
    """The full (TP=1) tensor from this rank's shard `tensor` of param `like` (its weight or its grad).

    Megatron splits a master weight along `partition_dim` into `world * stride` chunks and gives rank r the
    chunks r, r + world, ... (tensor_parallel/layers.py:179-188; stride 2 for GLU's [gate, up]); this undoes it.
    """
    from megatron.core import parallel_state

    if not getattr(like, "tensor_model_parallel", False):
        return tensor
    group = parallel_state.get_tensor_model_parallel_group()
    world, dim, stride = group.size(), like.partition_dim, like.partition_stride
    shards = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(shards, tensor.contiguous(), group=group)
    chunks = [shard.chunk(stride, dim=dim) for shard in shards]
    return torch.cat([chunks[i % world][i // world] for i in range(world * stride)], dim=dim)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """name -> full (TP=1 shaped) grad of every parameter; names as in the eager model (no `_orig_mod.`)."""
    return {
        name.removeprefix("_orig_mod."): gather_tensor_parallel(p.grad, p)
        for name, p in model.named_parameters()
    }


# -- launcher ----------------------------------------------------------------------------------------------

def run_on_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout: float = 300.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh Python processes and return each rank's result, rank order.

    `fn` must be a module-level function of an importable module or file (not `__main__`); it runs with
    $RANK, $WORLD_SIZE and $NPU_COMPILE_STORE (a FileStore path) set and one CPU thread, and calls
    init_distributed itself. Arguments and results travel by pickle. On the first failing rank the others are
    killed and its traceback is raised; past `timeout` seconds all are killed.
    """
    if fn.__module__ == "__main__":
        raise ValueError(f"run_on_ranks needs {fn.__qualname__} in an importable module, not in __main__")
    with tempfile.TemporaryDirectory(prefix="megatron_glue_ranks_") as tmp:
        with open(os.path.join(tmp, "job.pkl"), "wb") as f:
            pickle.dump(((fn.__module__, fn.__qualname__, inspect.getfile(fn)), args), f)
        env = dict(
            os.environ,
            WORLD_SIZE=str(world_size),
            NPU_COMPILE_STORE=os.path.join(tmp, "store"),
            PYTHONPATH=os.pathsep.join(p for p in sys.path if p),  # what this process can import, the ranks can
            OMP_NUM_THREADS="1",  # the ranks share this host's cores
            TORCHINDUCTOR_COMPILE_THREADS="1",
        )
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host: do not resolve its name
        command = [sys.executable, "-c", "from megatron_glue.distributed import _rank_main; _rank_main()", tmp]
        ranks = [subprocess.Popen(command, env=dict(env, RANK=str(r))) for r in range(world_size)]
        deadline = time.monotonic() + timeout
        try:
            while True:
                codes = [p.poll() for p in ranks]
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                if failed or all(c == 0 for c in codes):
                    break  # all done, or one failed: the others may wait for it for ever
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__qualname__} on {world_size} ranks ran past {timeout:.0f} s")
                time.sleep(0.2)
        finally:
            for p in ranks:
                if p.poll() is None:
                    p.kill()
                p.wait()
        for r in failed:  # the ranks that failed by themselves, not those killed here after
            error = os.path.join(tmp, f"rank{r}.error")
            detail = open(error).read() if os.path.exists(error) else f"exit code {ranks[r].returncode}"
            raise RuntimeError(f"{fn.__qualname__} failed on rank {r} of {world_size}:\n{detail}")
        results = []
        for r in range(world_size):
            with open(os.path.join(tmp, f"rank{r}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results


def worker_store() -> dist.Store:
    """In a run_on_ranks worker: the rendezvous store shared by its ranks."""
    return dist.FileStore(os.environ["NPU_COMPILE_STORE"], int(os.environ["WORLD_SIZE"]))


def _rank_main() -> None:
    """A run_on_ranks process: run the job, leave its result (or traceback) in the job folder."""
    tmp, rank = sys.argv[1], int(os.environ["RANK"])
    torch.set_num_threads(1)
    try:
        with open(os.path.join(tmp, "job.pkl"), "rb") as f:
            where, args = pickle.load(f)
        result = _find(*where)(*args)
        with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        with open(os.path.join(tmp, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _find(module_name: str, qualname: str, path: str) -> Callable[..., Any]:
    """The function `qualname` of the module, imported by name or, failing that (e.g. a pytest file), by path."""
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    target = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target
