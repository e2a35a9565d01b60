"""transformers' own model classes, random-init and tiny, compiled with ``backend="ascend"``: which rules fuse
their code, and whether the compiled model equals eager.

Nine families as transformers 5 writes them (no downloads: configs built here), hidden 64, 2 layers, 4 heads
(2 kv heads where the family has GQA), vocabulary 128, sequence 16, fp32, every dropout 0. ``run_case`` runs one
model eagerly and compiled from the same weights, in one of three scenarios: training (loss.backward) with and
without ``use_cache``, and inference with the KV cache (a prefill, then one decode step on the cache).
``tests/passes/test_hf_models.py`` asserts on it; ``python -m bench.hf_fusions`` writes the fusion counts per
family to ``bench/results/hf_fusions.md`` (with ``--before FILE``, beside counts saved from another checkout).

    python -m bench.hf_fusions [--json counts.json] [--before before.json]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from collections import Counter
from pathlib import Path

import torch

VOCAB, SEQ, BATCH, LAYERS = 128, 16, 2, 2
SCENARIOS = ("train", "train_cache", "infer_cache")
IMPLEMENTATIONS = ("eager", "sdpa")


def _config(family: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                  num_attention_heads=4, max_position_embeddings=64, attention_dropout=0.0)
    gqa = dict(num_key_value_heads=2)
    configs = {
        "llama": lambda: tf.LlamaConfig(**common, **gqa),
        "mistral": lambda: tf.MistralConfig(**common, **gqa, sliding_window=None),
        "qwen2": lambda: tf.Qwen2Config(**common, **gqa),
        "qwen3": lambda: tf.Qwen3Config(**common, **gqa, head_dim=16),
        "gemma": lambda: tf.GemmaConfig(**common, **gqa, head_dim=16),
        "phi3": lambda: tf.Phi3Config(**common, **gqa, resid_pdrop=0.0, embd_pdrop=0.0, pad_token_id=0),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common, hidden_dropout=0.0),
        "opt": lambda: tf.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=LAYERS,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                    dropout=0.0, attention_dropout=0.0),
    }
    return configs[family]()


@dataclasses.dataclass(frozen=True)
class Family:
    """What a family's layers hold: its MLP is SiLU-gated (one swiglu per layer), and its norm rules."""

    swiglu: bool
    norms: tuple[str, ...]


FAMILIES = {
    "llama": Family(True, ("rms_norm", "add_rms_norm")),
    "mistral": Family(True, ("rms_norm", "add_rms_norm")),
    "qwen2": Family(True, ("rms_norm", "add_rms_norm")),
    "qwen3": Family(True, ("rms_norm", "add_rms_norm")),
    "gemma": Family(False, ("rms_norm", "add_rms_norm")),  # GeGLU: gelu(gate, tanh) · up
    "phi3": Family(True, ("rms_norm", "add_rms_norm")),  # one gate_up_proj, up · silu(gate)
    "gpt2": Family(False, ("add_layer_norm",)),
    "gpt_neox": Family(False, ("add_layer_norm",)),
    "opt": Family(False, ("add_layer_norm",)),
}


def build(family: str, implementation: str, seed: int = 0):
    """A random-init model of ``family`` with ``attn_implementation=implementation``, every parameter moved off
    its init (norm weights off 1, biases off 0) so that a dropped or misplaced tensor shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), attn_implementation=implementation)
    if getattr(model, "loss_type", None) is None:
        # GPT2LMHeadModel's name names no loss: its loss_function would log that it takes the causal LM loss,
        # and the log call is a graph break
        model.loss_type = "ForCausalLM"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


@dataclasses.dataclass
class Case:
    """One scenario run eagerly and compiled: the compiled graphs' reports, and per compared tensor (logits,
    loss, each parameter's gradient) the relative errors of the compiled and the eager fp32 run against the same
    model run in float64 (see _scales). The compiled run is held to no further from float64 than eager is,
    plus the tolerance, as tests/passes/conftest.py holds fused ops."""

    reports: list
    errors: dict[str, float]
    eager_errors: dict[str, float]

    def excess(self, tolerance: float) -> dict[str, str]:
        """The tensors whose compiled error exceeds eager's by more than ``tolerance``."""
        return {name: f"{error:.2e} > {tolerance:.0e} + eager's {self.eager_errors[name]:.2e}"
                for name, error in self.errors.items() if error > tolerance + self.eager_errors[name]}

    def fusions(self) -> Counter:
        total: Counter = Counter()
        for report in self.reports:
            total.update(report.fusions)
        return total

    def unfused(self) -> list[dict[str, str]]:
        return [site for report in self.reports for site in report.unfused]


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> float:
    """max |actual − expected| over ``scale``, by default max |expected| (as tests/passes/conftest.py)."""
    expected, actual = expected.detach().double(), actual.detach().double()
    scale = expected.abs().max().item() if scale is None else scale
    return (actual - expected).abs().max().item() / max(scale, 1e-30)


