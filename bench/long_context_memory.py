"""Memory at length: peak memory of one training step (forward + backward) of a small megatron-core GPT at 8K, 16K
and 32K tokens per row, packed rows of several documents, eager Megatron with its dense reset mask against the
compiled step (varlen attention, no s×s tensor) and context parallelism over 2 gloo processes; and what
``memory_budget="auto"``'s planner predicts for each compiled graph.

megatron-core GPTModel (local layer spec), 2 layers, hidden 64, 2 heads (head dim 32), LayerNorm + GeLU with
biases, learned positions, vocab 1024, micro-batch 1, fp32, dropout 0. Each point is one fresh process (two for
CP), run one after the other (``megatron_glue.capture.distributed.run_on_ranks``, one CPU thread a rank); in it,
step 1 compiles, step 2 warms up and step 3 is measured: the profiler's CPU memory events over forward + backward,
peak bytes above the level at the step's start (``bench.harness.peak_bytes``, as bench/memory.py measures).

Columns:
    eager        Megatron as written over its dense reset mask (``--reset-attention-mask``: megatron-core's
                 GPTDataset mask [b, 1, s, s] bool, built before the step as the dataset does), unfused core
                 attention (scores b·heads·s·s fp32). Its figure adds the mask itself (an input of the step, so
                 not in the step's peak); Megatron's baddbmm input buffer (b·heads·s·s) is in the step's peak: on
                 CPU the "cpu" adaptation fresh_global_buffer allocates it per call.
    packed       torch.compile(backend="ascend", target reference; the model one flat graph, its layers inlined:
                 bench.harness.one_flat_graph_groups), the same rows as megatron-core's
                 PackedSeqParams (the compiled job's --reset-attention-mask): varlen attention per document.
    causal       the same, compiled, each row one document (causal): the baseline of the CP columns.
    ulysses/ring CP = 2 (``--context-parallel-algo ulysses_cp_algo`` / ``megatron_cp_algo``), compiled, each rank
                 holding s/2 tokens of one causal row (packed rows under CP are refused in this job:
                 docs/context_parallel.md); per-rank peak, the larger of the two ranks.

Every compiled point runs under ``memory_budget="auto"`` with ``device_memory`` = CAP: the planner's figure is
report.json ``memory.planned_peak_bytes`` at the budget it chose, and a point whose plan does not fit CAP is
refused at its first call, before any step runs (``MemoryFitError``: its planned peak per budget is what the
table shows). An eager point that does not fit is not run: its peak is computed from the tensors Megatron's
attention keeps (formula in the results), the formula checked against the eager points that were measured.

Writes bench/results/long_context_memory.md and .png.

    python -m bench.long_context_memory [--seqs 8192,16384,32768] [--eager-seqs 1024,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HIDDEN, HEADS, LAYERS, VOCAB, BATCH, EOD = 64, 2, 2, 1024, 1, 0
CAP = 3 * 2**30 + 2**29  # device_memory of memory_budget="auto": a plan above it is refused before its step runs
MiB, GiB = 2**20, 2**30
KINDS = ("eager", "packed", "causal", "ulysses", "ring")


def documents(seq: int, seed: int = 0) -> list[int]:
    """Lengths of the documents packed into one row: uniform in [s/16, 3s/16) tokens (about 8 a row), the last
    cut at the row's end."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < seq:
        n = int(torch.randint(seq // 16, 3 * seq // 16, (1,), generator=g))
        n = min(n, seq - total)
        lengths.append(n)
        total += n
    return lengths


def batch(seq: int, packed: bool) -> dict:
    """One row of `seq` tokens (+ its labels): documents ending in EOD when `packed`, position ids restarting at
    each document (--reset-position-ids), or one causal document."""
    import torch

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, VOCAB, (BATCH, seq + 1), generator=g)
    positions = torch.arange(seq).expand(BATCH, seq).clone()
    if packed:
        end = 0
        for n in documents(seq):
            positions[:, end:end + n] = torch.arange(n)
            end += n
            tokens[:, end - 1] = EOD
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "position_ids": positions}


