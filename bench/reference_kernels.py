"""``python -m bench.reference_kernels``: the reference target's fused attention, tiled vs torch's fused kernel.

Two tables, every figure from this one process run, side by side:
- the op: ``fused_attention`` forward + backward as Megatron calls it (sbnd, causal, fill=-10000, fp32) against
  Megatron's eager attention (baddbmm, masked_fill, softmax, bmm), with ``attention.FAST_PATH`` off (the tiled
  kernels, as before) and on;
- a megatron-core GPT training step (forward, backward, AdamW): eager, and backend="ascend" with the fast path
  off and on (the same compiled model; the kernel reads FAST_PATH at each call).

Writes ``bench/results/reference_kernels.md`` and prints it.

    python -m bench.reference_kernels [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import platform

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

from bench.harness import median_seconds, write_result  # noqa: E402
from npu_compile.ops import attention  # noqa: E402

OP_SHAPES = [(128, 4, 8, 32), (1024, 2, 8, 64), (2048, 1, 8, 64)]  # (s, b, n, d)
MODELS = [(128, 4), (1024, 2)]  # (seq, micro-batch) of the 2-layer GPT of `make bench`


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def eager_megatron_attention(q, k, v, mask, scale):
    s, b, n, d = q.shape
    scores = torch.baddbmm(torch.empty(b * n, s, s), q.reshape(s, b * n, d).transpose(0, 1),
                           k.reshape(s, b * n, d).transpose(0, 1).transpose(1, 2), beta=0.0, alpha=scale)
    probs = torch.softmax(scores.view(b, n, s, s).masked_fill(mask, -10000.0), dim=-1)
    context = torch.bmm(probs.view(b * n, s, s), v.reshape(s, b * n, d).transpose(0, 1))
    return context.view(b, n, s, d).permute(2, 0, 1, 3).contiguous()


def op_rows(repeats: int) -> list[str]:
    rows = []
    for s, b, n, d in OP_SHAPES:
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(s, b, n, 3 * d, generator=gen, requires_grad=True)
        grad = torch.randn(s, b, n, d, generator=gen)
        mask = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)
        scale = 1.0 / math.sqrt(d)

        def eager():
            q, k, v = qkv.split(d, dim=-1)
            torch.autograd.grad(eager_megatron_attention(q, k, v, mask, scale), qkv, grad)

        def fused():
            q, k, v = qkv.split(d, dim=-1)
            out, *_ = torch.ops.npu_compile.fused_attention(q, k, v, layout="sbnd", scale=scale, causal=True,
                                                            fill=-10000.0)
            torch.autograd.grad(out, qkv, grad)

        times = {}
        for name, fn, fast in (("eager", eager, True), ("tiled", fused, False), ("fast", fused, True)):
            attention.FAST_PATH = fast
            fn()
            times[name] = median_seconds(fn, repeats)
        attention.FAST_PATH = True
        rows.append(f"| fused_attention fwd+bwd (sbnd, causal, fill) | s{s} b{b} n{n} d{d} | {_ms(times['eager'])} | "
                    f"{_ms(times['tiled'])} ({times['tiled'] / times['eager']:.2f}×) | "
                    f"{_ms(times['fast'])} ({times['fast'] / times['eager']:.2f}×) |")
        print(rows[-1], flush=True)
    return rows


def model_rows(repeats: int, models_to_run) -> list[str]:
    import megatron_glue
    from megatron_glue.capture import models

    megatron_glue.adapt()
    models.init_single_process()
    rows = []
    try:
        for seq, batch in models_to_run:
            config, vocab = models.gpt_config(), 256
            data = models.synthetic_batch(batch, seq, vocab, seed=0)
            times = {}
            for backend in ("eager", "ascend"):
                torch._dynamo.reset()
                model = models.build_gpt_model(config, vocab, seq, seed=0)
                if backend != "eager":
                    model = torch.compile(model, backend=backend)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

                def step():
                    models.train_step(model, data, opt)

                step()  # compiles
                step()
                if backend == "eager":
                    times["eager"] = median_seconds(step, repeats)
                    continue
                # The same compiled model, the paths interleaved so that machine noise hits both alike.
                tiled, fast = [], []
                for _ in range(repeats):
                    attention.FAST_PATH = False
                    tiled.append(median_seconds(step, 1))
                    attention.FAST_PATH = True
                    fast.append(median_seconds(step, 1))
                times["tiled"], times["fast"] = sorted(tiled)[len(tiled) // 2], sorted(fast)[len(fast) // 2]
            rows.append(f"| GPT train step, ascend (reference target) | 2 layers h128, s{seq} b{batch} | "
                        f"{_ms(times['eager'])} | {_ms(times['tiled'])} ({times['tiled'] / times['eager']:.2f}×) | "
                        f"{_ms(times['fast'])} ({times['fast'] / times['eager']:.2f}×) |")
            print(rows[-1], flush=True)
    finally:
        attention.FAST_PATH = True
        models.teardown_single_process()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repeats, the seq-128 model only")
    args = parser.parse_args()
    repeats = 3 if args.quick else 7
    header = ["| op | shape | eager | before (tiled) | after |", "|---|---|---|---|---|"]
    body = op_rows(repeats) + model_rows(repeats, MODELS[:1] if args.quick else MODELS)
    text = "\n".join([
        "# Reference kernels: fused attention, tiled vs torch's fused kernel",
        "",
        f"CPU fp32, torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.machine()}; medians "
        f"of {repeats} runs, all in one process. Ratios are against the eager column of the same row. "
        "\"before\" is `attention.FAST_PATH = False` (the QUERY_TILE loop), \"after\" the default (torch's "
        "flash attention kernels for CPU, forward and backward). The op rows are Megatron's core attention call "
        "(its eager column: baddbmm, masked_fill(-10000), softmax, bmm).",
        "",
        *header, *body,
    ])
    path = write_result("reference_kernels", text)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
