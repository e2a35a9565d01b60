"""``make bench``: eager vs Inductor vs ascend on megatron-core GPT models, one process, side by side.

Per model and backend: peak memory of one forward+backward (profiler CPU memory events), median training step
(forward, backward, AdamW) after warm-up, and cold compile time (first step minus the median step, with
Inductor's caches off). Writes ``bench/results/three_way.md`` and prints it.

    python -m bench [--quick] [--models demo,seq1024] [--backends eager,inductor,ascend]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # cold compiles, every time

import torch  # noqa: E402

from bench.harness import Row, bar_plot, markdown_table, median_seconds, peak_bytes, write_result  # noqa: E402

# name -> (config factory name, seq, micro-batch, vocab)
MODELS = {
    "demo": ("gpt_config", 128, 4, 256),
    "seq1024": ("gpt_config", 1024, 2, 256),
    "seq2048": ("gpt_config", 2048, 2, 256),
    "llama-seq1024": ("llama_config", 1024, 2, 256),
}


def measure(model_name: str, backend: str, repeats: int) -> Row:
    from megatron_glue.capture import models

    factory, seq, batch, vocab = MODELS[model_name]
    config = getattr(models, factory)()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = models.build_gpt_model(config, vocab, seq, seed=0)
    if backend != "eager":
        model = torch.compile(model, backend=backend)
    data = models.synthetic_batch(batch, seq, vocab, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train_step():
        models.train_step(model, data, opt)

    def fwd_bwd():
        opt.zero_grad(set_to_none=True)
        models.loss_fn(model, data).backward()

    t0 = time.perf_counter()
    train_step()  # compiles (when compiled) and builds optimizer state
    first = time.perf_counter() - t0
    train_step()  # warm-up: first-touch allocations, lazy inits inside Megatron
    step_s = median_seconds(train_step, repeats)
    peak = peak_bytes(fwd_bwd)
    graphs = None if backend == "eager" else torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return Row(f"{model_name} (s{seq} b{batch})", backend, peak, step_s, max(first - step_s, 0.0), graphs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--models", default="demo,seq1024,seq2048")
    p.add_argument("--backends", default="eager,inductor,ascend")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="demo model only, 3 repeats")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.repeats = "demo", 3

    import megatron_glue
    from megatron_glue.capture import models

    megatron_glue.adapt()
    models.init_single_process()
    rows = []
    for model_name in args.models.split(","):
        for backend in args.backends.split(","):
            print(f"measuring {model_name} / {backend} ...", flush=True)
            rows.append(measure(model_name, backend, args.repeats))
    header = (
        f"# eager vs Inductor vs ascend (megatron-core GPTModel, 2 layers, hidden 128, 4 heads, fp32)\n\n"
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} steps; peak = profiler CPU memory events over one forward+backward; "
        f"compile = first step − median step, caches off.\n"
    )
    text = header + "\n" + markdown_table(rows)
    path = write_result("three_way", text)
    plot = bar_plot(rows, "eager vs Inductor vs ascend, megatron-core GPT (fp32, CPU)", path.with_suffix(".png"))
    print("\n" + text + f"\n\nwritten to {path} and {plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
