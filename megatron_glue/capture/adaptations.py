"""The one registry of changes we make to megatron-core, each named, grouped and explained.

An adaptation replaces one attribute, named by its dotted path (a module function, a class method), with a new
object built from the original: a plain replacement ignores the original, a wrapper stacks on it. Applying sets
the new object on the owner and on every `sys.modules` entry that holds the original by identity (modules that
did `from x import f` keep their own reference), once; reverting puts the originals back. Groups say when an
adaptation is wanted: "cpu" (no CUDA device), "compile" (Dynamo capture), "tp_compile" (capture at tensor
parallel size > 1), "sp" (sequence parallelism without TE/Apex or CUDA), "moe" (megatron-core's MoE without
Transformer Engine or CUDA streams), "linear_attention" (megatron-core's Gated DeltaNet without flash-linear-
attention), "training" (training_adaptations.py).
`groups_for(device)` is the one place that says which groups a process applies.

Megatron differs between releases. An adaptation that is needed (or possible) only on some megatron-core versions
says which with `megatron_versions`, a PEP 440 specifier set matched against the installed distribution's
version (`importlib.metadata.version("megatron-core")`), e.g. ">=0.13" or "<0.13"; None, the default, means every
version. One that does not match is skipped by `apply_groups`, left out of `known()` and listed with why by
`skipped()`. Where the same fix needs different code per line there are two entries with disjoint ranges and
their own names (the older line's named with its suffix, e.g. "inference_rng_tracker_0_12"), each citing the
Megatron file:line of its own line. Tested lines: 0.12.1 and 0.16.1 (`make test-mcore012`, `make test`); range
boundaries in between come from reading each release's source.

Megatron is imported only when an adaptation is applied, so importing this module stays cheap.
We never disable or replace `torch.compile` itself: the point of this project is to compile Megatron.
"""

from __future__ import annotations

import copy
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

_MISSING = object()


def _specifier_set(megatron_versions: str):
    from packaging.specifiers import SpecifierSet  # megatron-core's own dependency; imported when a range is used

    return SpecifierSet(megatron_versions)


@dataclass(frozen=True)
class Adaptation:
    name: str
    target: str  # dotted path of the attribute replaced, e.g. "megatron.core.utils.GlobalMemoryBuffer.get_tensor"
    group: str
    reason: str  # one line: why, citing the Megatron file:line it works around (of each line it applies to)
    build: Callable[[Any], Any]  # original -> new object; runs once per apply
    # The megatron-core versions it applies to: a PEP 440 specifier set ("<0.13", ">=0.13"); None: every version.
    megatron_versions: str | None = None
    # True: the attribute (of a class or a module) does not exist on those versions and the adaptation adds it
    # (build gets None; revert removes it); applying where it exists after all is an error, not a silent override.
    adds: bool = False

    def __post_init__(self):
        if self.megatron_versions is not None:
            _specifier_set(self.megatron_versions)  # a malformed range fails where it is declared

    def applies_to(self, megatron_version: str | None) -> bool:
        """Whether this adaptation is for that megatron-core version (None: megatron-core not installed)."""
        if self.megatron_versions is None:
            return True
        if megatron_version is None:
            return False
        # prereleases=True: a 0.16.0rc0 or dev build belongs to its line, not outside every range
        return _specifier_set(self.megatron_versions).contains(megatron_version, prereleases=True)


