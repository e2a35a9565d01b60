"""What the job tells its user: Megatron-LM's log lines (rank 0 prints them), a metrics JSONL, a progress bar on a
terminal, and a loss-curve PNG at the end.

The line formats are Megatron-LM's (megatron/training/training.py `training_log`, `evaluate_and_print_results`;
megatron/training/checkpointing.py), so tools that parse Megatron logs parse these:

     iteration       10/     100 | consumed samples:          320 | elapsed time per iteration (ms): 812.3 | ...
     validation loss at iteration 100 | lm loss value: 6.512345E+00 | lm loss PPL: 6.731235E+02 |
     successfully saved checkpoint from iteration     100 to <dir> [ t 1/2, p 1/1 ]
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_glue.training import monitor, noop_layers


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print_rank0(message: str) -> None:
    if is_rank0():
        print(message, flush=True)


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process: the accelerator's allocator where there is one, else the resident set."""
    return monitor.peak_bytes(monitor.memory_bytes(device)) / 2 ** 20


def iteration_line(*, iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float,
                   learning_rate: float, global_batch_size: int, losses: dict[str, float], loss_scale: float,
                   grad_norm: float | None, skipped: int, nan: int, tokens_per_sec: float,
                   peak_mb: float, tflops_per_device: float | None = None) -> str:
    line = f" iteration {iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    if tflops_per_device is not None:  # --log-throughput, where Megatron-LM puts it
        line += f" throughput per GPU (TFLOP/s/GPU): {tflops_per_device:.1f} |"
    line += f" learning rate: {learning_rate:.6E} |"
    line += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        line += f" {key}: {value:.6E} |"
    line += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        line += f" grad norm: {grad_norm:.3f} |"
    line += f" number of skipped iterations: {skipped:3d} |"
    line += f" number of nan iterations: {nan:3d} |"
    line += f" tokens per second: {tokens_per_sec:.1f} |"
    line += f" peak memory (MB): {peak_mb:.1f} |"
    return line


def num_floating_point_operations(args, batch_size: int) -> float:
    """The model FLOPs of one iteration of `batch_size` sequences, as Megatron-LM counts them for --log-throughput
    (megatron/training/training.py `num_floating_point_operations`, the dense GPT case): every GEMM three times
    (forward, weight and data gradients), 2 FLOPs per multiply-add, the attention matrix half (causal), the
    logits over the padded vocabulary."""
    heads, hidden, seq = args.num_attention_heads, args.hidden_size, args.seq_length
    layers = args.num_layers - noop_layers.count(args)  # MindSpeed's calc_flop: the real layers only
    groups = args.num_query_groups if args.group_query_attention else heads
    query_ratio = args.kv_channels * heads / hidden
    glu = 3 / 2 if args.swiglu else 1
    expansion = 3 * 2 * 2
    attention = expansion * layers * hidden * hidden * ((1 + groups / heads + seq / hidden / 2) * query_ratio)
    mlp = expansion * layers * hidden * args.ffn_hidden_size * glu
    logits = 3 * 2 * hidden * args.padded_vocab_size
    return batch_size * seq * (mlp + attention + logits)


class TensorBoard:
    """Megatron-LM's TensorBoard scalars, under its tag names (megatron/training/training.py `training_log` and
    `evaluate_and_print_results`, core_v0.16.1), written with torch.utils.tensorboard's SummaryWriter by the last
    rank, as Megatron-LM's writer is (megatron/training/global_vars.py `_set_tensorboard_writer`). Every rank holds
    the values (the losses are broadcast from the last pipeline stage), so the last rank writes them all.

    Each --tensorboard-log-interval: learning-rate, batch-size, the losses (this iteration's, as Megatron-LM
    writes them), loss-scale (unless --no-log-loss-scale-to-tensorboard), grad-norm, world-size
    (--log-world-size-to-tensorboard), the memory figures (--log-memory-to-tensorboard), each also "<tag> vs
    samples" over the consumed samples; and, not Megatron-LM's, the utilization the job's monitor sampled since the
    previous iteration (`npu-utilization` on an NPU, `cpu-utilization` of this process on a CPU), when it has a
    sample. Each --log-interval: iteration-time (seconds, --log-timers-to-tensorboard)
    and throughput (TFLOP/s per device, with --log-throughput too). Each evaluation: "<loss> validation" (and
    "... ppl" with --log-validation-ppl-to-tensorboard)."""

    def __init__(self, args, device: torch.device | None = None):
        self.args, self.device = args, device
        self.writer = None
        last = not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1
        if args is not None and getattr(args, "tensorboard_dir", None) and last:
            from torch.utils.tensorboard import SummaryWriter

            print("> setting tensorboard ...", flush=True)
            self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)

    def _both(self, tag: str, value: float, iteration: int, samples: int) -> None:
        self.writer.add_scalar(tag, value, iteration)
        self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def train(self, iteration: int, samples: int, *, learning_rate: float, batch_size: int,
              losses: dict[str, float], loss_scale: float, grad_norm: float | None,
              utilization: dict[str, float] | None = None) -> None:
        args = self.args
        if self.writer is None or iteration % args.tensorboard_log_interval:
            return
        self._both("learning-rate", learning_rate, iteration, samples)
        self._both("batch-size", batch_size, iteration, samples)
        for key, value in losses.items():
            self._both(key, value, iteration, samples)
        if args.log_loss_scale_to_tensorboard:
            self._both("loss-scale", loss_scale, iteration, samples)
        if args.log_world_size_to_tensorboard:
            self._both("world-size", args.world_size, iteration, samples)
        if grad_norm is not None:
            self._both("grad-norm", grad_norm, iteration, samples)
        if args.log_memory_to_tensorboard:
            for tag, value in memory_figures(self.device).items():
                self.writer.add_scalar(tag, value, iteration)
        for name, value in (utilization or {}).items():  # not Megatron-LM's: the job's monitor (monitor.py)
            self.writer.add_scalar(name.removesuffix(" (%)").replace(" ", "-"), value, iteration)

    def timing(self, iteration: int, seconds_per_iteration: float, tflops_per_device: float | None) -> None:
        """At each --log-interval, as Megatron-LM's training_log writes them."""
        if self.writer is None or not self.args.log_timers_to_tensorboard:
            return
        self.writer.add_scalar("iteration-time", seconds_per_iteration, iteration)
        if tflops_per_device is not None:
            self.writer.add_scalar("throughput", tflops_per_device, iteration)

    def validation(self, iteration: int, samples: int, losses: dict[str, float]) -> None:
        """Megatron-LM writes the validation and the test set's losses under the same tags."""
        if self.writer is None:
            return
        for key, value in losses.items():
            self._both(f"{key} validation", value, iteration, samples)
            if self.args.log_validation_ppl_to_tensorboard:
                self._both(f"{key} validation ppl", math.exp(min(20.0, value)), iteration, samples)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def memory_figures(device: torch.device) -> dict[str, float]:
    """--log-memory-to-tensorboard: the allocator's statistics under Megatron-LM's tags on an accelerator; on the
    CPU, which has no caching allocator, the process's peak resident set as mem-max-allocated-bytes alone."""
    figures = monitor.memory_bytes(device)
    if "max_allocated" in figures:
        return {"mem-reserved-bytes": figures["reserved"], "mem-allocated-bytes": figures["allocated"],
                "mem-max-allocated-bytes": figures["max_allocated"],
                "mem-allocated-count": figures["allocation_count"]}
    return {"mem-max-allocated-bytes": figures["max_rss"]}


