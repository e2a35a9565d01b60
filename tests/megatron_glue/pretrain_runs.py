"""Launch `megatron_glue.pretrain_gpt` (each rank forked from a preloaded interpreter, zygote.py; or as a user does,
torchrun for several processes), and read what it wrote.

Each run writes its metrics JSONL (full-precision losses) to its own folder; `Run.losses` reads them back.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
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


class _Zygote:
    """This test process's fork server (zygote.py), started at its first launch."""

    def __init__(self):
        self.proc = None
        self.lock = threading.Lock()

    def _start(self):
        log = tempfile.NamedTemporaryFile("w+", prefix="zygote-", suffix=".log", delete=False)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py"))], env=env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)
        ready = json.loads(self.proc.stdout.readline() or "{}")
        if not ready.get("ready"):
            self.proc.kill()
            self.proc = None
            raise RuntimeError(f"the test launcher (tests/megatron_glue/zygote.py) did not start: "
                               f"{ready.get('error') or Path(log.name).read_text()[-3000:]}")
        atexit.register(self.proc.kill)

    def run(self, folder: Path, module: str, args: list[str], nproc: int, timeout: float) -> Run:
        stdout, stderr = folder / f".launch-{os.getpid()}.out", folder / f".launch-{os.getpid()}.err"
        for path in (stdout, stderr):
            path.write_text("")
        request = dict(cwd=str(folder), env=env(), module=module, args=args, nproc=nproc, timeout=timeout,
                       stdout=str(stdout), stderr=str(stderr))
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = json.loads(self.proc.stdout.readline())
        output = stdout.read_text() + stderr.read_text()
        stdout.unlink()
        stderr.unlink()
        return Run(answer["returncode"], output, folder)


_ZYGOTE = _Zygote()


def pretrain(folder: Path, *flags: str, nproc: int = 1, base=TINY, timeout: float = 600,
             module: str = "megatron_glue.pretrain_gpt", prefix: list[str] | None = None,
             launcher: str = "fork") -> Run:
    """Run the job in `folder` (created), metrics to folder/metrics.jsonl; returns the finished Run.

    launcher "fork": each rank forked from an interpreter that has imported the job's modules (zygote.py);
    "torchrun": `python -m torch.distributed.run` (one process: `python -m`), as a user launches it."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [*base, *flags, "--metrics-file", str(folder / "metrics.jsonl")]
    if launcher not in ("fork", "torchrun"):
        raise ValueError(f"launcher {launcher!r}: 'fork' or 'torchrun'")
    if prefix is None and launcher == "fork":
        return _ZYGOTE.run(folder, module, args, nproc, timeout)
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


def parse_tiny(*flags: str, world_size: int = 1):
    """The job's argument check on the tiny job (3 iterations) plus `flags`."""
    from megatron_glue.training.arguments import parse_args

    return parse_args([*TINY, "--train-iters", "3", *flags], world_size=world_size)


def parse_error(*flags: str, world_size: int = 1) -> str:
    """The one-line error the job's argument check gives for the tiny job plus `flags`."""
    from megatron_glue.training.arguments import ArgumentError

    try:
        parse_tiny(*flags, world_size=world_size)
    except ArgumentError as e:
        return e.message
    raise AssertionError(f"the argument check took {flags}")
