"""Peak memory of `npu-compile convert`: a random-init Llama of 8 layers (hidden 1024, 16 heads, 4 key/value heads,
ffn 2816, fp32: 45 MiB a layer), converted hf -> mg and mg -> hf, each in a fresh process.

Measured: the process's peak resident set (the kernel's high-water mark, VmHWM, which getrusage's ru_maxrss
reports) above its resident set just before the conversion starts. Before that point the process has imported
everything and converted a tiny model of the same family once (hidden 64, 2 layers: lazy imports and one-time
set-up are behind it, and the allocator keeps next to nothing of it); the high-water mark is then reset to the current RSS (/proc/self/clear_refs; where that is refused,
ru_maxrss is taken as it is, which can only overstate the peak). The converter streams: the budget is two layers'
worth of tensor bytes.

Writes bench/results/convert_memory.md and prints it.

    python -m bench.convert_memory [--hidden 1024] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

MiB = 2**20
# direction -> (load model type, save model type, extra convert flags)
DIRECTIONS = {
    "hf -> mg (torch_dist)": ("hf", "mg", []),
    "mg -> hf (torch_dist)": ("mg", "hf", []),
    "hf -> mg (torch, TP=2 PP=2)": ("hf", "mg", ["--ckpt-format", "torch", "--target-tensor-parallel-size", "2",
                                                 "--target-pipeline-parallel-size", "2"]),
    "mg -> hf (torch, TP=2 PP=2)": ("mg", "hf", []),
}


def llama_config(hidden: int, layers: int, vocab: int = 1024):
    import transformers as tf

    heads = max(hidden // 64, 4)
    return tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4 // 64 * 64,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(heads // 4, 2),
                          max_position_embeddings=256, tie_word_embeddings=False, head_dim=hidden // heads)


def save_hf(folder: str, hidden: int, layers: int) -> dict:
    """A random-init Llama saved with save_pretrained; returns its sizes in bytes."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(hidden, layers))
    model.save_pretrained(folder)
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.model.embed_tokens.weight
    return {"layer_bytes": layer, "model_bytes": total, "vocab_bytes": vocab.numel() * vocab.element_size()}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _child(argv: list[str]) -> None:
    """In the fresh process: warm up on the small model, reset the high-water mark, convert, report JSON."""
    import resource

    from megatron_glue.convert import main

    warm, real = argv.index("--warm"), argv.index("--real")
    if main(argv[warm + 1:real]) != 0:
        raise SystemExit("the warm-up conversion failed")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set (VmHWM) to the current one
        reset = True
    except OSError:
        reset = False
    baseline = _rss("VmRSS")
    if main(argv[real + 1:]) != 0:
        raise SystemExit("the conversion failed")
    peak = _rss("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"baseline": baseline, "peak": peak, "reset": reset}))


def convert_in_fresh_process(load: str, save: str, load_type: str, save_type: str, flags: list[str],
                             warm_load: str, warm_save: str) -> dict:
    """{"baseline", "peak", "above"}: bytes, the conversion `load` -> `save` run in a new Python process."""
    def command(src, dst):
        return ["--load-model-type", load_type, "--save-model-type", save_type, "--load-dir", src, "--save-dir", dst,
                *flags]

    env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS="1", TQDM_DISABLE="1")
    out = subprocess.run([sys.executable, "-m", "bench.convert_memory", "--child", "--warm",
                          *command(warm_load, warm_save), "--real", *command(load, save)],
                         capture_output=True, text=True, env=env, check=False,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if out.returncode != 0:
        raise RuntimeError(f"the conversion process failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["above"] = result["peak"] - result["baseline"]
    return result


def measure(root: str, hidden: int = 1024, layers: int = 8, directions=tuple(DIRECTIONS)) -> dict:
    """Sizes of the model and, per direction, its memory figures (bytes)."""
    sizes = save_hf(os.path.join(root, "hf"), hidden, layers)
    save_hf(os.path.join(root, "hf-small"), 64, 2)  # the warm-up model: the same family, tiny
    results = {}
    for name in directions:
        load_type, save_type, flags = DIRECTIONS[name]
        fmt = "torch" if "torch," in name else "dist"
        mg, warm_mg = os.path.join(root, f"mg-{fmt}"), os.path.join(root, f"mg-small-{fmt}")
        if load_type == "hf":
            src, dst, warm_src, warm_dst = os.path.join(root, "hf"), mg, os.path.join(root, "hf-small"), warm_mg
        else:
            src, dst, warm_src, warm_dst = mg, os.path.join(root, f"back-{fmt}"), warm_mg, \
                os.path.join(root, f"back-small-{fmt}")
        results[name] = convert_in_fresh_process(src, dst, load_type, save_type, flags, warm_src, warm_dst)
    return {"sizes": sizes, "hidden": hidden, "layers": layers, "results": results}


def table(m: dict) -> str:
    layer, model = m["sizes"]["layer_bytes"], m["sizes"]["model_bytes"]
    lines = [f"Llama, {m['layers']} layers, hidden {m['hidden']}, fp32: {model / MiB:.0f} MiB in all, "
             f"{layer / MiB:.1f} MiB a layer; budget (streaming): 2 layers = {2 * layer / MiB:.1f} MiB.", "",
             "| conversion | RSS before (MiB) | peak RSS above it (MiB) | in layers |",
             "|---|---:|---:|---:|"]
    for name, r in m["results"].items():
        lines.append(f"| {name} | {r['baseline'] / MiB:.0f} | {r['above'] / MiB:.1f} | {r['above'] / layer:.2f} |")
    return "\n".join(lines) + "\n"


def plot(m: dict, path) -> None:
    """Peak above the baseline per conversion, in MiB, beside the 2-layer budget and the model's size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer, model = m["sizes"]["layer_bytes"], m["sizes"]["model_bytes"]
    names = list(m["results"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(names)), [m["results"][n]["above"] / MiB for n in names], color="tab:blue")
    ax.axhline(2 * layer / MiB, color="tab:red", linestyle="--", label="budget: 2 layers (the legacy write holds one stage's output shards on top)")
    ax.axhline(model / MiB, color="gray", linestyle=":", label="the whole model")
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylabel("peak resident MiB above the start")
    ax.set_title(f"npu-compile convert, Llama {m['layers']} layers, hidden {m['hidden']}, fp32")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        _child(argv[1:])
        return
    p = argparse.ArgumentParser(prog="python -m bench.convert_memory")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    a = p.parse_args(argv)
    import platform

    import torch
    from megatron.core.package_info import __version__ as mcore

    from bench.harness import write_result

    with tempfile.TemporaryDirectory(prefix="convert_memory_") as root:
        m = measure(root, a.hidden, a.layers)
    text = (f"# Peak memory of npu-compile convert\n\ntorch {torch.__version__}, megatron-core {mcore}, "
            f"{platform.machine()}. Each conversion in a fresh process; the peak resident set (VmHWM) above the "
            "one just before the conversion, after imports and a warm-up conversion of a tiny model.\n\n" + table(m))
    out = write_result("convert_memory", text)
    plot(m, out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
