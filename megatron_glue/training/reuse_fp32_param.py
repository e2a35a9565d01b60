"""MindSpeed's `--reuse-fp32-param` on megatron-core's own DistributedOptimizer: the fp32 master weights share the
memory of the bf16 model weights.

An fp32 master weight is its bf16 rounding (the model weight, which the bf16 parameter buffer holds anyway) plus a
16-bit residual. So each rank keeps, for its shard of n master weights, only the n residuals (2n bytes) instead of
the n fp32 copies (4n bytes): `sizeof(bf16) x parameters / DP` saved per rank, as MindSpeed's feature says
(MindSpeed docs/zh/features/reuse-fp32-param.md; its code: mindspeed/core/memory/reuse_param/).

Where the fp32 values live (per bucket of the DDP parameter buffer, DP size d >= 2, n = bucket / d): rank r's
master shard is an fp32 view of 2n bf16 slots of the bucket, its own slot and a neighbour's (rank 1's for rank 0,
rank r-1's otherwise). The neighbour's slot holds nothing needed between the gradient reduce-scatter and the
parameter all-gather, which refills it: exactly when megatron-core's optimizer step runs. So

- before the step (`step_with_ready_grads`), the fp32 master shard is rebuilt in place from the bf16 weights and
  the residuals, and megatron-core's step runs on it unchanged (torch's Adam on megatron-core's main params);
- after it (`_copy_main_params_to_model_params`, megatron-core's hook that copies master to model weights), each
  fp32 value is split again into its bf16 rounding, written to the rank's own slot, and its residual; then
  megatron-core's all-gather refills every slot.

Numerics are those of megatron-core without the flag, bit for bit: the bf16 weight is torch's round-to-nearest-
even of the fp32 master (what megatron-core's copy does), and the master is restored exactly. Round to nearest even
leaves 65537 fp32 values on an even bf16 value and 16 bits hold 65536 residuals; the one left over (an exact tie
rounded down) is kept as a list of positions, on average one in 2^16 weights. (MindSpeed rounds ties away from
zero unless --npu-deterministic, where it keeps that bit in the sign of Adam's exp_avg_sq.)

Between steps the master shard is not materialised; checkpoint saves and loads see it through
`master_weights_materialized(optimizer)`, which rebuilds it in a temporary fp32 buffer and, on exit, splits what a
load wrote there back into weights and residuals.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
import torch.distributed as dist

HALF = 0x8000  # the residual is stored offset by half a bf16 step: low 16 bits of (fp32 bits + 0x8000)
CHUNK = 1 << 20  # elements converted at once: bounds the temporaries of the in-place conversion


class MasterWeightRegion:
    """One bucket's share of one rank: `slots` (2n bf16 of the parameter bucket) holding, during the step, the
    rank's n fp32 master weights, `own` (0 or 1) the half that is the rank's own parameter slot; or, at DP 1,
    `slots` None and `weights` the whole bucket (the step then runs on a temporary fp32 copy, as MindSpeed's DP-1
    path does). `residual` (n int16); `ties` the positions whose residual is +0x8000 (stored as -0x8000)."""

    def __init__(self, slots: torch.Tensor | None, own: int = 0, weights: torch.Tensor | None = None):
        self.slots, self.own = slots, own
        self.n = slots.numel() // 2 if slots is not None else weights.numel()
        self._weights = weights
        device = (slots if slots is not None else weights).device
        self.residual = torch.full((self.n,), -HALF, dtype=torch.int16, device=device)  # exact bf16 values
        self.ties = torch.empty(0, dtype=torch.int64, device=device)

    @property
    def weights(self) -> torch.Tensor:
        """The rank's own bf16 parameter slot."""
        if self.slots is None:
            return self._weights
        return self.slots[self.own * self.n:(self.own + 1) * self.n]

    def fp32_view(self) -> torch.Tensor:
        return self.slots.view(torch.float32)

    def _join(self, hi: torch.Tensor, out: torch.Tensor) -> None:
        """out (n fp32) = the master weights from bf16 `hi` and the residuals; `hi` may be the upper half of
        `out`'s own storage (read chunk by chunk ahead of the writes)."""
        out16 = out.view(torch.int16)
        for start in range(0, self.n, CHUNK):
            end = min(start + CHUNK, self.n)
            pairs = torch.stack((self.residual[start:end], hi.view(torch.int16)[start:end]), dim=-1)
            out16[2 * start:2 * end].copy_(pairs.view(-1))
        bits = out.view(torch.int32)
        bits.sub_(HALF)
        if self.ties.numel():
            bits[self.ties] += 0x10000

    def _split(self, master: torch.Tensor, hi_out: torch.Tensor) -> None:
        """bf16 rounding of `master` (n fp32) to `hi_out` (n bf16, may be the lower half of `master`'s storage)
        and the residuals; the chunks are read before the (lower or equal) positions they write."""
        ties = []
        for start in range(0, self.n, CHUNK):
            end = min(start + CHUNK, self.n)
            x = master[start:end]
            hi = x.to(torch.bfloat16)  # round to nearest even, as megatron-core's copy to the model weights
            shifted = (x.view(torch.int32) + HALF).view(torch.int16)  # little-endian: (low, high) pairs
            tie = shifted[1::2] != hi.view(torch.int16)  # round-half-up went one above: an exact tie rounded down
            if bool(tie.any()):
                ties.append(tie.nonzero().view(-1) + start)
            self.residual[start:end].copy_(shifted[0::2])
            hi_out[start:end].copy_(hi)
        self.ties = torch.cat(ties) if ties else self.ties.new_empty(0)

    def to_fp32_in_place(self) -> None:
        """The slots become the fp32 master weights (the neighbour's slot is overwritten)."""
        if self.own == 0:
            self.slots[self.n:].copy_(self.slots[:self.n])
        self._join(self.slots[self.n:], self.fp32_view())

    def to_bf16_in_place(self) -> None:
        """The fp32 master weights in the slots become the bf16 weights (own slot) and the residuals."""
        self._split(self.fp32_view(), self.slots[:self.n])
        if self.own == 1:
            self.slots[self.n:].copy_(self.slots[:self.n])

    def to_fp32(self) -> torch.Tensor:
        """The master weights in a new fp32 tensor; the slots are left as they are."""
        out = torch.empty(self.n, dtype=torch.float32, device=self.residual.device)
        self._join(self.weights, out)
        return out

    def from_fp32(self, master: torch.Tensor) -> None:
        """Weights and residuals from master weights held outside the slots."""
        self._split(master, self.weights)


