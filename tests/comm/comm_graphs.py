"""Random programs of matmuls, pointwise ops, in-place updates, RNG draws and collectives, for the comm tests.

A program is data (a list of steps drawn from a seed) and a function that runs it, so the same program traces
to the same FX graph on every rank. Values are square shards [D, D] or gathered [world·D, D]; all-gather turns
a shard into a gathered value and reduce-scatter the reverse. With ``mc2=True`` programs also call the MC2 ops
(all-gather-mm, mm-reduce-scatter, mm-all-reduce; the ``npu`` ops must be defined): for tracing only.
"""

from __future__ import annotations

import dataclasses
import random

import torch
from torch.fx.experimental.proxy_tensor import make_fx

c10d = torch.ops._c10d_functional
D = 8
SHARD, FULL = "shard", "full"


@dataclasses.dataclass
class Program:
    world_size: int
    group: str
    inputs: list[str]  # shape tag of each input
    steps: list[tuple]  # (op, operand indices...) appending one value each
    outputs: list[int]

    def __call__(self, *inputs):
        values = list(inputs)
        n = self.world_size
        for op, *ix in self.steps:
            a = values[ix[0]]
            if op == "mm":
                values.append(a @ values[ix[1]])
            elif op == "add":
                values.append(a + values[ix[1]])
            elif op == "mul":
                values.append(a * values[ix[1]])
            elif op == "tanh":
                values.append(torch.tanh(a))
            elif op == "t":
                values.append(a.t())
            elif op == "scale_":  # in place: later readers of this storage must see it, earlier ones must not
                values.append(a.mul_(0.5))
            elif op == "rand":
                values.append(torch.rand_like(a) + a)
            elif op == "all_reduce":
                values.append(c10d.wait_tensor(c10d.all_reduce(a, "sum", self.group)))
            elif op == "all_gather":
                values.append(c10d.wait_tensor(c10d.all_gather_into_tensor(a, n, self.group)))
            elif op == "reduce_scatter":
                values.append(c10d.wait_tensor(c10d.reduce_scatter_tensor(a, "sum", n, self.group)))
            elif op == "ag_mm":
                values.append(torch.ops.npu.npu_all_gather_base_mm(a, values[ix[1]], self.group, n)[0])
            elif op == "mm_rs":
                values.append(torch.ops.npu.npu_mm_reduce_scatter_base(a, values[ix[1]], self.group, n))
            elif op == "mm_ar":
                values.append(torch.ops.npu.npu_mm_all_reduce_base(a, values[ix[1]], self.group))
        return tuple(values[i] for i in self.outputs)

    def example_inputs(self, seed: int, rank: int = 0) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1009 + rank)
        rows = {SHARD: D, FULL: self.world_size * D}
        return [torch.randn(rows[tag], D, generator=g) * 0.5 for tag in self.inputs]

    def trace(self) -> torch.fx.GraphModule:
        return make_fx(self, tracing_mode="fake")(*self.example_inputs(0))


def random_program(seed: int, world_size: int = 2, group: str = "0", n_steps: int = 16, mc2: bool = False
                   ) -> Program:
    rng = random.Random(seed)
    inputs = [SHARD, SHARD, SHARD, FULL]
    tags = list(inputs)
    transposed: set[int] = set()  # views: never updated in place (their base may be read elsewhere)
    steps: list[tuple] = []

    def pick(tag: str | None = None) -> int:
        return rng.choice([i for i, t in enumerate(tags) if tag is None or t == tag])

    ops = ["mm", "add", "mul", "tanh", "t", "scale_", "rand", "all_reduce", "all_gather", "reduce_scatter"]
    weights = [4, 2, 2, 1, 1, 1, 1, 3, 2, 2]
    if mc2:
        ops, weights = ops + ["ag_mm", "mm_rs", "mm_ar"], weights + [2, 2, 2]
    for _ in range(n_steps):
        op = rng.choices(ops, weights=weights)[0]
        if op == "ag_mm":  # shard @ [D, D] gathered: full
            steps.append((op, pick(SHARD), pick(SHARD)))
            tags.append(FULL)
            continue
        if op == "mm_rs":  # full @ [D, D] scattered: shard
            steps.append((op, pick(FULL), pick(SHARD)))
            tags.append(SHARD)
            continue
        if op == "mm_ar":
            a = pick()
            steps.append((op, a, pick(SHARD)))
            tags.append(tags[a])
            continue
        if op == "mm":
            a = pick()
            steps.append((op, a, pick(SHARD)))
            tags.append(tags[a])
        elif op in ("add", "mul"):
            a = pick()
            steps.append((op, a, pick(tags[a])))
            tags.append(tags[a])
        elif op == "t":
            a = pick(SHARD)
            steps.append((op, a))
            transposed.add(len(tags))
            tags.append(SHARD)
        elif op == "scale_":
            a = rng.choice([i for i in range(len(tags)) if i not in transposed])
            steps.append((op, a))
            transposed.add(len(tags))  # the result aliases a
            tags.append(tags[a])
        elif op == "all_gather":
            steps.append((op, pick(SHARD)))
            tags.append(FULL)
        elif op == "reduce_scatter":
            steps.append((op, pick(FULL)))
            tags.append(SHARD)
        else:  # tanh, rand, all_reduce
            a = pick()
            steps.append((op, a))
            tags.append(tags[a])
    made = list(range(len(inputs), len(tags)))
    outputs = sorted(set(made[-3:] + rng.sample(made, min(2, len(made)))))
    return Program(world_size, group, inputs, steps, outputs)