def arguments_lines(args, title: str = "arguments") -> str:
    """Megatron-LM's start-of-job arguments dump (megatron/training/arguments.py `_print_args`, core_v0.16.1):
    every argument, dotted to a column, sorted case-blind, between two rules."""
    rows = sorted((f"  {name} {'.' * (48 - len(name))} {value}" for name, value in vars(args).items()),
                  key=str.lower)
    return "\n".join([f"------------------------ {title} ------------------------", *rows,
                      f"-------------------- end of {title} ---------------------"])


def parameters_line(tp_rank: int, pp_rank: int, count: int) -> str:
    """Megatron-LM's parameter count per model-parallel rank (megatron/training/training.py `get_model`)."""
    return f" > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank}, {pp_rank}): {count}"


def validation_lines(prefix: str, losses: dict[str, float]) -> str:
    line = f" validation loss at {prefix} | "
    for key, value in losses.items():
        line += f"{key} value: {value:.6E} | "
        line += f"{key} PPL: {math.exp(min(20.0, value)):.6E} | "
    rule = "-" * (len(line) + 1)
    return f"{rule}\n{line}\n{rule}"


class Metrics:
    """Rank 0's record of the run: one JSON object per logged event, and the loss curve drawn from it."""

    def __init__(self, path: str | None, show_progress: bool, total: int, start: int,
                 tensorboard: "TensorBoard | None" = None):
        self.path = path if is_rank0() else None
        self.tensorboard = tensorboard if tensorboard is not None else TensorBoard(None)
        self.rows: list[dict] = []
        self._bar = None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            if start == 0 and os.path.exists(self.path):
                os.remove(self.path)  # a fresh run; a resumed one appends
        if show_progress and is_rank0() and sys.stdout.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True, leave=False)

    def record(self, kind: str, **fields) -> None:
        if not is_rank0():
            return
        row = {"kind": kind, "time": time.time(), **fields}
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def step(self, loss: float | None) -> None:
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}")

    def close(self) -> str | None:
        """Close the bar; draw the loss curve next to the JSONL (read back whole: a resumed run has both parts)."""
        if self._bar is not None:
            self._bar.close()
        self.tensorboard.close()
        if not self.path or not os.path.exists(self.path):
            return None
        with open(self.path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        folder = os.path.dirname(os.path.abspath(self.path))
        plot_monitor(rows, os.path.join(folder, "memory.png"))
        return plot_loss_curve(rows, os.path.join(folder, "loss_curve.png"))


def plot_loss_curve(rows: list[dict], out: str) -> str | None:
    train = [(r["iteration"], r["lm loss"]) for r in rows if r["kind"] == "train" and "lm loss" in r]
    valid = [(r["iteration"], r["lm loss"]) for r in rows if r["kind"] == "validation" and "lm loss" in r]
    if not train and not valid:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train lm loss", lw=1.2)
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation lm loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_monitor(rows: list[dict], out: str) -> str | None:
    """Memory and utilization per iteration (megatron_glue.training.monitor's fields), beside the loss curve."""
    train = [r for r in rows if r["kind"] == "train"]
    memory_keys = [k for k in ("memory allocated (MB)", "memory reserved (MB)", "cpu rss (MB)")
                   if any(k in r for r in train)]
    use_keys = [k for k in ("npu utilization (%)", "cpu utilization (%)") if any(k in r for r in train)]
    if not memory_keys and not use_keys:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, use) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for key in memory_keys:
        mem.plot(*zip(*[(r["iteration"], r[key]) for r in train if key in r]), label=key, lw=1.2)
    mem.set_ylabel("MB")
    mem.legend()
    for key in use_keys:
        use.plot(*zip(*[(r["iteration"], r[key]) for r in train if key in r]), "o-", label=key, ms=3)
    use.set_ylabel("%")
    use.set_xlabel("iteration")
    if use_keys:
        use.legend()
    for ax in (mem, use):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
