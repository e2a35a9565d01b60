"""Where the job runs: the device and the collective backend for `--distributed-backend`.

- `hccl`: Ascend NPU. torch_npu is imported, and its own `transfer_to_npu` maps `cuda` to `npu` across torch
  (device strings, `torch.cuda.*`, `.cuda()`), which is how Ascend's own Megatron ports run CUDA-minded code.
- `nccl`: the machine's accelerator backend, as torch_npu makes it mean: every MindSpeed-LLM script says
  `--distributed-backend nccl`, and on an NPU torch_npu's `transfer_to_npu` turns nccl into hccl
  (Ascend/pytorch `torch_npu/contrib/transfer_to_npu.py`, its `init_process_group` wrapper). So: hccl where
  torch_npu sees an NPU, nccl on CUDA, and on a machine with neither gloo on the CPU, with a log line saying so.
- `gloo`: CPU (how every test here runs).

`init(args)` joins the process group, picks this rank's device and applies the adaptation groups the job needs.
The process group's timeout is Megatron-LM's `--distributed-timeout-minutes`; `HCCL_CONNECT_TIMEOUT` (seconds,
Ascend's variable for building links), when set, bounds it instead, so a rank that never arrives is reported
within the time the user set for HCCL, on any backend. Within it, a rank that is gone (its process exited, or
its heartbeat stopped for $NPU_COMPILE_RANK_WATCHDOG_S seconds, default 60; 0: off) ends the others with
"rank R (pid P) is gone: ..." (`megatron_glue.capture.distributed.watch_ranks`).

Before that, `init` runs `npu-compile doctor`'s check (`doctor.check_at_start`: one line and stop on a combination
known not to work), sets the HCCL variables the job owns on hccl (`hccl.apply`, after the timeout above has read the
user's own) and binds the process to its cores (`affinity.bind`, `--no-bind-cores`); docs/operating.md.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_glue.training.arguments import ArgumentError
from megatron_glue.capture.distributed import watch_ranks, watchdog_seconds


@dataclass(frozen=True)
class Placement:
    backend: str
    device: torch.device
    rank: int
    world_size: int
    local_rank: int
    timeout: datetime.timedelta
    rank_watchdog_s: float = 0.0  # see megatron_glue.capture.distributed.watch_ranks; 0: off


def _torch_npu_missing() -> str | None:
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed"
    try:
        import torch_npu  # noqa: F401

        if not torch.npu.is_available():
            return "torch_npu sees no NPU"
    except Exception as e:  # CANN missing: torch_npu fails at import (libhccl.so, ...)
        return f"torch_npu cannot be imported ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return None


def _accelerator_backend(local_rank: int) -> tuple[str, torch.device]:
    """What `--distributed-backend nccl` means on this machine (see the module docstring)."""
    if _torch_npu_missing() is None:
        return "hccl", torch.device("npu", local_rank)
    if torch.cuda.is_available():
        return "nccl", torch.device("cuda", local_rank)
    if int(os.environ.get("RANK", "0")) == 0:
        print(" --distributed-backend nccl: this machine has no NPU (torch_npu) and no CUDA; running on the CPU with "
              "gloo", flush=True)
    return "gloo", torch.device("cpu")


def process_group_timeout(args) -> datetime.timedelta:
    connect = os.environ.get("HCCL_CONNECT_TIMEOUT")
    if connect:
        try:
            return datetime.timedelta(seconds=int(connect))
        except ValueError:
            raise ArgumentError(f"pretrain_gpt: error: HCCL_CONNECT_TIMEOUT={connect!r} is not a number of seconds")
    return datetime.timedelta(minutes=args.distributed_timeout_minutes)


def placement(args) -> Placement:
    """Check the backend against the machine; one-line error naming the fix when they do not fit."""
    backend = args.distributed_backend
    # torchrun sets $LOCAL_RANK; older launchers pass --local-rank instead
    local_rank = args.local_rank if args.local_rank is not None else int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "hccl":
        missing = _torch_npu_missing()
        if missing:
            raise ArgumentError(
                f"pretrain_gpt: error: --distributed-backend hccl needs torch_npu and an Ascend NPU, but {missing}; "
                "install Ascend CANN and `pip install torch-npu==2.13.0` (the npu extra), or on CPU use "
                "--distributed-backend gloo")
        device = torch.device("npu", local_rank)
    elif backend == "nccl":
        backend, device = _accelerator_backend(local_rank)
    else:
        device = torch.device("cpu")
    try:
        watchdog = watchdog_seconds()
    except ValueError as e:
        raise ArgumentError(f"pretrain_gpt: error: {e}") from None
    return Placement(backend, device, int(os.environ.get("RANK", "0")), args.world_size, local_rank,
                     process_group_timeout(args), watchdog)


def prepare_process(args, where: Placement) -> list[str]:
    """The HCCL variables the job owns (hccl only; rank 0 logs them) and this process's cores (every rank logs its
    own line). Returns the log lines."""
    from megatron_glue.training import affinity, hccl

    lines = []
    if where.backend == "hccl":
        applied = hccl.apply(args)
        if where.rank == 0:
            lines += applied
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or where.world_size)
    lines.append(affinity.bind(where.local_rank, local_world, where.device.type,
                               enabled=getattr(args, "bind_cores", True)))
    return lines


def init(args) -> Placement:
    """Installation checked, process group up, this rank's device current, the HCCL environment set, the process
    bound to its cores, adaptations applied."""
    from megatron_glue.capture import adapt, adaptations
    from megatron_glue.training import doctor

    stop = doctor.check_at_start(args.distributed_backend)
    if stop:
        raise ArgumentError(stop)
    where = placement(args)  # the process-group timeout reads the user's HCCL_CONNECT_TIMEOUT before the job's
    for line in prepare_process(args, where):
        print(line, flush=True)
    if where.backend == "hccl":
        import torch_npu  # noqa: F401
        from torch_npu.contrib import transfer_to_npu  # noqa: F401  (cuda -> npu, torch_npu's own means)

        torch.npu.set_device(where.device)
    elif where.backend == "nccl":
        torch.cuda.set_device(where.device)
    adaptations.set_current_device(where.device)
    # What megatron_glue changes in Megatron for this device (see megatron_glue.capture.adaptations.groups_for).
    adapt(adaptations.groups_for(where.device, training=True))
    if not dist.is_initialized():
        # The CPU collective is gloo whatever the accelerator's backend is: Megatron's gloo groups use it.
        backend = "gloo" if where.device.type == "cpu" else where.backend
        # One process started without a launcher needs no rendezvous: an in-process store.
        store = dist.HashStore() if where.world_size == 1 and "MASTER_ADDR" not in os.environ else None
        dist.init_process_group(backend, rank=where.rank, world_size=where.world_size, timeout=where.timeout,
                                store=store)
    watch_ranks(where.rank_watchdog_s)  # a rank that is gone ends the others, not the timeout
    return where