class ReusedMasterWeights:
    """The master weights of one megatron-core DistributedOptimizer kept as bf16 weights + residuals."""

    def __init__(self, optimizer):
        if sys.byteorder != "little":
            raise RuntimeError("--reuse-fp32-param reads fp32 bits as (low, high) 16-bit halves: a little-endian "
                               "machine is needed")
        self.optimizer = optimizer
        group = optimizer.data_parallel_group
        self.dp, rank = dist.get_world_size(group), dist.get_rank(group)
        self.regions: dict[tuple[int, int], MasterWeightRegion] = {}
        self.views: list[tuple[torch.Tensor, MasterWeightRegion, int, int]] = []
        before = self.param_bytes()
        for model_group, main_group in zip(optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                gbuf, _, bucket_id = optimizer.model_param_gbuf_map[model_param]
                region = self.regions.get((gbuf, bucket_id))
                if region is None:
                    region = self.regions[gbuf, bucket_id] = self._region(
                        optimizer.buffers[gbuf].buckets[bucket_id].param_data, rank)
                world = optimizer._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
                start = world.start - rank * region.n
                if not (0 <= start and start + main_param.numel() <= region.n):
                    raise RuntimeError("--reuse-fp32-param: a master shard lies outside its rank's bucket slot")
                self.views.append((main_param, region, start, start + main_param.numel()))
        self.in_place = self.dp > 1
        self._placeholder = torch.empty(1, dtype=torch.float32, device=next(iter(self.regions.values())).weights.device)
        self._point_at_slots()  # the fp32 copies megatron-core made are freed here
        self.bytes_before, self.bytes_after = before, self.param_bytes()
        optimizer.step_with_ready_grads = types.MethodType(_step_with_ready_grads, optimizer)
        optimizer._copy_main_params_to_model_params = types.MethodType(_copy_main_params_to_model_params, optimizer)
        optimizer._copy_model_params_to_main_params = types.MethodType(_copy_model_params_to_main_params, optimizer)
        optimizer.reused_master_weights = self

    def _region(self, bucket: torch.Tensor, rank: int) -> MasterWeightRegion:
        if bucket.dtype != torch.bfloat16:
            raise ValueError(f"--reuse-fp32-param needs bf16 weights (--bf16); this bucket holds {bucket.dtype}")
        numel = bucket.numel()
        if numel % (2 * self.dp) or bucket.storage_offset() % 2:
            raise RuntimeError(f"--reuse-fp32-param: a parameter bucket of {numel} elements at offset "
                               f"{bucket.storage_offset()} does not split into even per-rank slots of {self.dp} "
                               "ranks (megatron-core pads buckets to lcm(DP, 128))")
        n = numel // self.dp
        if self.dp == 1:
            return MasterWeightRegion(None, weights=bucket)
        start = 0 if rank == 0 else (rank - 1) * n
        return MasterWeightRegion(bucket[start:start + 2 * n], own=0 if rank == 0 else 1)

    def _point_at_slots(self) -> None:
        """Between steps the master weights are not materialised: at DP > 1 they are fp32 views of the slots
        (valid during the step), at DP 1 placeholders until `materialized`."""
        for main_param, region, start, end in self.views:
            if region.slots is not None:
                main_param.data = region.fp32_view()[start:end]
            else:
                # the shape megatron-core's grad copy checks, over one shared element
                main_param.data = self._placeholder.expand(end - start)

    @contextlib.contextmanager
    def materialized(self):
        """The master weights readable and writable (a temporary fp32 copy) while the model weights stay whole;
        what is written to them is split back into weights and residuals on exit."""
        temporary = {key: region.to_fp32() for key, region in self.regions.items()}
        by_region = {id(region): temporary[key] for key, region in self.regions.items()}
        for main_param, region, start, end in self.views:
            main_param.data = by_region[id(region)][start:end]
        try:
            yield
        finally:
            with torch.no_grad():
                for key, region in self.regions.items():
                    region.from_fp32(temporary[key])
            self._point_at_slots()

    def param_bytes(self) -> int:
        """Bytes of the distinct storages behind the model weights, the master weights, the optimizer's state and
        the residuals: what this rank holds for its parameters and optimizer."""
        opt = self.optimizer
        tensors = [p for g in (*opt.model_float16_groups, *opt.model_fp32_groups) for p in g]
        tensors += [p for g in opt.optimizer.param_groups for p in g["params"]]
        tensors += [t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        tensors += [t for r in getattr(self, "regions", {}).values() for t in (r.residual, r.ties)]
        storages = {}
        for t in tensors:
            s = t.untyped_storage()
            storages[(s.data_ptr(), s.device)] = s.nbytes()
        return sum(storages.values())


@torch.no_grad()
def _step_with_ready_grads(self) -> bool:
    """megatron-core's step, on the fp32 master weights rebuilt in place (DP 1: in a temporary copy)."""
    reused = self.reused_master_weights
    if not reused.in_place:
        with reused.materialized():
            return type(self).step_with_ready_grads(self)
    for region in reused.regions.values():
        region.to_fp32_in_place()
    return type(self).step_with_ready_grads(self)  # its copy to the model weights is the split below


@torch.no_grad()
def _copy_main_params_to_model_params(self) -> None:
    """The split of the fp32 master weights into bf16 weights (the rank's slot, gathered next) and residuals; fp32
    model weights (none under --bf16's Float16Module, kept for completeness) copied as megatron-core does."""
    if self.reused_master_weights.in_place:  # else the split is on leaving `materialized`
        for region in self.reused_master_weights.regions.values():
            region.to_bf16_in_place()
    for main_group, model_group in zip(self.shard_fp32_groups, self.model_fp32_groups):
        for main_param, model_param in zip(main_group, model_group):
            world = self._get_model_param_range_map(model_param)["gbuf_world_in_bucket"]
            gbuf, _, bucket_id = self.model_param_gbuf_map[model_param]
            self.buffers[gbuf].buckets[bucket_id].param_data.view(-1)[world.start:world.end].copy_(main_param)


@torch.no_grad()
def _copy_model_params_to_main_params(self, state_dict=None) -> None:
    """megatron-core's reload of the master weights from the model weights: the bf16 weights are the masters'
    upper halves already, so the residuals become those of exact bf16 values."""
    if state_dict is not None:
        raise NotImplementedError("--reuse-fp32-param: reloading master weights from a state dict is not "
                                  "implemented here")
    for region in self.reused_master_weights.regions.values():
        region.residual.fill_(-HALF)
        region.ties = region.ties.new_empty(0)
    for main_group, model_group in zip(self.shard_fp32_groups, self.model_fp32_groups):
        for main_param, model_param in zip(main_group, model_group):
            param_range = self._get_model_param_range_map(model_param)["param"]
            main_param.data.copy_(model_param.view(-1)[param_range.start:param_range.end])


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer import ChainedOptimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = optimizer.chained_optimizers if isinstance(optimizer, ChainedOptimizer) else [optimizer]
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def enable(optimizer) -> list[ReusedMasterWeights]:
    """Keep the master weights of every DistributedOptimizer in `optimizer` (megatron-core's, as
    get_megatron_optimizer returns it) as bf16 weights + residuals."""
    found = _distributed_optimizers(optimizer)
    if not found:
        raise ValueError("--reuse-fp32-param works on megatron-core's DistributedOptimizer "
                         "(--use-distributed-optimizer)")
    return [ReusedMasterWeights(o) for o in found]


@contextlib.contextmanager
def master_weights_materialized(optimizer):
    """Around a checkpoint save or load: the master weights as megatron-core's optimizer expects to read and
    write them (nothing to do without --reuse-fp32-param)."""
    with contextlib.ExitStack() as stack:
        if optimizer is not None:
            for o in _distributed_optimizers(optimizer):
                if getattr(o, "reused_master_weights", None) is not None:
                    stack.enter_context(o.reused_master_weights.materialized())
        yield