def _model(cp: int, algorithm: str | None):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_glue.capture import models, quiet_megatron
    from megatron_glue.capture.context_parallel import cp_layer_spec

    config = models.gpt_config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_layers=LAYERS,
                               context_parallel_size=cp)
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    if algorithm:
        spec = cp_layer_spec(spec, algorithm)
    torch.manual_seed(0)
    with quiet_megatron():
        return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=MAX_SEQ,
                        position_embedding_type="learned_absolute")


MAX_SEQ = 32768


RSS_LIMIT = 5 * 2**30  # a process past it ends itself (the machine is shared)


def _rss_guard() -> None:
    """A thread that ends this process when its resident memory passes RSS_LIMIT."""
    import threading

    page = os.sysconf("SC_PAGE_SIZE")

    def watch():
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * page
            if rss > RSS_LIMIT:
                sys.stderr.write(f"long_context_memory: resident memory {rss / GiB:.2f} GiB passed "
                                 f"{RSS_LIMIT / GiB:.0f} GiB; ending the point\n")
                os._exit(3)
            time.sleep(0.02)

    threading.Thread(target=watch, daemon=True).start()


def point(kind: str, seq: int) -> dict:
    """One bench point in this process (a run_on_ranks worker): compile, warm up, measure."""
    _rss_guard()
    import torch

    from bench.harness import one_flat_graph_groups, peak_bytes
    from megatron_glue.capture.distributed import init_distributed

    cp = 2 if kind in ("ulysses", "ring") else 1
    init_distributed(1, context_parallel_size=cp, groups=one_flat_graph_groups())  # the step one graph, one plan
    from megatron.core import parallel_state

    from megatron_glue.training.gpt import on_this_cp_rank, packed_documents
    from npu_compile.debug.report import collect
    from npu_compile.passes.recompute import MemoryFitError

    algorithm = {"ulysses": "ulysses_cp_algo", "ring": "megatron_cp_algo"}.get(kind)
    model = _model(cp, algorithm)
    data = batch(seq, packed=kind in ("eager", "packed"))
    mask_bytes = 0
    if kind == "eager":
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

        # the dataset's mask (with --reset-attention-mask), built before the step as the data loader builds it
        data["attention_mask"] = torch.stack([_get_ltor_masks_and_position_ids(row, EOD, False, True, False, True)[0]
                                              for row in data["tokens"]])
        mask_bytes = data["attention_mask"].untyped_storage().nbytes()
    elif kind == "packed":
        data = packed_documents(data, EOD)
    data = on_this_cp_rank(data)
    kwargs = {k: data[k] for k in ("packed_seq_params", "attention_mask") if data.get(k) is not None}
    net = model
    if kind != "eager":
        net = torch.compile(model, backend="ascend",
                            options={"target": "reference", "memory_budget": "auto", "device_memory": CAP,
                                     "cache": False})

    def fwd_bwd():
        for p in model.parameters():
            p.grad = None
        if kind == "eager":
            with torch._dynamo.config.patch(disable=True):  # Megatron's jit_fuser is torch.compile: eager stays eager
                loss = net(data["tokens"], data["position_ids"], kwargs.get("attention_mask"),
                           labels=data["labels"]).mean()
        else:
            loss = net(data["tokens"], data["position_ids"], None, labels=data["labels"], **kwargs).mean()
        loss.backward()
        return loss.detach()

    row = {"kind": kind, "seq": seq, "rank": parallel_state.get_context_parallel_rank(), "mask": mask_bytes}
    start = time.perf_counter()
    with collect() as reports:
        try:
            row["loss"] = float(fwd_bwd())  # compiles
        except MemoryFitError as e:
            row.update(refused=True, plans=[(p.budget, p.peak) for p in e.plans])
            return row
        fwd_bwd()  # warm-up
    row["first_two_s"] = time.perf_counter() - start
    row["peak"] = peak_bytes(fwd_bwd)
    if kind != "eager":
        (report,) = reports
        row.update(planned=report.memory["planned_peak_bytes"], budget=report.budget["chosen"],
                   graph_breaks=report.graph_breaks, fusions=dict(report.fusions),
                   largest=max((t["bytes"] for t in report.memory["peak_tensors"]), default=0),
                   plans=[(p["budget"], p["planned_peak_bytes"]) for p in report.budget["tried"]])
    return row


