"""Megatron's activation recompute in the compiled job: peak memory and step time of one training step.

    python -m bench.recompute [--quick]

A Llama-style megatron-core GPT (fp32, CPU, one process) built as the training job builds it, each transformer layer
compiled on its own with backend="ascend" (``npu_compile.precompile.compile``, cache off) or left eager, with
``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`` or ``block``/2, against no
recompute. Per row: peak CPU bytes of one forward+backward above the step's start (profiler memory events,
``bench.harness.peak_bytes``), median step time, and the loss and gradient norm (equal across rows of one backend:
recompute changes memory, not numbers). Writes ``bench/results/recompute.md``.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.harness import median_seconds, peak_bytes, write_result

MODES = {"none": {}, "full/uniform/1": dict(recompute_granularity="full", recompute_method="uniform",
                                            recompute_num_layers=1),
         "full/block/2": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)}


def measure(mode: str, compiled: bool, shape: dict, repeats: int) -> dict:
    from megatron_glue.capture import models
    from npu_compile import precompile

    torch._dynamo.reset()
    config = models.llama_config(num_layers=shape["layers"], hidden_size=shape["hidden"],
                                 num_attention_heads=shape["heads"], ffn_hidden_size=shape["ffn"],
                                 attention_softmax_in_fp32=False, **MODES[mode])
    model = models.build_gpt_model(config, vocab_size=shape["vocab"], seq_len=shape["seq"], seed=0)
    if compiled:
        for layer in model.decoder.layers:
            layer.forward = precompile.compile(layer.forward, {"cache": False})
    batch = models.synthetic_batch(shape["batch"], shape["seq"], shape["vocab"], seed=0)

    def step():
        model.zero_grad(set_to_none=True)
        loss = models.loss_fn(model, batch)
        loss.backward()
        return loss

    started = time.perf_counter()
    loss = float(step())  # the first step compiles
    first = time.perf_counter() - started
    norm = float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None)))
    peak = peak_bytes(step)
    seconds = median_seconds(step, repeats)
    return dict(mode=mode, backend="ascend" if compiled else "eager", peak=peak, seconds=seconds, first=first,
                loss=loss, grad_norm=norm)


def main(argv: list[str] | None = None) -> int:
    import megatron_glue
    from megatron_glue.adaptations import groups_for
    from megatron_glue.capture.models import init_single_process, teardown_single_process

    p = argparse.ArgumentParser(prog="python -m bench.recompute")
    p.add_argument("--quick", action="store_true", help="a smaller model, 2 timed steps")
    a = p.parse_args(argv)
    shape = (dict(layers=4, hidden=128, heads=4, ffn=256, seq=256, batch=2, vocab=256) if a.quick else
             dict(layers=8, hidden=256, heads=8, ffn=512, seq=512, batch=2, vocab=512))
    repeats = 2 if a.quick else 3
    megatron_glue.adapt(groups_for(training=True))
    init_single_process()
    rows = []
    try:
        for compiled in (False, True):
            for mode in MODES:
                rows.append(measure(mode, compiled, shape, repeats))
                r = rows[-1]
                print(f"{r['backend']:6s} {mode:15s} peak {r['peak'] / 2**20:8.1f} MiB  step {r['seconds'] * 1e3:8.1f} ms"
                      f"  loss {r['loss']:.6f}  grad norm {r['grad_norm']:.6f}", flush=True)
    finally:
        teardown_single_process()
    base = {r["backend"]: r for r in rows if r["mode"] == "none"}
    lines = [
        "# Activation recompute (Megatron's --recompute-granularity full) in the compiled job",
        "",
        f"Llama-style megatron-core GPT, fp32, CPU, one process: {shape['layers']} layers, hidden {shape['hidden']}, "
        f"{shape['heads']} heads, ffn {shape['ffn']}, sequence {shape['seq']}, batch {shape['batch']}. Each layer "
        "compiled on its own (backend=\"ascend\") or eager; recompute by megatron-core's own checkpointing "
        "(`tensor_parallel.checkpoint` around whole layers, the compiled layer run under no_grad and again in the "
        "backward). Peak: CPU bytes of one forward+backward above its start (profiler). `python -m bench.recompute`.",
        "",
        "| backend | recompute | peak MiB | peak ×none | step ms | step ×none | loss | grad norm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = base[r["backend"]]
        lines.append(f"| {r['backend']} | {r['mode']} | {r['peak'] / 2**20:.1f} | {r['peak'] / b['peak']:.2f} | "
                     f"{r['seconds'] * 1e3:.1f} | {r['seconds'] / b['seconds']:.2f} | {r['loss']:.6f} | "
                     f"{r['grad_norm']:.6f} |")
    path = write_result("recompute", "\n".join(lines))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
