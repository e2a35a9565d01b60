"""MoE parallel layouts against one process: every layout, compiled and eager, over gloo.

    python -m bench.moe_parallel

A tiny MoE GPT (2 layers, hidden 64, 4 experts, top-2, aux loss 0.01, fp32) trained one iteration and saved; then
each layout loads that checkpoint (--finetune: the same weights whatever its own initialisation) and trains 2
iterations of the same global batch, once with the backend (`backend="ascend"`) and once `--no-npu-compile`; its
losses, gradient norms and load-balancing losses are compared with one eager process's. The CI test
(tests/megatron_glue/test_moe.py, `test_parallel_layouts_equal_one_process`) runs six of these launches; the
compiled ones at 4 processes take minutes on 2 cores and live here. Writes `bench/results/moe_parallel.md`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --mock-data --vocab-size 500 --lr 1e-3 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 0 --distributed-backend gloo --hidden-dropout 0 --attention-dropout 0 "
        "--no-progress-bar --seed 7 --num-experts 4 --disable-bias-linear --moe-aux-loss-coeff 0.01 "
        "--moe-router-topk 2").split()
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
A2A, AG = ["--moe-token-dispatcher-type", "alltoall"], ["--moe-token-dispatcher-type", "allgather"]
EP2 = ["--expert-model-parallel-size", "2"]
# name -> (processes, flags)
LAYOUTS = {
    "EP 2, allgather": (2, [*EP2, *AG]),
    "EP 2, alltoall": (2, [*EP2, *A2A]),
    "TP 2 x EP 2, ETP 1, alltoall": (4, [*TP2_SP, *EP2, "--expert-tensor-parallel-size", "1", *A2A]),
    "TP 2 x EP 2, ETP 2, allgather": (4, [*TP2_SP, *EP2, *AG]),
    "TP 2 x EP 2, ETP 2, alltoall": (4, [*TP2_SP, *EP2, *A2A]),
    "TP 2, --moe-tp-extend-ep (EP 2, ETP 1), alltoall": (2, [*TP2_SP, *A2A, "--moe-tp-extend-ep"]),
    "PP 2, alltoall": (2, ["--pipeline-model-parallel-size", "2", *A2A]),
    "TP 2 x PP 2 x EP 2, ETP 1, alltoall": (4, [*TP2_SP, "--pipeline-model-parallel-size", "2", *EP2,
                                               "--expert-tensor-parallel-size", "1", *A2A]),
}
KEYS = ("lm loss", "grad_norm", "load_balancing_loss")


def _env() -> dict:
    return dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")


def launch(folder: Path, flags: list[str], nproc: int = 1) -> tuple[int, float, list[dict], str]:
    """The job in `folder`: (exit code, wall seconds, its train metrics rows, output)."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [*TINY, *flags, "--metrics-file", str(folder / "metrics.jsonl")]
    command = ([sys.executable, "-m", "megatron_glue.pretrain_gpt", *args] if nproc == 1 else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
                "megatron_glue.pretrain_gpt", *args])
    start = time.time()
    done = subprocess.run(command, cwd=folder, env=_env(), capture_output=True, text=True, timeout=1200)
    seconds = time.time() - start
    path = folder / "metrics.jsonl"
    rows = [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == "train"] if path.exists() else []
    return done.returncode, seconds, rows, done.stdout + done.stderr


def worst(rows: list[dict], one: list[dict], key: str) -> float | None:
    if len(rows) != len(one) or not rows:
        return None
    return max(abs(r[key] - o[key]) / max(abs(o[key]), 1e-12) for r, o in zip(rows, one))


def main(argv: list[str] | None = None) -> int:
    work = Path(argv[0] if argv else tempfile.mkdtemp(prefix="moe_parallel_"))
    code, _, _, out = launch(work / "start", ["--train-iters", "1", "--save", str(work / "ckpt"), "--no-npu-compile"])
    assert code == 0, out[-3000:]
    start = ["--train-iters", "2", "--load", str(work / "ckpt"), "--finetune"]
    code, _, one, out = launch(work / "one", [*start, "--no-npu-compile"])
    assert code == 0, out[-3000:]
    lines = ["# MoE parallel layouts against one process", "",
             "`python -m bench.moe_parallel`: a tiny MoE GPT (2 layers, hidden 64, 4 experts, top-2, aux loss 0.01, "
             "fp32, megatron-core's SequentialMLP experts) from one saved checkpoint, 2 iterations of a global batch "
             "of 8 over gloo; the largest relative difference from one eager process over both iterations (limit "
             "1e-5). Wall time of the launch on this 2-core machine (compile cache warm after the first compiled "
             "launch of a graph).", "",
             "| layout | processes | mode | lm loss | grad norm | load-balancing loss | wall s |",
             "|---|---|---|---|---|---|---|"]
    ok = True
    for name, (nproc, flags) in LAYOUTS.items():
        for mode in ("compiled", "eager"):
            folder = work / f"{name}-{mode}".replace(" ", "").replace(",", "_")
            code, seconds, rows, out = launch(folder, [*start, *flags, *([] if mode == "compiled" else
                                                                          ["--no-npu-compile"])], nproc)
            diffs = [worst(rows, one, key) for key in KEYS]
            good = code == 0 and all(d is not None and d <= 1e-5 for d in diffs)
            ok &= good
            cells = [f"{d:.1e}" if d is not None else f"**failed** (exit {code})" for d in diffs]
            lines.append(f"| {name} | {nproc} | {mode} | {' | '.join(cells)} | {seconds:.0f} |")
            print(lines[-1], flush=True)
            if code:
                print(out[-3000:], flush=True)
    text = "\n".join(lines) + "\n"
    (Path(__file__).parent / "results" / "moe_parallel.md").write_text(text)
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