def measure(kind: str, seq: int) -> list[dict]:
    from bench.long_context_memory import point as run_point  # by its module's name, also under `python -m`
    from megatron_glue.capture.distributed import run_on_ranks

    world = 2 if kind in ("ulysses", "ring") else 1
    return run_on_ranks(run_point, kind, seq, world_size=world, timeout=1500)


# -- eager Megatron's figure where it is not run ------------------------------------------------------------------

def eager_formula(seq: int) -> dict:
    """Eager Megatron's step at `seq` from the s×s tensors of its unfused attention (b rows, heads, L layers, fp32;
    u = b·heads·s²·4 bytes): the dense mask, b·s² bytes (bool, an input of the step); and at the step's peak, the
    forward of the last layer's softmax, (L + 3)·u: the probabilities each earlier layer saved for its backward
    (L − 1), Megatron's baddbmm input buffer (on CPU a fresh one per call: adaptation fresh_global_buffer; on the
    device Megatron keeps it between steps), the baddbmm result, the masked scores (masked_fill out of place) and
    the probabilities. The backward holds at most as many (L saved + the softmax's input and output grads).
    The part linear in s (embeddings, logits, their grads) is fitted to the measured points."""
    u = BATCH * HEADS * seq * seq * 4
    return {"mask": BATCH * seq * seq, "quadratic": (LAYERS + 3) * u, "u": u}


def fit_linear(rows: list[dict]) -> float:
    """Bytes per token of the eager step beyond its s² part, least squares over the measured points."""
    xs = [(r["seq"], r["peak"] - eager_formula(r["seq"])["quadratic"]) for r in rows]
    return sum(s * y for s, y in xs) / sum(s * s for s, _ in xs)


def fit_both(rows: list[dict]) -> tuple[float, float]:
    """Least squares of peak = a·u + c·s over the measured points: a, the count of u-sized tensors the data say."""
    import numpy as np

    a = np.array([[eager_formula(r["seq"])["u"], r["seq"]] for r in rows], dtype=float)
    y = np.array([r["peak"] for r in rows], dtype=float)
    (count, per_token), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(count), float(per_token)


# -- the table ----------------------------------------------------------------------------------------------------

