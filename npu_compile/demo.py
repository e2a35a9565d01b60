"""``npu-compile demo``: train a small megatron-core GPT eagerly and with ``backend="ascend"``, side by side.

Both runs start from the same weights and see the same batches; the demo prints the two loss curves' largest
difference, what the backend did to the graph (from report.json) and where the dumps are.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

import npu_compile


def _train(model, batches, desc: str) -> tuple[list[float], list[float]]:
    from megatron_glue.capture import models

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, seconds = [], []
    for batch in tqdm(batches, desc=desc, unit="step", leave=True):
        t0 = time.perf_counter()
        losses.append(models.train_step(model, batch, opt))
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def run(config: str, steps: int, dump_dir: str, options: dict) -> int:
    import megatron_glue
    from megatron_glue.capture import models

    shutil.rmtree(dump_dir, ignore_errors=True)  # this run's graphs only
    applied = megatron_glue.adapt()
    models.init_single_process()
    make_config = models.llama_config if config == "llama" else models.gpt_config
    seq, batch, vocab = 128, 4, 256
    print(f"npu_compile demo: megatron-core GPTModel ({config}: 2 layers, hidden 128, 4 heads, seq {seq}, "
          f"batch {batch}, causal mask), {steps} AdamW steps, on {torch.get_num_threads()} CPU threads")
    print(f"Megatron adaptations applied ({len(applied)}): {', '.join(applied)}")
    batches = [models.synthetic_batch(batch, seq, vocab, seed=i) for i in range(steps)]

    eager_losses, _ = _train(models.build_gpt_model(make_config(), vocab, seq, seed=0), batches, "eager ")
    torch._dynamo.reset()
    compiled = torch.compile(
        models.build_gpt_model(make_config(), vocab, seq, seed=0),
        backend="ascend",
        options={"dump_dir": dump_dir, **options},
    )
    asc_losses, asc_seconds = _train(compiled, batches, "ascend")

    diffs = [abs(a - b) for a, b in zip(eager_losses, asc_losses)]
    print(f"\nloss  eager {eager_losses[0]:.4f} → {eager_losses[-1]:.4f}   ascend {asc_losses[0]:.4f} → "
          f"{asc_losses[-1]:.4f}")
    print(f"loss parity: max |eager − ascend| over {steps} steps = {max(diffs):.3e} "
          f"(step {diffs.index(max(diffs))})")
    print(f"first ascend step (includes compile): {asc_seconds[0]:.1f} s; later steps median "
          f"{sorted(asc_seconds[1:])[len(asc_seconds[1:]) // 2] * 1e3:.1f} ms")

    reports = sorted(Path(dump_dir).glob("*/report.json"))
    print(f"\nWhat the backend did ({len(reports)} compiled graph(s)):")
    for path in reports:
        r = json.loads(path.read_text())
        mem = r["memory"]
        ops = ", ".join(f"{k}×{v}" for k, v in list(r["lowered_ops"].items())[:8])
        print(f"  graph {r['graph_id']}: target {r['target']}, {r['graph_breaks']} graph break(s), "
              f"compiled {' + '.join(r['graphs'])}")
        fused = ", ".join(f"{rule}×{n}" for rule, n in r["fusions"].items() if n) or "none matched"
        print(f"    fused sites: {fused}; sites left unfused: {len(r['unfused'])}")
        print(f"    memory (planned from the graphs): live-bytes peak {_mib(mem['peak_bytes_before'])} as partitioned, "
              f"{_mib(mem['lower_bound_bytes'])} as compiled, static plan {_mib(mem['peak_bytes_after'])}; "
              f"activations saved for backward {_mib(mem['saved_activation_bytes'])}")
        print(f"    collectives in the graphs: {r['comm']['collectives']}; most used ops: {ops}")
    print(f"\nDumps: {os.path.abspath(dump_dir)}/<graph-id>/ holds the code after every stage "
          f"(dynamo/, joint/, forward/, backward/) and report.json")
    ok = max(diffs) < 1e-3
    print("OK: compiled training follows eager." if ok else "MISMATCH: compiled training diverged from eager.")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="npu-compile demo", description=__doc__)
    p.add_argument("--config", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--dump-dir", default="npu_compile_dump/demo")
    p.add_argument("--option", action="append", default=[], metavar="KEY=JSON",
                   help='extra backend option, e.g. --option memory_budget=0.5 --option \'fusions=["rms_norm"]\'')
    args = p.parse_args(argv)
    options = {}
    for item in args.option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value) if value else None
    npu_compile.config.validate(options)
    return run(args.config, args.steps, args.dump_dir, options)