@functools.lru_cache(maxsize=None)
def megatron_core_version() -> str | None:
    """The installed megatron-core distribution's version, e.g. "0.12.1"; None when it is not installed."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def megatron_core_in(megatron_versions: str) -> bool:
    """Whether the installed megatron-core is in the PEP 440 specifier set `megatron_versions` (e.g. ">=0.16")."""
    version = megatron_core_version()
    return version is not None and _specifier_set(megatron_versions).contains(version, prereleases=True)


@dataclass
class _Applied:
    adaptation: Adaptation
    owner: Any
    attr: str
    original: Any  # the raw attribute (descriptor included), or _MISSING when it was inherited
    new: Any


def resolve(target: str, absent_ok: bool = False) -> tuple[Any, str]:
    """(owner, attribute name) for a dotted path, importing the longest module prefix; absent_ok: the last
    name may be missing (an attribute an adaptation adds)."""
    parts = target.split(".")
    owner, rest = None, []
    for i in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:i])
        try:
            owner = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only a missing prefix means "try a shorter one"; a broken import inside it is a real error.
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                raise
            continue
        rest = parts[i:]
        break
    if owner is None:
        raise AttributeError(f"target {target!r} does not exist: no module of it can be imported")
    for depth, part in enumerate(rest[:-1]):
        if not hasattr(owner, part):
            found = ".".join(parts[: len(parts) - len(rest) + depth])
            raise AttributeError(f"target {target!r} does not exist: {found} has no attribute {part!r}")
        owner = getattr(owner, part)
    if not absent_ok and not hasattr(owner, rest[-1]):
        raise AttributeError(f"target {target!r} does not exist: {'.'.join(parts[:-1])} has no attribute {rest[-1]!r}")
    return owner, rest[-1]


class Registry:
    """Named adaptations, applied by name or by group, listed with reasons, reverted in reverse order.

    `megatron_version` is the megatron-core version the adaptations' `megatron_versions` are matched against:
    by default the installed one (looked up on first use); a test may pin another.
    """

    def __init__(self, megatron_version: str | None = _MISSING):
        self._known: dict[str, Adaptation] = {}
        self._applied: dict[str, _Applied] = {}  # insertion order = application order
        self._megatron_version = megatron_version

    @property
    def megatron_version(self) -> str | None:
        """The megatron-core version this registry applies adaptations for (None: not installed)."""
        if self._megatron_version is _MISSING:
            self._megatron_version = megatron_core_version()
        return self._megatron_version

    # -- declaring -----------------------------------------------------------------------------------------
    def add(self, adaptation: Adaptation) -> Adaptation:
        if adaptation.name in self._known:
            raise ValueError(f"adaptation {adaptation.name!r} is already registered")
        self._known[adaptation.name] = adaptation
        return adaptation

    def replaces(self, name: str, target: str, group: str, reason: str, megatron_versions: str | None = None,
                 adds: bool = False):
        """Decorator: the decorated object replaces `target` outright (on `megatron_versions` only, if given);
        adds=True: `target` is a class or module attribute those versions lack, and the object is added as it."""
        def register(new):
            self.add(Adaptation(name, target, group, reason, build=lambda original: new,
                                megatron_versions=megatron_versions, adds=adds))
            return new
        return register

    def wraps(self, name: str, target: str, group: str, reason: str, megatron_versions: str | None = None):
        """Decorator: the decorated factory gets the current `target` and returns what stands in its place
        (on `megatron_versions` only, if given)."""
        def register(factory):
            self.add(Adaptation(name, target, group, reason, build=factory, megatron_versions=megatron_versions))
            return factory
        return register

    # -- looking -------------------------------------------------------------------------------------------
    def applies(self, name: str) -> bool:
        """Whether adaptation `name` is for the megatron-core version of this registry."""
        return self.get(name).applies_to(self.megatron_version)

    def known(self, group: str | None = None, every_version: bool = False) -> list[str]:
        """Names (of `group`, or all) that apply to this megatron-core version: what `apply_groups` applies.
        every_version=True: every registered name, those for other megatron-core versions too."""
        return [n for n, a in self._known.items()
                if (group is None or a.group == group) and (every_version or a.applies_to(self.megatron_version))]

    def skipped(self, group: str | None = None) -> dict[str, str]:
        """name -> why it does not apply here, for the registered adaptations (of `group`) that are for other
        megatron-core versions: `apply_groups` leaves them out."""
        installed = ("megatron-core is not installed" if self.megatron_version is None
                     else f"megatron-core {self.megatron_version} is installed")
        return {n: f"for megatron-core {a.megatron_versions}; {installed}" for n, a in self._known.items()
                if (group is None or a.group == group) and not a.applies_to(self.megatron_version)}

    def groups(self) -> list[str]:
        """Every group named by a registered adaptation, whether or not any of it applies to this version."""
        return list(dict.fromkeys(a.group for a in self._known.values()))

    def get(self, name: str) -> Adaptation:
        if name not in self._known:
            raise ValueError(f"unknown adaptation {name!r}; known: {', '.join(self._known)}")
        return self._known[name]

    def applied(self) -> dict[str, str]:
        """name -> reason, in the order applied."""
        return {n: a.adaptation.reason for n, a in self._applied.items()}

    # -- doing ---------------------------------------------------------------------------------------------
    def apply(self, *names: str) -> None:
        """Apply the named adaptations, in order (idempotent). Naming one that is for another megatron-core
        version is a ValueError; all names are checked before anything changes."""
        adaptations = [self.get(n) for n in names]
        for adaptation in adaptations:
            if not adaptation.applies_to(self.megatron_version):
                raise ValueError(f"adaptation {adaptation.name!r} does not apply here: "
                                 f"{self.skipped()[adaptation.name]}")
        for adaptation in adaptations:
            if adaptation.name not in self._applied:
                self._applied[adaptation.name] = self._apply_one(adaptation)

    def apply_groups(self, groups: Iterable[str]) -> None:
        """Apply every adaptation of the groups that applies to this megatron-core version; see `skipped`."""
        groups = [groups] if isinstance(groups, str) else list(groups)
        for g in groups:
            if g not in self.groups():
                raise ValueError(f"unknown adaptation group {g!r}; known: {', '.join(self.groups())}")
        self.apply(*[n for g in groups for n in self.known(g)])

    def revert(self, *names: str) -> None:
        for name in names:
            self.get(name)
        for name in reversed([n for n in self._applied if n in names]):
            record = self._applied[name]
            if _current(record.owner, record.attr) is not record.new:
                raise RuntimeError(
                    f"cannot revert {name!r}: {record.adaptation.target} was replaced again since; revert that first"
                )
            self._revert_one(record)
            del self._applied[name]

    def revert_all(self) -> None:
        self.revert(*self._applied)

    # -- mechanics -----------------------------------------------------------------------------------------
    @staticmethod
    def _apply_one(adaptation: Adaptation) -> _Applied:
        owner, attr = resolve(adaptation.target, absent_ok=adaptation.adds)
        if adaptation.adds:
            if hasattr(owner, attr):
                raise RuntimeError(
                    f"adaptation {adaptation.name!r} adds {adaptation.target}, which megatron-core "
                    f"{megatron_core_version()} already has: its range ({adaptation.megatron_versions}) is wrong")
            current, raw = None, _MISSING
        else:
            current = getattr(owner, attr)
            raw = vars(owner).get(attr, _MISSING) if inspect.isclass(owner) else current
        new = adaptation.build(current)
        setattr(owner, attr, new)
        _swap_in_modules(attr, current, new)
        return _Applied(adaptation, owner, attr, raw, new)

    @staticmethod
    def _revert_one(record: _Applied) -> None:
        if record.original is _MISSING:
            delattr(record.owner, record.attr)  # it was inherited; removing ours uncovers it again
        else:
            setattr(record.owner, record.attr, record.original)
        # Also reaches modules imported after the apply that took the new object by name.
        if record.adaptation.adds:
            return  # nothing took an added attribute by name from a module
        _swap_in_modules(record.attr, record.new, getattr(record.owner, record.attr))


def _swap_in_modules(attr: str, old, new) -> None:
    """Every module that holds `old` under `attr` (by identity) gets `new` instead."""
    if isinstance(old, (bool, int, float, str, type(None))):
        return  # constants are shared objects: identity says nothing about who took this one from the owner
    for module in list(sys.modules.values()):
        # __dict__ lookup, not getattr: some modules compute attributes lazily on access.
        namespace = getattr(module, "__dict__", None)
        if namespace is not None and namespace.get(attr) is old:
            setattr(module, attr, new)


def _current(owner, attr):
    return vars(owner).get(attr, _MISSING) if inspect.isclass(owner) else getattr(owner, attr, _MISSING)


registry = Registry()


# ======================================================================================================
# Which groups a process needs: the one place that decides (adapt(), init_distributed, the training job).
# ======================================================================================================

def machine_device() -> torch.device:
    """The device Megatron's CUDA-minded code should reach on this machine, without an index (the current one):
    npu when torch_npu is imported and sees an NPU, cuda when CUDA is available, else cpu."""
    npu = getattr(torch, "npu", None)
    if "torch_npu" in sys.modules and npu is not None and npu.is_available():
        return torch.device("npu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def groups_for(device: str | torch.device | None = None, training: bool = False,
               one_graph: bool = False) -> tuple[str, ...]:
    """The adaptation groups megatron-core needs on `device` (default `machine_device()`); `training`: also the
    training machinery's (group "training", megatron_glue.capture.training_adaptations).

    "compile", "tp_compile", "sp" and "moe" are always in: each stands aside where it is not needed (no MoE layer
    calls the "moe" group's functions) (the collectives
    are the originals outside Dynamo and are not called at TP=1, the norm is Megatron's own without
    sequence_parallel, the current_device stand-in answers the machine's device), so the groups do not depend on
    the parallel layout, and parallel state may be set up before or after they are applied, by any means.
    "cpu" is in on a CPU (or meta) device only: elsewhere Megatron's CUDA calls have a device to run on (on an
    NPU through torch_npu's transfer_to_npu).
    "linear_attention" is in where the `fla` package is not (its stand-ins for megatron-core's Gated DeltaNet).
    For `torch.compile(gpt_model)` (not with `training`: the training job compiles each layer's forward on its
    own, training.compile_model), each layer is traced and compiled once, not once per layer: by default as a
    frame of its own ("layer_frames": the block's loop runs in Python, a graph break before and after the layers,
    compile time flat in the number of layers); with `one_graph` as a nested compile region called by the model's
    one graph ("regions": what `fullgraph=True` and the whole model's warm start, npu_compile.precompile.compile,
    need; its first step grows with torch's per-call work, bench/results/compile_time.md). Not both: a region
    inside each layer's frame would only wrap that graph once more.
    """
    device = machine_device() if device is None else device
    kind = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    groups = ("cpu",) if kind in ("cpu", "meta") else ()
    # "linear_attention" where flash-linear-attention is not installed (its kernels are Triton for CUDA)
    linear_attention = ("linear_attention",) if importlib.util.find_spec("fla") is None else ()
    return (groups + ("compile", "tp_compile", "sp", "moe") + linear_attention
            + (("training",) if training else ("regions",) if one_graph else ("layer_frames",)))


# ======================================================================================================
# group "cpu": megatron-core hard-codes CUDA in places a CPU (or not-yet-adapted device) run reaches.
# Cited lines are 0.16.1's, with 0.12.1's where they differ ("0.12.1: file:line").
# ======================================================================================================

@registry.wraps(
    "inference_rng_tracker", "megatron.core.tensor_parallel.random.initialize_rng_tracker", "cpu",
    reason="CudaRNGStatesTracker seeds and forks torch.cuda generators (tensor_parallel/random.py:237,248); "
    "use the inference tracker, whose fork() is a nullcontext, built again with force_reset "
    "(tensor_parallel/random.py:298)",
    megatron_versions=">=0.13",
)
def _inference_rng_tracker(initialize_rng_tracker):
    # Replace any tracker built before now; the wrapper keeps later (re)initialisations CPU-safe too,
    # e.g. model_parallel_cuda_manual_seed(force_reset_rng=True).
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)

    def initialize_cpu_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                                   use_cudagraphable_rng=False, force_reset=False):
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=force_reset)

    return initialize_cpu_rng_tracker


@registry.wraps(
    "inference_rng_tracker_0_12", "megatron.core.tensor_parallel.random.initialize_rng_tracker", "cpu",
    reason="CudaRNGStatesTracker seeds and forks torch.cuda generators (0.12.1: tensor_parallel/random.py:196,207); "
    "use the inference tracker, whose fork() is a nullcontext; 0.12 has no force_reset and keeps the first "
    "tracker built (0.12.1: tensor_parallel/random.py:243), so clear its initialised flag to build ours",
    megatron_versions="<0.13",
)
def _inference_rng_tracker_0_12(initialize_rng_tracker):
    from megatron.core.tensor_parallel import random

    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False  # what force_reset=True does from 0.13 on
    initialize_rng_tracker(inference_rng_tracker=True)

    def initialize_cpu_rng_tracker(use_te_rng_tracker=False, inference_rng_tracker=False,
                                   use_cudagraphable_rng=False):
        initialize_rng_tracker(inference_rng_tracker=True)

    return initialize_cpu_rng_tracker


@registry.replaces(
    "checkpoint_rng_state_on_cpu", "megatron.core.tensor_parallel.random._get_cuda_rng_state", "cpu",
    reason="activation checkpointing (--recompute-granularity full) saves and restores the device generator around "
    "the recomputed forward with torch.cuda.random.get_rng_state / default_generators (tensor_parallel/random.py:"
    "447,457,514; 0.12.1: tensor_parallel/random.py:366,373,406); on a CPU the device generator is torch's CPU "
    "generator",
)
def _cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


@registry.replaces(
    "checkpoint_set_rng_state_on_cpu", "megatron.core.tensor_parallel.random._set_cuda_rng_state", "cpu",
    reason="the restoring half of checkpoint_rng_state_on_cpu: _set_cuda_rng_state sets torch.cuda's default "
    "generator (tensor_parallel/random.py:457,550; 0.12.1: tensor_parallel/random.py:373,441); on a CPU, torch's "
    "CPU generator",
)
def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


@registry.replaces(
    "fresh_global_buffer", "megatron.core.utils.GlobalMemoryBuffer.get_tensor", "cpu",
    reason="GlobalMemoryBuffer allocates on torch.cuda.current_device() (utils.py:631; 0.12.1: utils.py:394); a "
    "fresh tensor on the default device also keeps cached state out of Dynamo guards and autograd: under SP a "
    "buffer first made in a compiled step is a graph output with autograd history, and the next step's backward "
    "fails (tensor_parallel/layers.py:482; 0.12.1: tensor_parallel/layers.py:433)",
)
def _fresh_buffer(self, tensor_shape, dtype, name, mem_alloc_context=None):
    return torch.empty(tensor_shape, dtype=dtype)


@registry.replaces(
    "causal_mask_on_default_device", "megatron.core.transformer.utils.get_default_causal_mask", "cpu",
    reason="get_default_causal_mask builds the mask with device='cuda' (transformer/utils.py:35; 0.12.1: "
    "transformer/utils.py:32), reached when attention_mask is None",
)
def _default_causal_mask(sq):
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


@registry.replaces(
    "sliding_window_mask_on_default_device", "megatron.core.transformer.utils.get_sliding_window_causal_mask", "cpu",
    reason="get_sliding_window_causal_mask builds the mask with device='cuda' (transformer/utils.py:40, 0.16.1; "
    "the local attention's window arrived in 0.15), reached with window_size (--interleave-sliding-window)",
    megatron_versions=">=0.15",
)
def _sliding_window_mask(sq, skv, window_size):
    keep = torch.ones(sq, skv, dtype=torch.bool).triu(skv - sq - window_size[0]).tril(skv - sq + window_size[1])
    return ~keep


def _rope_emb_on_its_device(rotary, freqs):
    """[seq, 1, 1, dim] embedding from freqs [seq, dim/2], as Megatron lays it out (rotate-half or interleaved)."""
    if rotary.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


@registry.replaces(
    "rope_stays_on_device", "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.get_emb",
    "cpu",
    reason="RotaryEmbedding.get_emb moves inv_freq from cpu to torch.cuda.current_device() "
    "(models/common/embeddings/rotary_pos_embedding.py:162); get_emb exists from 0.16",
    megatron_versions=">=0.16",
)
def _rope_emb(self, max_seq_len, offset=0):
    # Megatron's get_emb without the device move: inv_freq stays where the module put it.
    return _rope_emb_on_its_device(self, self.get_freqs_non_repeated(max_seq_len, offset))


@registry.replaces(
    "rope_stays_on_device_0_12", "megatron.core.models.common.embeddings.rotary_pos_embedding.RotaryEmbedding.forward",
    "cpu",
    reason="RotaryEmbedding.forward moves inv_freq from cpu to torch.cuda.current_device() (0.12.1: "
    "models/common/embeddings/rotary_pos_embedding.py:155); 0.12 has no get_emb, so forward itself is replaced",
    megatron_versions="<0.13",
)
@functools.lru_cache(maxsize=32)  # as Megatron's own (0.12.1: models/common/embeddings/rotary_pos_embedding.py:141)
def _rope_forward_0_12(self, max_seq_len, offset=0, packed_seq=False):
    # Megatron 0.12's forward without the device move: inv_freq stays where the module put it.
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank

    emb = _rope_emb_on_its_device(self, self.get_freqs_non_repeated(max_seq_len, offset))
    if parallel_state.get_context_parallel_world_size() > 1 and not packed_seq:
        emb = get_pos_emb_on_this_cp_rank(emb, 0)  # this CP rank's part of the sequence
    return emb


def _pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group=None):
    # Megatron's split of the rotary embedding (chunks r and 2CP-1-r of 2CP along seq_dim), its index built on the
    # embedding's device; 0.12's signature has no cp_group (the CP group of parallel_state)
    if cp_group is None:
        from megatron.core import parallel_state

        size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    else:
        size, rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([rank, 2 * size - 1 - rank], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


_POS_EMB_REASON = ("get_pos_emb_on_this_cp_rank builds its chunk index with pin_memory=True and moves it with .cuda() "
                   "(0.16.1: models/common/embeddings/rope_utils.py:62-64; 0.12.1: rope_utils.py:59-61), reached by "
                   "RoPE at --context-parallel-size > 1; the same split with the index on the embedding's device")
registry.replaces("rope_cp_split_on_its_device",
                  "megatron.core.models.common.embeddings.rotary_pos_embedding.get_pos_emb_on_this_cp_rank", "cpu",
                  reason=_POS_EMB_REASON + " (the name RotaryEmbedding.forward calls)")(_pos_emb_on_this_cp_rank)
registry.replaces("rope_cp_split_on_its_device_rope_utils",
                  "megatron.core.models.common.embeddings.rope_utils.get_pos_emb_on_this_cp_rank", "cpu",
                  reason=_POS_EMB_REASON + " (the name rope_stays_on_device_0_12 calls)")(_pos_emb_on_this_cp_rank)


@registry.replaces(
    "cp_batch_split_on_its_device", "megatron.core.utils.get_batch_on_this_cp_rank", "cpu",
    reason="get_batch_on_this_cp_rank builds its chunk index with pin_memory=True and moves it with .cuda() "
    "(0.12.1: utils.py:1724-1726), reached at --context-parallel-size > 1; 0.13 on builds it on the batch's device",
    megatron_versions="<0.13",
)
def _cp_batch_split_0_12(batch):
    # the same split (rank r: chunks r and 2CP-1-r of 2CP along the sequence), its index on the tensor's device
    from megatron.core import parallel_state

    size = parallel_state.get_context_parallel_world_size()
    if size == 1:
        return batch
    rank = parallel_state.get_context_parallel_rank()
    for key, val in batch.items():
        if val is None:
            continue
        dim = 2 if key == "attention_mask" else 1
        chunks = val.view(*val.shape[:dim], 2 * size, val.shape[dim] // (2 * size), *val.shape[dim + 1:])
        mine = chunks.index_select(dim, torch.tensor([rank, 2 * size - 1 - rank], device=val.device))
        batch[key] = mine.view(*val.shape[:dim], -1, *val.shape[dim + 1:])
    return batch


# ======================================================================================================
# group "compile": what stops Dynamo from capturing Megatron's forward and backward as one graph.
# ======================================================================================================

@registry.wraps(
    "quiet_default_tp_group", "megatron.core.utils.get_tensor_model_parallel_group_if_none", "compile",
    reason="warnings.warn(DeprecationWarning) on every RowParallelLinear forward (utils.py:501, layers.py:1281 "
    "passes tp_group=None) is a Dynamo graph break; from 0.13 only: 0.12's layers take the group from parallel_state "
    "and do not warn (0.12.1: tensor_parallel/layers.py:1195, tensor_parallel/mappings.py:31)",
    megatron_versions=">=0.13",
)
def _quiet_default_tp_group(get_group_if_none):
    from megatron.core import parallel_state

    @functools.wraps(get_group_if_none)
    def get_tensor_model_parallel_group_if_none(tp_group, is_expert=False, check_initialized=True):
        # Hand the original the default group it would pick, so it has nothing to warn about.
        if tp_group is None and parallel_state.is_initialized():
            default = (parallel_state.get_expert_tensor_parallel_group if is_expert
                       else parallel_state.get_tensor_model_parallel_group)
            tp_group = default(check_initialized=check_initialized)
        return get_group_if_none(tp_group, is_expert, check_initialized)

    return get_tensor_model_parallel_group_if_none


@registry.wraps(
    "bias_dropout_add_in_grad_mode", "megatron.core.transformer.transformer_layer.TransformerLayer.__init__",
    "compile",
    reason="TransformerLayer runs bias-dropout-add under torch.enable_grad() (transformer_layer.py:465; 0.12.1: "
    "transformer_layer.py:366), kept for nvfuser's fused kernel, which is not used here (bias_dropout_fusion off): "
    "under torch.no_grad (evaluation) the captured layer is then a training graph in part, and attention and "
    "bias-GeLU, in its no-grad part, match neither the training nor the inference rules; nullcontext keeps the "
    "caller's grad mode (the same in training, where grad is on)",
)
def _bias_dropout_add_in_grad_mode(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.bias_dropout_add_exec_handler = contextlib.nullcontext

    return __init__


# ======================================================================================================
# group "tp_compile": what stops Dynamo from capturing Megatron at tensor-parallel size > 1.
# ======================================================================================================

class _Completed:
    """The Work handle of a collective that has already been issued: nothing is left to wait for."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


_COMPLETED = _Completed()


def _issue_in_graph_when_compiling(collective):
    """`collective` as is in eager; under Dynamo, called without async_op and answered by a finished handle.

    Dynamo turns a torch.distributed collective into a functional one (`_c10d_functional.*` + `wait_tensor`)
    only when async_op is False. A functional collective is already asynchronous: the backend's comm scheduling
    decides where its wait goes, which is what async_op=True asks for by hand.
    """

    @functools.wraps(collective)
    def issue(*args, async_op=False, **kwargs):
        if not torch.compiler.is_compiling():
            return collective(*args, async_op=async_op, **kwargs)
        collective(*args, **kwargs)
        return _COMPLETED if async_op else None

    return issue


@registry.wraps(
    "capturable_async_all_reduce", "torch.distributed.all_reduce", "tp_compile",
    reason="LinearWithGradAccumulationAndAsyncCommunication.backward all-reduces the input grad with "
    "async_op=True (tensor_parallel/layers.py:544; 0.12.1: tensor_parallel/layers.py:489), a Dynamo graph break "
    "in every ColumnParallelLinear; it calls it as torch.distributed.all_reduce, so only the torch attribute can "
    "be wrapped",
)
def _capturable_all_reduce(all_reduce):
    from torch.distributed._functional_collectives import REDUCE_OP_TO_STR

    @functools.wraps(all_reduce)
    def capturable_all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, group=None, async_op=False):
        if not torch.compiler.is_compiling():
            return all_reduce(tensor, op, group, async_op)
        # Dynamo names the reduce op for the functional collective ("max") only when it calls the function that
        # is torch.distributed.all_reduce at trace time, which is now this one: name it here, or cross-entropy's
        # ReduceOp.MAX (tensor_parallel/cross_entropy.py:130, both lines) reaches the functional op unnamed and fails.
        all_reduce(tensor, REDUCE_OP_TO_STR[op], group)
        return _COMPLETED if async_op else None

    return capturable_all_reduce


@registry.wraps(
    "capturable_async_all_gather", "megatron.core.tensor_parallel.layers.dist_all_gather_func", "tp_compile",
    reason="under SP the linear backward re-gathers its input with async_op=True (tensor_parallel/layers.py:522; "
    "0.12.1: tensor_parallel/layers.py:468), a Dynamo graph break",
)
def _capturable_all_gather(all_gather):
    return _issue_in_graph_when_compiling(all_gather)


@registry.wraps(
    "capturable_async_reduce_scatter", "megatron.core.tensor_parallel.layers.dist_reduce_scatter_func", "tp_compile",
    reason="under SP the linear backward reduce-scatters the input grad with async_op=True "
    "(tensor_parallel/layers.py:555; 0.12.1: tensor_parallel/layers.py:502), a Dynamo graph break",
)
def _capturable_reduce_scatter(reduce_scatter):
    return _issue_in_graph_when_compiling(reduce_scatter)


registry.add(Adaptation(
    "no_cuda_max_connections_warning",
    "megatron.core.tensor_parallel.layers.linear_with_grad_accumulation_and_async_allreduce.warned",
    "tp_compile",
    reason="the first TP linear warns unless CUDA_DEVICE_MAX_CONNECTIONS=1 (tensor_parallel/layers.py:728-741; "
    "0.12.1: tensor_parallel/layers.py:651-664), a CUDA stream-ordering hint with no meaning off CUDA; "
    "warnings.warn is a Dynamo graph break; set Megatron's own already-warned flag",
    build=lambda warned: True,
))


# ======================================================================================================
# group "sp": sequence parallelism with torch norms (no TE/Apex) and no CUDA device.
# ======================================================================================================

@registry.wraps(
    "sequence_parallel_torch_norm", "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__", "sp",
    reason="WrappedTorchNorm asserts not config.sequence_parallel (transformer/torch_norm.py:32, both lines); a torch "
    "norm is correct on a sequence shard once its params are tagged .sequence_parallel, as TE tags its own, so that "
    "their grads get all-reduced over TP (distributed/finalize_model_grads.py:354; 0.12.1: "
    "distributed/finalize_model_grads.py:205)",
)
def _sequence_parallel_torch_norm(wrapped_new):
    def __new__(cls, config, *args, **kwargs):
        if not config.sequence_parallel:
            return wrapped_new(cls, config, *args, **kwargs)
        # Megatron's own choice of norm (and its other checks), shown a config without SP.
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = wrapped_new(cls, plain, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return staticmethod(__new__)


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm whose weight w stores gamma - 1, applied as 1 + w (zero at init): megatron-core's
    layernorm_zero_centered_gamma, MindSpeed-LLM's --add-rmsnorm-offset. weight_in_fp32 (MindSpeed-LLM's
    --rmsnorm-weight-in-fp32): 1 + w formed in fp32 and the fp32-normalized input multiplied by it in fp32, cast
    back once (mindspeed_llm/core/models/common/rms_norm.py `rms_norm_forward`)."""

    weight_in_fp32: bool = False

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_in_fp32:
            out = torch.nn.functional.rms_norm(x.float(), self.normalized_shape, 1.0 + self.weight.float(), self.eps)
            return out.to(x.dtype)
        return torch.nn.functional.rms_norm(x, self.normalized_shape, 1.0 + self.weight, self.eps)


@registry.wraps(
    "zero_centered_rms_norm", "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__", "sp",
    reason="WrappedTorchNorm asserts not config.layernorm_zero_centered_gamma (transformer/torch_norm.py:26-28, both "
    "lines), which TE's RMSNorm supports; with --normalization RMSNorm the norm is Megatron's own torch.nn.RMSNorm "
    "(built from a config without it) whose weight stores gamma - 1 and is applied as 1 + w, zero at init",
)
def _zero_centered_rms_norm(wrapped_new):
    def __new__(cls, config, *args, **kwargs):
        if not (config.layernorm_zero_centered_gamma and config.normalization == "RMSNorm"):
            return wrapped_new(cls, config, *args, **kwargs)
        plain = copy.copy(config)
        plain.layernorm_zero_centered_gamma = False
        norm = wrapped_new(cls, plain, *args, **kwargs)
        norm.__class__ = ZeroCenteredRMSNorm
        norm.weight_in_fp32 = bool(getattr(config, "rmsnorm_weight_in_fp32", False))
        norm.reset_parameters()
        return norm

    return staticmethod(__new__)


# What torch.cuda.current_device() answers under the "sp" group; see set_current_device. None: machine_device().
_current_device: torch.device | None = None


def set_current_device(device: str | torch.device | None) -> None:
    """Where Megatron's torch.cuda.current_device() buffers go under the "sp" group (default, or None:
    `machine_device()`; "meta" for a shapes-only capture). Set it before compiling: Dynamo folds the call into
    the graph as a constant."""
    global _current_device
    _current_device = None if device is None else torch.device(device)


@registry.wraps(
    "current_device_stand_in", "torch.cuda.current_device", "sp",
    reason="SP buffers are made with device=torch.cuda.current_device() (tensor_parallel/mappings.py:141,181, "
    "tensor_parallel/layers.py:552; 0.12.1: tensor_parallel/mappings.py:142,185, tensor_parallel/layers.py:499); "
    "torch.cuda is the only place to redirect it from",
)
def _current_device_stand_in(cuda_current_device):
    @torch.compiler.assume_constant_result  # Dynamo folds the call to its result, as it does torch.cuda's own
    def current_device():
        return machine_device() if _current_device is None else _current_device

    # Dynamo's trace rules name torch functions by dotted path (torch/_dynamo/trace_rules.py:257): once its rule
    # map is built after this replacement, "torch.cuda.current_device" is a torch op to put in the graph, and
    # only the constant-fold table (which held the original) keeps a device-valued call from breaking the graph.
    # Built before, the function is user code and assume_constant_result folds it. Both must hold.
    from torch._dynamo.variables import torch as dynamo_torch

    dynamo_torch.constant_fold_functions[current_device] = None
    return current_device


# ======================================================================================================
# group "moe": megatron-core's MoE layer (router, token dispatchers, aux losses) without Transformer Engine and
# without CUDA streams. The router's weight, moved to torch.cuda.current_device() (transformer/moe/router.py:88-92;
# 0.12.1: transformer/moe/router.py:57), goes where the "sp" group's current_device stand-in says.
# ======================================================================================================

registry.add(Adaptation(
    "router_gemm_without_te", "megatron.core.transformer.moe.moe_utils.te_general_gemm", "moe",
    reason="RouterGatingLinearFunction tests `te_general_gemm is not None` (transformer/moe/moe_utils.py:1192,1225), "
    "a name only the Transformer Engine import defines (moe_utils.py:22-39): without TE every MoE forward is a "
    "NameError (fixed upstream by NVIDIA/Megatron-LM PR #3763); None is what the test expects without TE, and the "
    "router's own torch.mm path runs; 0.12 has no TE gemm in the router",
    build=lambda missing: None, megatron_versions=">=0.13", adds=True,
))


class _NoStream:
    """Stands for the alltoall dispatcher's device-to-host copy stream where there is none: never used, as the
    copy itself (moe_split_sizes_on_host) is made on the current stream."""


_NO_STREAM = _NoStream()

registry.add(Adaptation(
    "alltoall_dispatcher_without_cuda_stream",
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream", "moe",
    reason="MoEAlltoAllTokenDispatcher's constructor makes a torch.cuda.Stream for its host copies when the class "
    "has none (transformer/moe/token_dispatcher.py:444-445), which fails without CUDA; the class gets a stand-in "
    "that moe_split_sizes_on_host never uses",
    build=lambda stream: _NO_STREAM, megatron_versions=">=0.14",
))


@registry.wraps(
    "alltoall_dispatcher_without_cuda_stream_0_12",
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.__init__", "moe",
    reason="MoEAlltoAllTokenDispatcher's constructor stores a new torch.cuda.Stream on each instance (0.12.1: "
    "transformer/moe/token_dispatcher.py:327), which fails without CUDA; the constructor runs with a stand-in "
    "stream that moe_split_sizes_on_host never uses",
    megatron_versions="<0.14",
)
def _alltoall_without_stream_0_12(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        stream, torch.cuda.Stream = torch.cuda.Stream, lambda *a, **k: _NO_STREAM
        try:
            init(self, *args, **kwargs)
        finally:
            torch.cuda.Stream = stream

    return __init__


@registry.wraps(
    "alltoall_seq_without_cuda_sync_0_12",
    "megatron.core.transformer.moe.legacy_a2a_token_dispatcher.MoEAlltoAllSEQTokenDispatcher.preprocess", "moe",
    reason="the alltoall_seq dispatcher's preprocess picks a point where token_permutation synchronizes "
    "torch.cuda.current_stream() (0.12.1: transformer/moe/legacy_a2a_token_dispatcher.py:131-142,224-263), which "
    "fails without CUDA; its host copies (.to('cpu'), .numpy()) are synchronous off CUDA, so no point is needed: "
    "'no_sync', the dispatcher's own value for that",
    megatron_versions="<0.13",
)
def _alltoall_seq_without_cuda_sync_0_12(preprocess):
    @functools.wraps(preprocess)
    def without_sync(self, routing_map):
        out = preprocess(self, routing_map)
        if not torch.cuda.is_available():
            self.cuda_sync_point = "no_sync"
        return out

    return without_sync


def _split_sizes_on_host(sizes):
    """Split sizes as all_to_all_single takes them: a list of ints (traced: unbacked SymInts)."""
    return sizes.tolist() if torch.is_tensor(sizes) else sizes


@registry.replaces(
    "moe_split_sizes_on_host",
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize", "moe",
    reason="the alltoall dispatcher copies its all-to-all split sizes to the host on a CUDA side stream, and only "
    "from CUDA tensors (transformer/moe/token_dispatcher.py:862-899, moe_utils.py:1093; 0.12.1: "
    "token_dispatcher.py:669-705, moe_utils.py:754): elsewhere they stay tensors and all_to_all_single fails on "
    "them (TypeError); here they become lists of ints at the same point, on the current stream, with no "
    "synchronisation to wait for",
)
def _moe_split_sizes_on_host(self, point, tokens_per_expert=None):
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        self.input_splits = _split_sizes_on_host(self.input_splits)
        self.output_splits = _split_sizes_on_host(self.output_splits)
    return tokens_per_expert


def _chunk_order_on_host(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if not self.config.moe_permute_fusion:  # the fused sort takes tensors (and is refused here)
            self.sort_input_by_local_experts = tuple(self.sort_input_by_local_experts.tolist())
            self.restore_output_by_local_experts = tuple(self.restore_output_by_local_experts.tolist())

    return __init__


registry.wraps(
    "alltoall_chunk_order_on_host",
    "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher.__init__", "moe",
    reason="the alltoall dispatcher keeps the fixed order of its (rank, local expert) chunks as tensors "
    "(transformer/moe/token_dispatcher.py:409-415; 0.12.1: token_dispatcher.py:297-303) and sort_chunks_by_idxs "
    "reads them with .tolist() (moe_utils.py:506; 0.12.1: moe_utils.py:411): under Dynamo a data-dependent list, "
    "and indexing the split chunks with its values fails (GuardOnDataDependentSymNode); kept as tuples of ints, "
    "the order the constructor computed",
)(_chunk_order_on_host)


@registry.wraps(
    "sort_chunks_by_host_order", "megatron.core.transformer.moe.moe_utils.sort_chunks_by_idxs", "moe",
    reason="sort_chunks_by_idxs takes the chunk order as a tensor (transformer/moe/moe_utils.py:505-510; 0.12.1: "
    "moe_utils.py:410-415); with alltoall_chunk_order_on_host it is a tuple of ints, used as it is",
)
def _sort_chunks_by_host_order(sort_chunks_by_idxs):
    @functools.wraps(sort_chunks_by_idxs)
    def sort_chunks(input, split_sizes, sorted_idxs, probs=None, fused=False):
        if not isinstance(sorted_idxs, tuple):
            return sort_chunks_by_idxs(input, split_sizes, sorted_idxs, probs=probs, fused=fused)
        sizes = split_sizes.tolist()
        chunks = torch.split(input, sizes, dim=0)
        output = torch.cat([chunks[i] for i in sorted_idxs], dim=0)
        if probs is None:
            return output, None
        prob_chunks = torch.split(probs, sizes, dim=0)
        return output, torch.cat([prob_chunks[i] for i in sorted_idxs], dim=0)

    return sort_chunks


def _on_gloo(group) -> bool:
    """Whether `group` is a gloo group, whose all_gather and reduce_scatter take equal sizes only; elsewhere (HCCL,
    NCCL) megatron-core's own uneven collective runs. Dynamo evaluates it while tracing (a constant in the graph)."""
    return torch.distributed.get_backend(group) == "gloo"


def _tp_group_if_none(group):
    """0.12's mappings take group=None as the tensor-parallel group (0.12.1: tensor_parallel/mappings.py:128-129)."""
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group


def gather_uneven_rows(input_: torch.Tensor, group, output_split_sizes) -> torch.Tensor:
    """All-gather along the first dimension of rows whose count differs per rank (rank r holds
    output_split_sizes[r]), as one all_to_all_single: each rank sends its rows whole to every rank. Exact (a copy);
    the rows go out world-size times, on a path (gloo) where only correctness counts."""
    world = group.size()
    output = torch.empty((sum(output_split_sizes), *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    torch.distributed.all_to_all_single(output, torch.cat([input_.contiguous()] * world),
                                        output_split_sizes=list(output_split_sizes),
                                        input_split_sizes=[input_.shape[0]] * world, group=group)
    return output


def reduce_scatter_uneven_rows(input_: torch.Tensor, group, input_split_sizes) -> torch.Tensor:
    """Reduce-scatter (sum) along the first dimension in per-rank row counts (rank r keeps input_split_sizes[r]
    rows), as one all_to_all_single: rank r receives every rank's r-th chunk and sums them in rank order."""
    world, rank = group.size(), group.rank()
    mine = input_split_sizes[rank]
    received = torch.empty((world * mine, *input_.shape[1:]), dtype=input_.dtype, device=input_.device)
    torch.distributed.all_to_all_single(received, input_.contiguous(), output_split_sizes=[mine] * world,
                                        input_split_sizes=list(input_split_sizes), group=group)
    return received.view(world, mine, *input_.shape[1:]).sum(0)


_UNEVEN_REASON = (
    "behind the alltoall dispatcher at expert-tensor-parallel size > 1 the routed tokens are all-gathered over the "
    "expert-TP group in counts that differ per rank (transformer/moe/token_dispatcher.py:691-701; 0.12.1: "
    "token_dispatcher.py:521-531), and reduce-scattered back in the same counts (token_dispatcher.py:774-783; 0.12.1: "
    "token_dispatcher.py:618-628), each gradient the other (tensor_parallel/mappings.py:328-377); with split sizes "
    "megatron-core calls torch.distributed.all_gather / reduce_scatter on lists of unequal tensors "
    "(mappings.py:149-150,185-193; 0.12.1: mappings.py:150-151,189-197), which gloo refuses (\"ProcessGroupGloo::"
    "allgather: invalid tensor size\") and Dynamo cannot capture (its functional all_gather compares the per-rank "
    "sizes, data-dependent here: torch/distributed/_functional_collectives.py all_gather_inplace); over gloo the "
    "same rows move by all_to_all_single with uneven splits, which both take; on other backends megatron-core's "
    "own call")


@registry.wraps("uneven_gather_on_gloo", "megatron.core.tensor_parallel.mappings._gather_along_first_dim", "moe",
                reason=_UNEVEN_REASON + " (the gather)")
def _uneven_gather_on_gloo(gather):
    @functools.wraps(gather)
    def gather_along_first_dim(input_, group=None, output_split_sizes=None, use_global_buffer=False):
        resolved = None if output_split_sizes is None else _tp_group_if_none(group)
        if resolved is None or resolved.size() == 1 or not _on_gloo(resolved):
            return gather(input_, group, output_split_sizes, use_global_buffer)
        return gather_uneven_rows(input_, resolved, output_split_sizes)

    return gather_along_first_dim


@registry.wraps("uneven_reduce_scatter_on_gloo",
                "megatron.core.tensor_parallel.mappings._reduce_scatter_along_first_dim", "moe",
                reason=_UNEVEN_REASON + " (the reduce-scatter)")
def _uneven_reduce_scatter_on_gloo(reduce_scatter):
    @functools.wraps(reduce_scatter)
    def reduce_scatter_along_first_dim(input_, group=None, input_split_sizes=None, use_global_buffer=False):
        resolved = None if input_split_sizes is None else _tp_group_if_none(group)
        if resolved is None or resolved.size() == 1 or not _on_gloo(resolved):
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        return reduce_scatter_uneven_rows(input_, resolved, input_split_sizes)

    return reduce_scatter_along_first_dim


_aux_loss_backward_scale = None


def aux_loss_backward_scale_op():
    """megatron_glue::aux_loss_backward_scale(aux_loss, grad_output): ones like aux_loss times
    MoEAuxLossAutoScaler's scale as it is when the backward runs. An opaque op, so that a compiled graph reads the
    scale at run time, as eager does (the schedule sets it after the forward: pipeline_parallel/schedules.py:
    290-292); it takes the incoming gradient, which it does not read, so that the partitioner cannot move it into
    the forward graph (a value of the forward's alone would be computed there and saved: the scale before the
    schedule set it)."""
    global _aux_loss_backward_scale
    if _aux_loss_backward_scale is None:
        @torch.library.custom_op("megatron_glue::aux_loss_backward_scale", mutates_args=())
        def aux_loss_backward_scale(aux_loss: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
            from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

            scale = MoEAuxLossAutoScaler.main_loss_backward_scale
            if scale is None:  # megatron-core's default, 1, before a schedule sets one (not stored: the
                scale = 1.0    # schedule's set_loss_scale would copy its [1]-shaped scale into it)
            return (torch.ones_like(aux_loss) * scale).reshape(aux_loss.shape)

        @aux_loss_backward_scale.register_fake
        def _(aux_loss, grad_output):
            return torch.empty_like(aux_loss)

        _aux_loss_backward_scale = aux_loss_backward_scale
    return _aux_loss_backward_scale


@registry.wraps(
    "aux_loss_scale_read_at_backward",
    "megatron.core.transformer.moe.moe_utils.MoEAuxLossAutoScaler.backward", "moe",
    reason="MoEAuxLossAutoScaler.backward reads the aux-loss scale from a class attribute (transformer/moe/"
    "moe_utils.py:267-272; 0.12.1: moe_utils.py:208-213), a Dynamo graph break at every aux or z loss (\"Unsupported "
    "python_type()\"): the scale is read by an opaque op instead (aux_loss_backward_scale_op), at the same time, "
    "with the same value",
)
def _aux_loss_scale_read_at_backward(backward):
    op = aux_loss_backward_scale_op()

    def scaled_backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        return grad_output, op(aux_loss, grad_output)

    return staticmethod(scaled_backward)


# ======================================================================================================
# group "regions": a whole GPTModel under torch.compile, its identical layers compiled once.
# ======================================================================================================

@registry.wraps(
    "layer_compile_region", "megatron.core.transformer.transformer_layer.TransformerLayer.forward", "regions",
    reason="TransformerBlock calls its layers in a Python loop (transformer/transformer_block.py:748-779; the same "
    "loop on 0.12.1) that Dynamo unrolls: torch.compile(gpt_model) traces and compiles every layer again, and "
    "its compile time grows with num_layers; as a nested compile region (torch.compiler.nested_compile_region) "
    "the layer is traced once and called N times (invoke_subgraph), and the backend compiles it once. At tensor "
    "parallel size > 1 the layer is inlined as before: the backend's overlap scheduling does not look inside a "
    "region for its collectives. An MoE layer is inlined too: its token dispatcher keeps the tensors of one call "
    "on itself for the next step of the same call (0.16.1 transformer/moe/token_dispatcher.py:250-307, "
    "routing_map, local_map, local_probs, ...), a side effect leaving the region that Dynamo cannot trace ('an "
    "intermediate tensor ... created inside a higher-order op subgraph aliases an input or output')",
)
def _layer_compile_region(forward):
    def hidden_states(self, positional, *flat):
        # the region returns the hidden states alone: Dynamo reuses a traced region only when it returns tensors
        # (torch/_dynamo/variables/invoke_subgraph.py, is_reuse_eligible), and the layer's second output, the
        # cross-attention context, is None in a GPT layer
        args, named = flat[:positional], flat[positional:]
        kwargs = dict(zip(named[:len(named) // 2], named[len(named) // 2:]))
        output, context = forward(self, *args, **kwargs)
        if context is not None:
            raise RuntimeError("layer_compile_region: a TransformerLayer returned a cross-attention context; "
                               "take the 'regions' adaptation group off for this model")
        return output

    region = torch.compiler.nested_compile_region(hidden_states)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    @functools.wraps(forward)
    def layer_forward(self, *args, **kwargs):
        # config attributes and a None argument: Dynamo guards on them, so the choice is made once per graph
        if (self.config.tensor_model_parallel_size > 1 or kwargs.get("context") is not None
                or isinstance(self.mlp, MoELayer)):
            return forward(self, *args, **kwargs)
        # every argument positional, the keywords as their names then their values: at each call after the first,
        # Dynamo fingerprints the arguments to find the traced region to reuse, and with keyword arguments (or any
        # argument not a tensor, number, string, None or module) it does so by tracing pytree.tree_flatten over them
        # (invoke_subgraph.py, build_input_fingerprint: the fast path takes flat leaves and no keywords)
        return region(self, len(args), *args, *kwargs.keys(), *kwargs.values()), None

    return layer_forward


# ======================================================================================================
# group "layer_frames": a whole GPTModel under torch.compile, each layer its own frame, compiled once.
# ======================================================================================================

@registry.wraps(
    "block_layers_as_frames", "megatron.core.transformer.transformer_block.TransformerBlock.forward",
    "layer_frames",
    reason="TransformerBlock calls its layers in a Python loop (transformer/transformer_block.py:748-779; the same "
    "loop on 0.12.1) that Dynamo unrolls: torch.compile(gpt_model) traces and compiles every layer again. With the "
    "block's own frame left to Python (torch.compiler.disable(recursive=False): the frames it calls are still "
    "compiled), each layer's forward is a frame of its own that Dynamo compiles once and runs for every layer of "
    "the same structure (its parameters are graph inputs and its guards on structure, not identity: "
    "inline_inbuilt_nn_modules), as the training job compiles each layer; the embedding and the output layer with "
    "the loss are the frames around it. The first step's compile stays flat in the number of layers, where one "
    "graph calling a nested compile region (group 'regions') grows with torch's own per-call work. At tensor "
    "parallel size > 1, or with MoE layers, the block is inlined as before (one graph: the backend's overlap "
    "scheduling sees across layers; an MoE layer's router reads its layer_number, which a frame would guard on)",
)
def _block_layers_as_frames(forward):
    framed = torch.compiler.disable(
        _skipped_copy(forward), recursive=False,
        reason="adaptation 'block_layers_as_frames' (group 'layer_frames'): each layer is compiled as a frame of its "
        "own; for one graph, megatron_glue.adapt(groups_for(one_graph=True)) in a fresh process")

    @functools.wraps(forward)
    def block_forward(self, *args, **kwargs):
        # config attributes: Dynamo guards on them, so the choice is made once per graph
        if self.config.tensor_model_parallel_size > 1 or self.config.num_moe_experts:
            return forward(self, *args, **kwargs)
        return framed(self, *args, **kwargs)

    return block_forward


def _skipped_copy(fn):
    """``fn`` with a code object of its own that Dynamo's frame evaluation skips (this frame only: the frames it
    calls are still compiled). torch.compiler.disable(recursive=False) alone hands the frame to Dynamo's callback
    at every call (it cannot mark a code object that runs elsewhere), which skips it each time after disassembling
    it: half a millisecond a step at 2 layers, and under torch.compiler.set_stance(skip_guard_eval_unsafe=True)
    a refusal, as a recompile. The copy is this adaptation's alone, so the original stays traceable once reverted."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    functools.update_wrapper(own, fn)
    torch._dynamo.eval_frame.skip_code(own.__code__)
    return own


class _LinearImplByWeight:
    """Class-level `_forward_impl` for 0.12/0.13's parallel linears: reads as the choice 0.14+ makes in its
    `_forward_impl` method (frozen weight or not, decided per call from the weight passed), and takes the
    per-call `self._forward_impl = ...` store of those lines without writing the module. Dynamo sees a store that
    changes nothing, so a layer holding these linears stays reusable as a compile region."""

    def __init__(self, adaptation: str):
        self.adaptation = adaptation

    def __get__(self, obj, objtype=None):
        return self if obj is None else _linear_by_weight

    def __set__(self, obj, value):
        from megatron.core.tensor_parallel import layers

        if value is not layers.linear_with_frozen_weight and \
                value is not layers.linear_with_grad_accumulation_and_async_allreduce:
            raise AttributeError(
                f"{type(obj).__name__}._forward_impl is chosen per call from the weight (adaptation "
                f"{self.adaptation!r}, group 'regions'); setting it to {value!r} needs that adaptation reverted")


def _linear_by_weight(input, weight, *args, **kwargs):
    from megatron.core.tensor_parallel import layers

    if not weight.requires_grad:
        return layers.linear_with_frozen_weight(input, weight, *args, **kwargs)
    return layers.linear_with_grad_accumulation_and_async_allreduce(input, weight, *args, **kwargs)


for _linear in ("ColumnParallelLinear", "RowParallelLinear"):
    _name = f"linear_impl_by_weight_0_13_{_linear}"
    registry.replaces(
        _name, f"megatron.core.tensor_parallel.layers.{_linear}._forward_impl",
        "regions",
        reason=f"{_linear}.forward stores its linear function on the module at every call (0.12.1: "
        "tensor_parallel/layers.py:936-939,1171-1174; 0.14 made it a method), a side effect that keeps Dynamo from "
        "reusing a traced layer region (torch/_dynamo/variables/invoke_subgraph.py, is_reuse_eligible): every "
        "layer was traced again; a class-level descriptor makes the store a no-op and the read the same choice",
        megatron_versions="<0.14", adds=True,
    )(_LinearImplByWeight(_name))
del _linear, _name


@registry.wraps(
    "packed_documents", "megatron.core.transformer.dot_product_attention.DotProductAttention.forward", "compile",
    reason="the local DotProductAttention refuses packed_seq_params (transformer/dot_product_attention.py:153) "
    "and takes packed documents only as Megatron's dense "
    "[b, 1, s, s] reset mask; given the documents' lengths in a PackedSeqParams of qkv_format 'sbhd' (the "
    "compiled job with --reset-attention-mask: megatron_glue.training.gpt.packed_documents), it builds that mask "
    "from them in the graph (npu_compile.document_mask), where the varlen_attention rule takes mask and "
    "attention together to the lengths; every other call is the original's. From 0.13 only: 0.12 takes any "
    "packed_seq_params for THD (0.12.1: transformer/attention.py:576-595 squeezes the batch dim and applies RoPE "
    "per sequence), so there the job passes Megatron's dense mask (megatron_glue.training.gpt.passes_lengths)",
    megatron_versions=">=0.13",
)
def _packed_documents(forward):
    @functools.wraps(forward)
    def packed_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                       packed_seq_params=None):
        if packed_seq_params is not None and packed_seq_params.qkv_format == "sbhd":
            import npu_compile.ops  # noqa: F401  (registers torch.ops.npu_compile.document_mask)

            if attention_mask is not None:
                raise ValueError("packed documents come either as lengths (packed_seq_params) or as a mask, not both")
            attention_mask = torch.ops.npu_compile.document_mask(packed_seq_params.cu_seqlens_q, query.size(1),
                                                                 query.size(0))
            packed_seq_params = None
        return forward(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                       attention_bias=attention_bias, packed_seq_params=packed_seq_params)

    return packed_forward



# ======================================================================================================
# group "linear_attention": megatron-core's Gated DeltaNet layer (0.16+: ssm/gated_delta_net.py) without
# flash-linear-attention (FLA), whose kernels are Triton for CUDA. Each stand-in is megatron-core's own torch code,
# or the formula FLA computes; in by groups_for wherever the `fla` package is not installed. Lines are 0.16.1's.
# ======================================================================================================

registry.add(Adaptation(
    "gated_delta_net_without_fla", "megatron.core.ssm.gated_delta_net.HAVE_FLA", "linear_attention",
    reason="GatedDeltaNet.__init__ raises ImportError unless FLA imports (ssm/gated_delta_net.py:39-47,103-106); "
    "its two FLA kernels have the stand-ins of this group (gated_delta_rule_in_torch, l2norm_in_torch)",
    build=lambda have_fla: True, megatron_versions=">=0.16",
))

# The chunk length of the chunked delta rule (MindSpeed-LLM's --mamba-chunk-size); megatron-core's default.
_gdn_chunk_size = 64


def set_gated_delta_rule_chunk_size(chunk_size: int) -> None:
    """The chunk length gated_delta_rule_in_torch runs megatron-core's chunked delta rule with (the training job:
    --mamba-chunk-size). Set it before compiling: Dynamo reads it as a constant of the graph."""
    global _gdn_chunk_size
    if chunk_size < 1:
        raise ValueError(f"the gated delta rule's chunk size must be >= 1, not {chunk_size}")
    _gdn_chunk_size = int(chunk_size)


@registry.wraps(
    "gated_delta_rule_in_torch", "megatron.core.ssm.gated_delta_net.chunk_gated_delta_rule", "linear_attention",
    reason="GatedDeltaNet.forward runs FLA's chunk_gated_delta_rule (ssm/gated_delta_net.py:382-391), None without "
    "FLA; megatron-core's own torch_chunk_gated_delta_rule (ssm/gated_delta_net.py:572-664, its deterministic-mode "
    "kernel, :370-380) computes the same chunked delta rule in plain torch ops, which Dynamo traces into the layer's "
    "graph; its chunk length is set_gated_delta_rule_chunk_size's",
    megatron_versions=">=0.16",
)
def _gated_delta_rule_in_torch(fla_kernel):
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    def chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False):
        return torch_chunk_gated_delta_rule(query, key, value, g=g, beta=beta, chunk_size=_gdn_chunk_size,
                                            initial_state=initial_state, output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)

    return chunk_gated_delta_rule


@registry.replaces(
    "l2norm_in_torch", "megatron.core.ssm.gated_delta_net.l2norm", "linear_attention",
    reason="GatedDeltaNet.forward L2-normalises q and k with FLA's l2norm (ssm/gated_delta_net.py:40,348-350), a "
    "name only the FLA import defines; FLA's is x / sqrt(sum(x^2) + eps), eps 1e-6, in fp32 (fla/modules/l2norm.py; "
    "MindSpeed-LLM's torch copy of it: mindspeed_llm/tasks/models/transformer/qwen3_next_gated_deltanet_attention.py"
    ":76-79)",
    megatron_versions=">=0.16", adds=True,
)
def _l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).sum(dim=dim, keepdim=True) + eps)).to(x.dtype)


@registry.wraps(
    "gated_norm_in_the_layer_graph", "megatron.core.ssm.gated_delta_net.GatedDeltaNet._apply_gated_norm",
    "linear_attention",
    reason="GatedDeltaNet._apply_gated_norm is decorated with jit_fuser (ssm/gated_delta_net.py:411), torch.compile "
    "with Inductor's defaults from torch 2.2 (jit.py:7,20-21): run eagerly it is an Inductor graph of its own "
    "(a C++ build on a CPU); its undecorated function runs as plain ops, which the compiled job traces into the "
    "layer's graph, where the backend's norm rules see them",
    megatron_versions=">=0.16",
)
def _gated_norm_in_the_layer_graph(apply_gated_norm):
    return getattr(apply_gated_norm, "_torchdynamo_orig_callable", apply_gated_norm)