def _fmt(n: float | None) -> str:
    return "–" if n is None else (f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB")


def table(results: dict, seqs: list[int], eager_seqs: list[int], per_token: float) -> str:
    head = ["tokens per row", "eager Megatron, dense mask (step + mask)", "compiled packed (varlen)",
            "compiled causal, CP 1", "compiled CP 2 Ulysses (per rank)", "compiled CP 2 ring (per rank)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for seq in sorted(set(seqs) | set(eager_seqs)):
        cells = [f"{seq // 1024}K" if seq % 1024 == 0 else str(seq)]
        e = results.get(("eager", seq))
        f = eager_formula(seq)
        if e:
            (r,) = e
            predicted = f["quadratic"] + per_token * seq + f["mask"]
            cells.append(f"**{_fmt(r['peak'] + r['mask'])}** measured (step {_fmt(r['peak'])} + mask "
                         f"{_fmt(r['mask'])}; formula {_fmt(predicted)})")
        else:
            total = f["quadratic"] + per_token * seq + f["mask"]
            cells.append(f"**{_fmt(total)}** not run, computed: {LAYERS + 3}·u {_fmt(f['quadratic'])} + "
                         f"{per_token:.0f} B·s + mask {_fmt(f['mask'])}")
        for kind in KINDS[1:]:
            ranks = results.get((kind, seq))
            if seq not in seqs or ranks is None:
                cells.append("–")
                continue
            if any(r.get("refused") for r in ranks):
                r = max(ranks, key=lambda r: min(p for _, p in r["plans"]))
                least = min(r["plans"], key=lambda p: p[1])
                cells.append(f"not run: planner refuses under {_fmt(CAP)} (planned {_fmt(r['plans'][0][1])} at "
                             f"budget 1.0, least {_fmt(least[1])} at {least[0]})")
                continue
            r = max(ranks, key=lambda r: r["peak"])
            cells.append(f"**{_fmt(r['peak'])}**; planned {_fmt(r['planned'])} (×{r['planned'] / r['peak']:.3f}), "
                         f"budget {r['budget']}; largest buffer {_fmt(r['largest'])}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, seqs: list[int], eager_seqs: list[int], per_token: float, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    every = sorted(set(seqs) | set(eager_seqs))
    measured, computed = [], []
    for seq in every:
        e = results.get(("eager", seq))
        f = eager_formula(seq)
        if e:
            measured.append((seq, (e[0]["peak"] + e[0]["mask"]) / MiB))
        computed.append((seq, (f["quadratic"] + per_token * seq + f["mask"]) / MiB))
    ax.plot(*zip(*computed), "k--", label="eager Megatron, dense mask: computed")
    if measured:
        ax.plot(*zip(*measured), "ko", label="eager Megatron, dense mask: measured")
    colors = {"packed": "tab:blue", "causal": "tab:green", "ulysses": "tab:orange", "ring": "tab:red"}
    names = {"packed": "compiled packed (varlen)", "causal": "compiled causal, CP 1",
             "ulysses": "compiled CP 2 Ulysses (per rank)", "ring": "compiled CP 2 ring (per rank)"}
    for kind in KINDS[1:]:
        got = [(s, max(r["peak"] for r in results[(kind, s)]) / MiB) for s in seqs
               if (kind, s) in results and not any(r.get("refused") for r in results[(kind, s)])]
        planned = [(s, max(r.get("planned") or r["plans"][0][1] for r in results[(kind, s)]) / MiB) for s in seqs
                   if (kind, s) in results]
        if got:
            ax.plot(*zip(*got), "o-", color=colors[kind], label=f"{names[kind]}: measured")
        if planned:
            ax.plot(*zip(*planned), "x:", color=colors[kind], label=f"{names[kind]}: planned")
    ax.axhline(CAP / MiB, color="grey", linewidth=0.8)
    ax.text(every[-1], CAP / MiB * 1.1, "device_memory of the auto runs", fontsize=7, color="grey", ha="right")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(every, [f"{s // 1024}K" for s in every])
    ax.set_xlabel("tokens per row")
    ax.set_ylabel("peak MiB, one forward + backward (per rank)")
    ax.set_title(f"megatron-core GPT, {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, fp32, CPU")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def notes(results: dict, eager_seqs: list[int], per_token: float) -> list[str]:
    """The eager formula against the measured eager points, and how the planner's figures compare."""
    eager_rows = [results[("eager", s)][0] for s in eager_seqs if ("eager", s) in results]
    out = []
    if eager_rows:
        count, _ = fit_both(eager_rows) if len(eager_rows) > 1 else (float("nan"), 0.0)
        errors = []
        for r in eager_rows:
            f = eager_formula(r["seq"])
            errors.append(f"{r['seq'] // 1024 if r['seq'] >= 1024 else r['seq']}{'K' if r['seq'] >= 1024 else ''}: "
                          f"{(f['quadratic'] + per_token * r['seq']) / r['peak'] - 1:+.1%}")
        out += [
            f"**Eager formula** (u = b·heads·s²·4 B, the size of one fp32 score tensor; {LAYERS} layers): step peak "
            f"= {LAYERS + 3}·u + c·s, the mask b·s² B beside it (an input of the step). At the peak, the forward of "
            f"the last layer's softmax: the probabilities each earlier layer saved for its backward ({LAYERS - 1}), "
            "Megatron's baddbmm input buffer (on CPU a fresh one per call, adaptation `fresh_global_buffer`; on the "
            "device Megatron keeps it between steps), the baddbmm result, the masked scores (`masked_fill` out of "
            f"place) and the probabilities. c = {per_token:.0f} B per token is fitted to the measured points (the "
            "embeddings, logits and their grads). A free least-squares fit of peak = a·u + c·s over the measured "
            f"points gives a = {count:.2f} (the formula says {LAYERS + 3}). Formula against measured step peak: "
            + ", ".join(errors) + ". Where eager is not run the figure is this formula: at 32K, u alone is "
            f"{_fmt(eager_formula(32768)['u'])}.", ""]
    def peak(kind, seq):
        ranks = results.get((kind, seq))
        if not ranks or any(r.get("refused") for r in ranks):
            return None
        return max(r["peak"] for r in ranks)

    top = max((s for (k, s) in results if k == "packed"), default=None)
    if top and all(peak(k, top) for k in ("packed", "causal", "ulysses")):
        f = eager_formula(top)
        eager_top = f["quadratic"] + per_token * top + f["mask"]
        if ("eager", top) in results:
            eager_top = results[("eager", top)][0]["peak"] + f["mask"]
        packed_top, causal_top, ulysses_top = peak("packed", top), peak("causal", top), peak("ulysses", top)
        low = min(s for (k, s) in results if k == "packed")
        ring_rows = results.get(("ring", top), [])
        if any(r.get("refused") for r in ring_rows):
            least = min((p for r in ring_rows if r.get("refused") for p in r["plans"]), key=lambda p: p[1])
            ring = (f"at {top // 1024}K the planner refuses it before a step runs: no budget fits "
                    f"{_fmt(CAP)} (the least, {_fmt(least[1])} at budget {least[0]})")
        else:
            ring = f"{_fmt(peak('ring', top))} a rank at {top // 1024}K" if ring_rows else "not run here"
        out += [
            "**What it shows.**", "",
            f"- Packed rows, compiled: {_fmt(packed_top)} at {top // 1024}K against eager Megatron's "
            f"{_fmt(eager_top)} ({'measured' if ('eager', top) in results else 'computed'}), "
            f"{eager_top / packed_top:.0f}× less; the largest buffer live at the peak "
            f"{_fmt(results[('packed', top)][0]['largest'])} (one layer's s×s fp32 scores would be "
            f"{_fmt(eager_formula(top)['u'])}): varlen attention runs each document on its own.",
            f"- Compiled causal rows (one document a row) grow ×{causal_top / peak('causal', low):.1f} from "
            f"{low // 1024}K to {top // 1024}K (packed rows: ×{packed_top / peak('packed', low):.1f}), their "
            f"largest buffer {_fmt(results[('causal', top)][0]['largest'])}: megatron-core's `DotProductAttention` "
            "given no mask asks `get_default_causal_mask(s)` (`triu(ones(s, s, bool), 1)`), which the rule "
            "`causal_mask` folds into the fused attention's causal flag, so no s×s tensor is built or kept.",
            f"- CP = 2 Ulysses: {_fmt(ulysses_top)} a rank at {top // 1024}K, ×{causal_top / ulysses_top:.1f} less "
            "than CP 1: each rank holds half the sequence outside attention and half the heads inside it. Ring "
            "attention: each step is the fused `attention_with_lse` (docs/context_parallel.md), which keeps q, k, "
            "v, out and lse for the backward, not the step's fp32 scores ((s/CP)² a head); " + ring + ".",
            "- The CP columns run causal rows (one document a row); packed rows under CP are implemented "
            "(docs/context_parallel.md) and not measured here.", ""]
    ratios = [(k, s, r["planned"] / r["peak"]) for (k, s), ranks in results.items() if k != "eager"
              for r in ranks if not r.get("refused")]
    if ratios:
        lo, hi = min(x[2] for x in ratios), max(x[2] for x in ratios)
        out += [f"**Planner** (`memory_budget=\"auto\"`, `device_memory` {_fmt(CAP)}; planned = report.json "
                f"`memory.planned_peak_bytes` at the budget chosen, per rank): planned / measured from {lo:.3f} to "
                f"{hi:.3f} over the {len(ratios)} compiled measurements (every rank). What the plan counts: every "
                "buffer of the compiled forward + backward (the CP all-to-alls' outputs are graph nodes like any "
                "other), the scratch of the backend's own kernels (run on FakeTensors of the node's shapes), and "
                "for varlen attention, whose scratch depends on the documents (data the graph does not have), one "
                "document a row, the longest a row can hold (passes/memory.py; it planned 0 for it before: "
                "tests/passes/test_varlen_memory_plan.py). Not counted: scratch inside aten kernels (torch's CPU "
                "flash-attention buffers inside the fused attention's fast path, a few hundred KiB a thread, not "
                "growing with s) and gloo's: the CP ranks run the same graph, yet one rank of a pair can measure a "
                "few MiB above the other (the table shows the larger), the size of a collective's buffers, which "
                "fits gloo's worker thread releasing a finished collective's tensors after the caller's wait has "
                "returned (megatron_glue/capture/distributed.py, end_process_group) — a race, not a term the plan "
                "could add. The eager step has no plan: it is not compiled.", ""]

    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.long_context_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="8192,16384,32768", help="tokens per row of the compiled points")
    p.add_argument("--eager-seqs", default="1024,2048,4096,8192",
                   help="tokens per row where eager Megatron runs (its s×s tensors must fit the machine)")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--raw", default=os.path.join(tempfile.gettempdir(), "long_context_memory.json"),
                   help="where each point's figures are kept as they come (JSON)")
    p.add_argument("--from-raw", action="store_true", help="write the table and plot from --raw, running nothing")
    args = p.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    eager_seqs = [int(s) for s in args.eager_seqs.split(",")]
    results, started = {}, datetime.datetime.now(datetime.timezone.utc)
    if args.from_raw:
        with open(args.raw) as f:
            raw = json.load(f)
        results = {(k, s): rows for k, s, rows in raw["points"]}
        started, command, commit = datetime.datetime.fromisoformat(raw["started"]), raw["command"], raw["commit"]
    else:
        command = " ".join(argv if argv is not None else sys.argv[1:])
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    for kind in ([] if args.from_raw else args.kinds.split(",")):
        for seq in (eager_seqs if kind == "eager" else seqs):
            t0 = time.perf_counter()
            results[(kind, seq)] = measure(kind, seq)
            with open(args.raw, "w") as f:
                json.dump({"started": started.isoformat(), "command": command, "commit": commit,
                           "points": [[k, s, rows] for (k, s), rows in results.items()]}, f)
            r = max(results[(kind, seq)], key=lambda r: r.get("peak", 0))
            print(f"{kind} {seq}: " + ("refused by the planner, plans " + str(r["plans"]) if r.get("refused") else
                  f"peak {r['peak'] / MiB:.1f} MiB, planned {_fmt(r.get('planned'))}") + f" ({time.perf_counter() - t0:.0f} s)", flush=True)
    eager_rows = [results[("eager", s)][0] for s in eager_seqs if ("eager", s) in results]
    per_token = fit_linear(eager_rows) if eager_rows else 0.0
    for r in eager_rows:
        f = eager_formula(r["seq"])
        print(f"eager {r['seq']}: measured step {r['peak']} B, formula {f['quadratic'] + per_token * r['seq']:.0f} B")
    import torch

    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    text = "\n".join([
        "# Memory at length: packed rows and context parallelism against eager Megatron's dense mask", "",
        f"megatron-core GPTModel (local spec), {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads (head dim "
        f"{HIDDEN // HEADS}), LayerNorm + GeLU with biases, vocab {VOCAB}, micro-batch {BATCH}, **fp32**, dropout 0; "
        "packed rows: documents of uniform length in [s/16, 3s/16) (about 8 a row), position ids restarting per "
        "document. One training step's forward + backward: the profiler's CPU memory events, peak bytes above the "
        "step's start, step 3 of a fresh process (bench.harness.peak_bytes). CP: 2 gloo processes, the larger rank.",
        "",
        f"Machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} cores shared with other jobs), torch "
        f"{torch.__version__}, one thread per process; run {started:%Y-%m-%d %H:%M} UTC at commit {commit}: "
        f"`{' '.join(['python -m bench.long_context_memory', command]).strip()}`"
        + (f" (this text and plot written from that run's figures at commit {here})" if args.from_raw and here != commit
           else "") + ".",
        "", table(results, seqs, eager_seqs, per_token), "", *notes(results, eager_seqs, per_token),
    ])
    from bench.harness import write_result

    path = write_result("long_context_memory", text)
    plot(results, seqs, eager_seqs, per_token, path.with_suffix(".png"))
    print("\n" + text + f"\nwritten to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
