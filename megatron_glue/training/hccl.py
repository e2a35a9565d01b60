"""The HCCL environment the job owns: set from its flags before the process group exists, the user's own value kept.

HCCL reads these from the environment when a communicator is built (torch_npu reads HCCL_CONNECT_TIMEOUT and
HCCL_EXEC_TIMEOUT through `OptionsManager`, Ascend/pytorch at 9e73e70, torch_npu/csrc/core/npu/register/OptionsManager.cpp:
170-190), so they are set in `device.init`, before `init_process_group`, on the hccl backend only. Each with its
source (the CANN documentation pages; ranges and defaults as they state them):

- HCCL_CONNECT_TIMEOUT: seconds to build the links between devices; an integer in [120, 7200], default 120 (CANN
  8.5.0 envref_07_0149). The job: `--distributed-timeout-minutes` x 60 clamped to that range, so a slow rank gets
  the time Megatron-LM's flag gives it (MindSpeed-LLM's scripts export 1200 to 7200 by hand for the same reason).
- HCCL_EXEC_TIMEOUT: seconds a device waits for the others inside a collective; default 1836; (0, 17340] on the
  Atlas training series (910), up to 2147483647 on A2/A3 (CANN envref_07_0078). The job: the same
  `--distributed-timeout-minutes` x 60, clamped to (0, 17340] (valid on every series), so HCCL's own wait and
  torch's process-group timeout end together instead of one hanging past the other.
- HCCL_BUFFSIZE: MB per communicator for the data of a collective, default 200; the CANN page's sizing rule for
  LLMs is ceil(micro-batch x sequence x hidden x dtype bytes / 2**20), above which a collective slows down (CANN
  8.5.0 hcclug_000076 / envref_07_0080). The job: that figure when it is above 200 and the job has collectives
  over activations (TP > 1); otherwise HCCL's default stays.

A user's own value always wins: it is kept, and the log says what the job would have set. The other HCCL
variables MindSpeed-LLM's scripts export (HCCL_IF_BASE_PORT, HCCL_ALGO, HCCL_SOCKET_IFNAME, HCCL_WHITELIST_DISABLE,
TORCH_HCCL_ZERO_COPY) depend on the cluster, not the job: the job reads them only to log them, and
`npu-compile doctor` lists them (docs/operating.md has each with its source).
"""

from __future__ import annotations

import math
import os

CONNECT_TIMEOUT_RANGE = (120, 7200)
EXEC_TIMEOUT_RANGE = (1, 17340)
BUFFSIZE_DEFAULT_MB = 200

# The variables the job sets, then the ones it only reports: name -> (what, source)
OWNED = {
    "HCCL_CONNECT_TIMEOUT": ("link set-up timeout, s; [120, 7200], default 120",
                             "https://www.hiascend.com/document/detail/zh/canncommercial/850/maintenref/envvar/"
                             "envref_07_0149.html"),
    "HCCL_EXEC_TIMEOUT": ("in-collective wait, s; default 1836, (0, 17340] on Atlas training series",
                          "https://www.hiascend.com/document/detail/zh/canncommercial/latest/maintenref/envvar/"
                          "envref_07_0078.html"),
    "HCCL_BUFFSIZE": ("MB per communicator; default 200",
                      "https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/"
                      "envref_07_0080.html"),
}
REPORTED = {
    "HCCL_IF_BASE_PORT": ("first of the host ports HCCL takes; [1024, 65520], default 60000",
                          "https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/"
                          "envref_07_0074.html"),
    "HCCL_ALGO": ("collective algorithm per level", "https://www.hiascend.com/doc_center/source/en/"
                  "CANNCommunityEdition/900/API/hcclug/hcclenvref_07_0001.html"),
    "HCCL_SOCKET_IFNAME": ("network interface for HCCL's sockets", "https://www.hiascend.com/document/detail/zh/"
                           "canncommercial/900/maintenref/envvar/envref_07_0075.html"),
    "HCCL_WHITELIST_DISABLE": ("1: no allowlist check of peers", "https://www.hiascend.com/document/detail/zh/"
                               "canncommercial/900/maintenref/envvar/envref_07_0156.html"),
    "TORCH_HCCL_ZERO_COPY": ("torch_npu: zero-copy collectives, 0 or 1",
                             "torch_npu 2.13.0 wheel, torch_npu/lib/libtorch_npu.so: \"TORCH_HCCL_ZERO_COPY should "
                             "be 0 or 1.\""),
}


def _clamp(value: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], value))


def buffsize_mb(args) -> int | None:
    """CANN's sizing rule for HCCL_BUFFSIZE (module docstring); None when the default is enough or nothing
    collects activations."""
    if getattr(args, "tensor_model_parallel_size", 1) <= 1:
        return None
    dtype_bytes = 2 if (getattr(args, "fp16", False) or getattr(args, "bf16", False)) else 4
    mb = math.ceil(args.micro_batch_size * args.seq_length * args.hidden_size * dtype_bytes / 2 ** 20)
    return mb if mb > BUFFSIZE_DEFAULT_MB else None


def job_settings(args) -> dict[str, str]:
    """What the job sets from its flags (module docstring)."""
    seconds = args.distributed_timeout_minutes * 60
    settings = {"HCCL_CONNECT_TIMEOUT": str(_clamp(seconds, CONNECT_TIMEOUT_RANGE)),
                "HCCL_EXEC_TIMEOUT": str(_clamp(seconds, EXEC_TIMEOUT_RANGE))}
    buff = buffsize_mb(args)
    if buff is not None:
        settings["HCCL_BUFFSIZE"] = str(buff)
    return settings


def apply(args, environ=None) -> list[str]:
    """Set the job's HCCL variables into `environ` (os.environ), keeping the user's; returns the log lines."""
    environ = os.environ if environ is None else environ
    lines = []
    for name, value in job_settings(args).items():
        user = environ.get(name)
        if user is not None and user != "":
            note = "" if user == value else f" (the job would set {value})"
            lines.append(f" {name}={user}: the user's, kept{note}")
        else:
            environ[name] = value
            lines.append(f" {name}={value}: set by the job ({OWNED[name][0]})")
    for name in REPORTED:
        if environ.get(name):
            lines.append(f" {name}={environ[name]}: the user's")
    return lines