def _scales(exact: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each tensor's scale for its relative error: its own largest magnitude; for a gradient that is zero in
    exact arithmetic (float64 gives 1e-9 of the largest gradient or less: a key bias's, as softmax ignores a
    shift shared by every key) the largest gradient's, since both fp32 runs give rounding noise there."""
    largest = max((t.abs().max().item() for n, t in exact.items() if n.startswith("grad ")), default=0.0)
    return {name: (largest if name.startswith("grad ") and t.abs().max().item() <= 1e-9 * largest
                   else t.abs().max().item()) for name, t in exact.items()}


def _run(model, scenario: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    if scenario.startswith("train"):
        model.train()
        out = model(ids, labels=ids, use_cache=scenario == "train_cache")
        out.loss.backward()
        grads = {f"grad {n.removeprefix('_orig_mod.')}": p.grad for n, p in model.named_parameters()
                 if p.grad is not None}
        return {"logits": out.logits, "loss": out.loss, **grads}
    model.eval()
    with torch.no_grad():
        prefill = model(ids, use_cache=True)
        step = model(ids[:, -1:].flip(0), past_key_values=prefill.past_key_values, use_cache=True)
    return {"logits": prefill.logits, "decode logits": step.logits}


def run_case(family: str, implementation: str, scenario: str, options: dict | None = None) -> Case:
    from npu_compile.debug.report import collect

    eager = build(family, implementation)
    compiled_model, exact_model = copy.deepcopy(eager), copy.deepcopy(eager).double()
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    expected, exact = _run(eager, scenario, ids), _run(exact_model, scenario, ids)
    torch._dynamo.reset()
    with collect() as reports:
        got = _run(torch.compile(compiled_model, backend="ascend", options=options or {}), scenario, ids)
    torch._dynamo.reset()
    assert got.keys() == expected.keys() == exact.keys(), sorted(set(got) ^ set(expected))
    scales = _scales(exact)
    return Case(reports, {name: relative_error(got[name], exact[name], scales[name]) for name in exact},
                {name: relative_error(expected[name], exact[name], scales[name]) for name in exact})


def counts(case: Case, family: str) -> dict[str, int]:
    fusions = case.fusions()
    return {"attention": fusions["attention"], "swiglu": fusions["swiglu"],
            "norms": sum(fusions[n] for n in FAMILIES[family].norms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the counts to this file (for a later --before)")
    parser.add_argument("--before", help="counts saved by --json from another checkout, shown beside")
    parser.add_argument("--families", default=",".join(FAMILIES))
    args = parser.parse_args()
    from npu_compile import config

    rows = {}
    with config.patch(cache=False):
        for family in args.families.split(","):
            for implementation in IMPLEMENTATIONS:
                case = run_case(family, implementation, "train")
                rows[f"{family}/{implementation}"] = {
                    **counts(case, family), "max_excess": max(e - case.eager_errors[n] for n, e in case.errors.items()),
                    "attention_unfused": sum("attention" in u.get("rule", "") for u in case.unfused())}
                print(family, implementation, rows[f"{family}/{implementation}"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    before = json.loads(Path(args.before).read_text()) if args.before else {}
    lines = ["# HF model classes under backend=\"ascend\": fusions per family", "",
             f"transformers {__import__('transformers').__version__}, torch {torch.__version__}; one training step "
             f"(loss.backward, no cache) of a {LAYERS}-layer random-init model, hidden 64, seq {SEQ}, fp32. "
             "Counts are sites fused over the model's graphs (one per layer is all of them); errors are against "
             "the model run in float64, beyond the eager fp32 run's own; "
             "before = main before these rules, after = this checkout. `python -m bench.hf_fusions`.", "",
             "| family | attention | attention (eager) before → after | attention (sdpa) before → after "
             "| swiglu (eager) before → after | norms (eager) before → after | max rel. error beyond eager's |",
             "|---|---|---|---|---|---|---|"]
    for family in args.families.split(","):
        e, s = rows[f"{family}/eager"], rows[f"{family}/sdpa"]
        be, bs = before.get(f"{family}/eager", {}), before.get(f"{family}/sdpa", {})

        def pair(b, a, key):
            return f"{b.get(key, '?')} → {a[key]}"

        lines.append(f"| {family} | {LAYERS} layers | {pair(be, e, 'attention')} | {pair(bs, s, 'attention')} | "
                     f"{pair(be, e, 'swiglu')} | {pair(be, e, 'norms')} | "
                     f"{max(e['max_excess'], s['max_excess'], 0.0):.1e} |")
    out = Path(__file__).parent / "results" / "hf_fusions.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
