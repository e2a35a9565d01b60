"""Launch `megatron_glue.pretrain_gpt` as a user does (torchrun for several processes), and read what it wrote.

Each run writes its metrics JSONL (full-precision losses) to its own folder; `Run.losses` reads them back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# A tiny GPT on mock data; dropout off so that layouts and eager/compiled runs are comparable.
TINY = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 2 --global-batch-size 8 --mock-data --vocab-size 500 --lr 1e-3 --log-interval 1 "
        "--eval-interval 1000 --eval-iters 1 --distributed-backend gloo --hidden-dropout 0 --attention-dropout 0 "
        "--no-progress-bar --seed 7").split()


@dataclass
class Run:
    returncode: int
    output: str
    folder: Path

    def rows(self, kind: str) -> list[dict]:
        path = self.folder / "metrics.jsonl"
        if not path.exists():
            return []
        return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]

    @property
    def losses(self) -> list[float]:
        return [r["lm loss"] for r in self.rows("train")]

    def check(self) -> "Run":
        assert self.returncode == 0, f"pretrain_gpt failed ({self.returncode}):\n{self.output[-6000:]}"
        return self


def env() -> dict:
    return dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                TORCHINDUCTOR_COMPILE_THREADS="1", PYTHONUNBUFFERED="1")


def pretrain(folder: Path, *flags: str, nproc: int = 1, base=TINY, timeout: float = 600,
             module: str = "megatron_glue.pretrain_gpt", prefix: list[str] | None = None) -> Run:
    """Run the job in `folder` (created), metrics to folder/metrics.jsonl; returns the finished Run."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [*base, *flags, "--metrics-file", str(folder / "metrics.jsonl")]
    if prefix is not None:
        command = [*prefix, *args]
    elif nproc == 1:
        command = [sys.executable, "-m", module, *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   "-m", module, *args]
    done = subprocess.run(command, cwd=folder, env=env(), capture_output=True, text=True, timeout=timeout)
    return Run(done.returncode, done.stdout + done.stderr, folder)


def assert_close(a: list[float], b: list[float], rel: float = 1e-5, what: str = "") -> None:
    assert len(a) == len(b) and a, f"{what}: {len(a)} values vs {len(b)}"
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))
    assert worst <= rel, f"{what}: differ by {worst:.2e} relative (limit {rel:.0e}):\n{a}\n{b}"
