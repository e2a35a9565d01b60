"""HF <-> Megatron checkpoint conversion, streamed: hf -> mg writes a megatron-core torch_dist checkpoint in
Megatron-LM's layout that `megatron_glue.pretrain_gpt --load DIR --finetune` loads at any TP/PP; mg -> hf writes
safetensors and config.json from a torch_dist (any TP/PP) or `--ckpt-format torch` checkpoint.

What is held at once: one HF tensor group (a layer's q, k, v for its qkv) on the way in; one layer on the way
out. The family tables (`families`) say everything model-specific.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import types

import torch

from megatron_glue.convert import hf_io, torch_dist
from megatron_glue.convert.families import ConfigError, Family, family_for
from megatron_glue.convert.transforms import TRANSFORMS

RELEASE = "release"
FLAGS_FILE = "model_flags.txt"   # the pretrain_gpt architecture flags of a converted checkpoint, one line
# Architecture values a converted checkpoint records beside Megatron-LM's arguments (checkpointing.ARCHITECTURE
# is what pretrain_gpt refuses to differ from).
RECORDED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
            "kv_channels", "group_query_attention", "max_position_embeddings", "position_embedding_type",
            "rotary_base", "rotary_percent", "use_rope_scaling", "rope_scaling_factor", "normalization",
            "norm_epsilon", "swiglu", "openai_gelu", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
            "untie_embeddings_and_output_weights", "make_vocab_size_divisible_by", "orig_vocab_size",
            "padded_vocab_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "params_dtype")
# no family here has these: mg -> hf refuses a checkpoint that has them
RECORDED += ("add_rmsnorm_offset", "squared_relu", "gelu_tanh", "query_pre_attn_scalar", "input_embeds_norm",
             "output_logit_softcapping")


class ConvertError(ValueError):
    """Bad input to the converter: names what is wrong and what would be right."""


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="layer", disable=None, file=sys.stderr)


# -- the architecture ------------------------------------------------------------------------------------------

def architecture_flags(family: Family, cfg: dict) -> list[str]:
    """The pretrain_gpt flags that build this HF model's architecture."""
    for refused, why in family.refuse:
        if refused(cfg):
            raise ConfigError(f"{family.name}: config.json is not convertible: {why}")
    flags = list(family.flags)
    for flag, source in family.config:
        value = cfg.get(source) if isinstance(source, str) else source(cfg)
        if value is None or value is False:
            continue
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def architecture(family: Family, cfg: dict, tp: int = 1, pp: int = 1, divisible_by: int = 128,
                 dtype: torch.dtype = torch.float32) -> argparse.Namespace:
    """pretrain_gpt's args for this model at TP x PP (parsed by the job's own parser and checks)."""
    from megatron_glue.training.arguments import ArgumentError, parse_args
    from megatron_glue.data.tokenizer import padded_vocab_size

    flags = architecture_flags(family, cfg)
    heads, groups = cfg.get("num_attention_heads", cfg.get("n_head")), cfg.get("num_key_value_heads")
    if groups and groups % tp:
        raise ConvertError(f"--target-tensor-parallel-size {tp}: the model has {groups} key/value heads "
                           f"(num_key_value_heads), not divisible by {tp}; megatron-core would replicate and slice "
                           f"them. Use a TP size that divides {groups}")
    if heads % tp:
        raise ConvertError(f"--target-tensor-parallel-size {tp}: {heads} attention heads are not divisible by {tp}")
    vocab = cfg["vocab_size"]
    seq = str(cfg.get("max_position_embeddings") or cfg.get("n_positions") or 2048)
    job = ["--seq-length", seq, "--micro-batch-size", "1", "--train-iters", "0", "--skip-train",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", str(vocab),
           "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
           "--make-vocab-size-divisible-by", str(divisible_by)]
    # --qk-layernorm is set on the parsed args rather than parsed, so that the architecture is built the same with a
    # job parser that has the flag and one that does not (megatron_glue.training.gpt reads the attribute)
    parsed = [f for f in flags if f != "--qk-layernorm"]
    try:
        args = parse_args(parsed + job, world_size=tp * pp)
    except ArgumentError as e:
        raise ConvertError(f"{family.name} config.json gives pretrain_gpt flags it refuses: {e.message}")
    args.qk_layernorm = "--qk-layernorm" in flags
    args.orig_vocab_size = vocab
    args.padded_vocab_size = padded_vocab_size(vocab, divisible_by, tp)
    args.params_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    args.flags = flags
    return args


def recorded_args(args, model_type_hf: str | None, cfg: dict, num_layer_list) -> dict:
    out = {k: getattr(args, k) for k in RECORDED}
    out.update(model_type_hf=model_type_hf, hf_config=cfg, num_layer_list=num_layer_list,
               architecture_flags=" ".join(args.flags), tokenizer_model=getattr(args, "tokenizer_model", None))
    return out


def _when(row, args) -> bool:
    return row.when is None or bool(getattr(args, row.when))


def on_layer(row, args, layer: int) -> bool:
    """Whether layer `layer` has the row's tensor (a hybrid model's layers differ: families.LAYER_KINDS)."""
    from megatron_glue.convert.families import LAYER_KINDS

    return row.layers is None or LAYER_KINDS[row.layers](args, layer)


def _split_part(family: Family, name: str):
    """(module tensor name, part index, sizes function) when `name` is one of the keys megatron-core splits a
    tensor into (families.Family.split), else None."""
    for module, parts, sizes in family.split:
        if name.startswith(module + ".") and name[len(module) + 1:] in parts:
            return module, parts.index(name[len(module) + 1:]), sizes
    return None


def _heterogeneous(family: Family) -> bool:
    return bool(family.split) or any(r.layers for r in family.tensors)


def meta_model(args, dtype: torch.dtype, num_layers: int | None = None, pre_process: bool = True,
               post_process: bool = True):
    """megatron-core GPTModel of this architecture on the meta device (no memory), at TP=PP=1 (a torch_dist
    checkpoint's keys and global shapes do not depend on the layout); `num_layers`, pre/post_process: one
    pipeline stage of the legacy format."""
    from megatron_glue.capture import quiet_megatron
    from megatron_glue.capture.adaptations import set_current_device
    from megatron_glue.training import gpt, training

    one = copy.copy(args)
    if num_layers is not None:
        one.num_layers = num_layers
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = 1
    one.virtual_pipeline_model_parallel_size, one.sequence_parallel = None, False
    config = training.transformer_config(one, types.SimpleNamespace(device=torch.device("cpu")))
    config.perform_initialization = False
    config.params_dtype = dtype
    set_current_device("meta")
    try:
        with torch.device("meta"), quiet_megatron():
            model = gpt.model_provider(one, config, pre_process=pre_process, post_process=post_process)
    finally:
        set_current_device(None)
    # every tensor in the HF checkpoint's dtype (megatron-core makes its norms fp32 whatever params_dtype is)
    return model.to(dtype)


@contextlib.contextmanager
def _single_process():
    """A one-process gloo group and TP=PP=1 parallel state for megatron-core's save, undone after unless the
    caller had set them up."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_glue.capture import adapt
    from megatron_glue.capture.adaptations import groups_for, registry
    from megatron_glue.capture.models import init_single_process, teardown_single_process

    # building a model (on the meta device) needs only what megatron-core needs off CUDA (and, where the machine
    # lacks the `fla` package, the "linear_attention" group's stand-ins that let megatron-core's GatedDeltaNet be
    # built: Qwen3-Next), and the unit-offset RMSNorm of --add-rmsnorm-offset (Gemma 2, Qwen3-Next), which
    # megatron-core's local norm refuses
    adapt(tuple(g for g in groups_for() if g in ("cpu", "linear_attention")))
    # GatedDeltaNet puts some parameters on torch.cuda.current_device() (ssm/gated_delta_net.py:172,187,196): the
    # stand-in answers the meta device while meta_model builds
    stand_in = "current_device_stand_in" not in registry.applied()  # taken off after, unless applied before
    registry.apply("zero_centered_rms_norm", "current_device_stand_in")
    ours = not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    if not ours and (dist.get_world_size() > 1 or parallel_state.get_tensor_model_parallel_world_size() > 1
                     or parallel_state.get_pipeline_model_parallel_world_size() > 1):
        raise ConvertError("the converter runs in one process; this one is part of a process group of "
                           f"{dist.get_world_size()}")
    init_single_process()
    try:
        yield
    finally:
        if ours:
            teardown_single_process()
        if stand_in:
            registry.revert("current_device_stand_in")


# -- hf -> mg ---------------------------------------------------------------------------------------------------

def hf_to_mg(load_dir: str, save_dir: str, model_type_hf: str | None = None, tp: int = 1, pp: int = 1,
             num_layer_list: list[int] | None = None, divisible_by: int = 128,
             ckpt_format: str = "torch_dist", params_dtype: torch.dtype | None = None,
             expect: dict[str, str] | None = None, tokenizer_model: str | None = None,
             ep: int = 1, source: str = "hf") -> argparse.Namespace:
    """Convert the HF model in `load_dir` into a Megatron checkpoint in `save_dir` (release; torch_dist, or with
    ckpt_format "torch" Megatron-LM's legacy files split for TP x PP, stages by `num_layer_list` or even; a
    torch_dist checkpoint is layout-free: `num_layer_list` is only checked against the model). Returns the job's
    args for it (`args.flags`: the architecture flags pretrain_gpt needs).

    ep: the expert-parallel size it is meant for, checked against the experts (the checkpoint does not depend on
    it). params_dtype: the checkpoint's dtype (default: the HF weights'). expect: {pretrain_gpt architecture flag: the
    command-line words that said the model has it}, checked. tokenizer_model: recorded in the checkpoint's args.
    source: "hf", a transformers folder, or "tf", OpenAI's GPT-2 TensorFlow checkpoint read as the transformers
    GPT-2 it converts to (`tf_io`)."""

    if ckpt_format not in ("torch_dist", "torch"):
        raise ConvertError(f"--ckpt-format {ckpt_format!r}: choose torch_dist or torch")
    if source == "tf":
        from megatron_glue.convert import tf_io

        cfg = tf_io.gpt2_config(load_dir)
    else:
        cfg = hf_io.read_config(load_dir)
    family = family_for(model_type_hf, cfg)
    if ckpt_format == "torch" and any(r.expert for r in family.tensors):
        raise ConvertError(f"--ckpt-format torch: the legacy format of an MoE model ({family.name}) is not written "
                           "here; use --ckpt-format torch_dist (the job loads it at any layout)")
    if ckpt_format == "torch" and _heterogeneous(family):
        raise ConvertError(f"--ckpt-format torch: the legacy format of a hybrid model ({family.name}: layers of "
                           "two kinds) is not written here; use --ckpt-format torch_dist (the job loads it at any "
                           "layout)")
    reader = tf_io.TFGPT2Reader(load_dir) if source == "tf" else hf_io.HFReader(load_dir)
    first = family.tensors[0].hf[0]
    dtype = params_dtype or (reader.get(first).dtype if first in reader else torch.float32)
    # an uneven --num-layer-list need not divide the layers evenly: the job's even-split check is not asked
    args = architecture(family, cfg, tp, 1 if num_layer_list else pp, divisible_by, dtype)
    args.pipeline_model_parallel_size = pp
    _check_expected(family, args, expect)
    experts = getattr(args, "num_experts", None)
    if ep != 1 and not experts:
        raise ConvertError(f"--target-expert-parallel-size {ep}: the {family.name} model has no experts; leave it 1")
    if ep < 1 or experts and experts % ep:
        raise ConvertError(f"--target-expert-parallel-size {ep}: the model's {experts} experts are not divisible by "
                           f"{ep}; use a size that divides them")
    layers = args.num_layers
    if num_layer_list is not None:
        if len(num_layer_list) != pp or sum(num_layer_list) != layers or min(num_layer_list) < 1:
            raise ConvertError(f"--num-layer-list {','.join(map(str, num_layer_list))}: needs "
                               f"{pp} stages (--target-pipeline-parallel-size) of at least one layer summing to "
                               f"the model's {layers} layers")
        if ckpt_format == "torch_dist":
            num_layer_list = None  # layout-free: the job's own --num-layer-list splits it when it loads
    for check, note in family.notes:
        if check(cfg):
            print(f"npu-compile convert: note: {family.name}: {note}", file=sys.stderr)
    rows = [r for r in family.tensors if _when(r, args)]
    _check_names(reader, family, rows, args, layers)

    args.tokenizer_model = tokenizer_model
    with _single_process():
        _save(args, family, cfg, reader, rows, dtype, layers, save_dir, model_type_hf, num_layer_list, divisible_by,
              ckpt_format)
    return args


def _check_expected(family: Family, args, expect: dict[str, str] | None) -> None:
    for flag, said in (expect or {}).items():
        if flag not in args.flags:
            raise ConvertError(f"{said}: the {family.name} model has no {flag[2:].replace('-', ' ')} (its "
                               f"architecture flags: {' '.join(args.flags)})")


def _save(args, family, cfg, reader, rows, dtype, layers, save_dir, model_type_hf, num_layer_list, divisible_by,
          ckpt_format):
    from megatron_glue.training.checkpointing import CHECKPOINT_VERSION, TRACKER, iteration_dir
    from megatron_glue.convert import legacy

    model = meta_model(args, dtype)
    state = {"model": model.sharded_state_dict(), "checkpoint_version": CHECKPOINT_VERSION, "iteration": 0,
             "consumed_train_samples": 0, "consumed_valid_samples": 0,
             "args": recorded_args(args, model_type_hf, cfg, num_layer_list)}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    by_name = {(r.mcore, r.layer): r for r in rows}
    bar = _progress(layers + 1, "hf -> mg")
    done_layers: set = set()
    cache: dict = {}

    def full(name: str, layer: int | None, expert: int | None = None) -> torch.Tensor:
        key = (name, layer, expert)
        if key not in cache:
            row = by_name.get((name, layer is not None))
            if row is None:
                raise ConvertError(f"megatron-core's {family.name} model has a tensor {name!r} that the family "
                                   "table does not produce; add a row for it")
            cache.clear()  # one converted tensor held at a time (the GLU fc1 is written as two chunks), let go
            names = [n.format(i=layer, e=expert) for n in row.hf]
            hf = [reader.get(n) for n in names]  # before the next one's inputs are read
            try:
                t = TRANSFORMS[row.transform].to_mcore(hf, args).to(dtype)
            except ValueError as e:  # a transform's check of its input, e.g. the embedding's rows
                raise ConvertError(f"{', '.join(names)}: {e}")
            first = next((i for i in range(layers) if on_layer(row, args, i)), 0)
            want = shapes.get(f"{torch_dist.LAYERS}{first}.{name.format(e=expert)}" if layer is not None else name)
            if want is not None and tuple(t.shape) != want:
                raise ConvertError(f"the {family.name} table's {row.transform!r} of {', '.join(row.hf)} gives "
                                   f"{name} the shape {tuple(t.shape)}; megatron-core's model has {want}")
            cache[key] = t
        return cache[key]

    def produce(key: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        lead = 0  # leading axes of the key that index tensors (layer; layer and expert)
        if key.startswith(torch_dist.LAYERS):
            sub = key[len(torch_dist.LAYERS):]
            numbered = torch_dist.numbered_layer(sub)
            if numbered is not None:  # a hybrid block's keys: decoder.layers.<i>.<name>, no layer axis
                layer, sub = numbered
            else:
                layer = offsets[0]
            expert_name = torch_dist.expert_name(sub)
            if expert_name is not None:
                t, lead = full(expert_name, layer, offsets[1]).unsqueeze(0).unsqueeze(0), 2
            else:
                name = torch_dist.module_name(sub, args.normalization)
                part = _split_part(family, name)
                if part is not None:  # one of the keys megatron-core saves this tensor as
                    module, index, part_sizes = part
                    t = full(module, layer).split(part_sizes(args))[index]
                else:
                    t = full(name, layer)
                t, lead = (t, 0) if numbered is not None else (t.unsqueeze(0), 1)
            if layer not in done_layers:
                done_layers.add(layer)
                bar.update(1)
        else:
            t = full(key, None)
        expect = tuple(t.shape)
        for dim, (o, s) in enumerate(zip(offsets, sizes)):
            if dim >= lead:
                t = t.narrow(dim, o, s)
        if len(expect) != len(sizes):
            raise ConvertError(f"{key}: the family table gives shape {expect[lead:]}, megatron-core expects {sizes}")
        return t.contiguous()

    os.makedirs(save_dir, exist_ok=True)
    folder = iteration_dir(save_dir, RELEASE)
    if os.path.isdir(folder):
        import shutil

        shutil.rmtree(folder)
    os.makedirs(folder)
    if ckpt_format == "torch":
        legacy.save(folder, args, dtype, state["args"], rows, full, num_layer_list, lambda: bar.update(1))
    else:
        torch_dist.save_streaming(state, folder, produce)
    bar.update(1)
    bar.close()
    with open(os.path.join(save_dir, FLAGS_FILE), "w") as f:
        f.write(" ".join(args.flags + ["--make-vocab-size-divisible-by", str(divisible_by)]) + "\n")
    tmp = os.path.join(save_dir, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(RELEASE)
    os.replace(tmp, os.path.join(save_dir, TRACKER))  # committed only once complete


def _check_names(reader, family, rows, args, layers) -> None:
    """Every tensor the table reads is in the checkpoint, and every tensor of the checkpoint is read."""
    wanted = set()
    experts = range(getattr(args, "num_experts", None) or 0)
    for r in rows:
        for name in r.hf:
            if r.expert:
                wanted |= {name.format(i=i, e=e) for i in range(layers) for e in experts}
            else:
                wanted |= {name.format(i=i) for i in range(layers) if on_layer(r, args, i)} if r.layer else {name}
    have = set(reader.names())
    missing = sorted(wanted - have)
    # a TensorFlow checkpoint's names are its own (tf_io.TFGPT2Reader.source_name), not transformers'
    source = getattr(reader, "source_name", lambda n: n)
    if missing:
        raise ConvertError(f"{reader.folder}: the {family.name} table reads {source(missing[0])!r}"
                           f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}, which the checkpoint "
                           f"does not have; {getattr(reader, 'missing_hint', 'is --model-type-hf right?')}")
    ignored = {n.format(i=i) for n in family.ignored_hf for i in range(layers)}
    extra = sorted(have - wanted - ignored)
    if extra:
        raise ConvertError(f"{reader.folder}: the checkpoint has {source(extra[0])!r}"
                           f"{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}, which the {family.name} "
                           "table has no place for; converting would drop it")


# -- mg -> hf ---------------------------------------------------------------------------------------------------

def _mg_folder(load_dir: str) -> str:
    from megatron_glue.training.checkpointing import TRACKER, iteration_dir, read_tracker

    tracker = read_tracker(load_dir)
    if tracker is None:
        if os.path.isfile(os.path.join(load_dir, "metadata.json")) or any(
                n.startswith("mp_rank_") for n in os.listdir(load_dir)):
            return load_dir  # an iteration folder itself
        raise ConvertError(f"--load-dir {load_dir}: no {TRACKER} and no checkpoint files; expected a Megatron "
                           "checkpoint directory")
    folder = iteration_dir(load_dir, tracker)
    if not os.path.isdir(folder):
        raise ConvertError(f"{os.path.join(load_dir, TRACKER)} names {tracker}, but {folder} is missing")
    return folder


def mg_to_hf(load_dir: str, save_dir: str, hf_cfg_dir: str | None = None,
             model_type_hf: str | None = None, params_dtype: torch.dtype | None = None,
             expect: dict[str, str] | None = None) -> str:
    """Convert the Megatron checkpoint in `load_dir` (torch_dist or torch, any TP/PP) to an HF folder
    `save_dir` that `from_pretrained` loads. config.json comes from `hf_cfg_dir` (checked against the
    checkpoint's architecture) or, for checkpoints this converter wrote, from the config it recorded.
    params_dtype: the HF weights' dtype (default: the checkpoint's); expect: as hf_to_mg's."""
    from megatron_glue.convert import legacy

    _check_no_weights_in(save_dir)
    folder = _mg_folder(load_dir)
    is_dist = os.path.isfile(os.path.join(folder, "metadata.json"))
    if is_dist:
        from megatron.core import dist_checkpointing

        saved = dist_checkpointing.load_common_state_dict(folder).get("args", {})
    else:
        saved = legacy.saved_args(folder)
    if hf_cfg_dir is not None:
        cfg = hf_io.read_config(hf_cfg_dir)
    elif isinstance(saved.get("hf_config"), dict):
        cfg = saved["hf_config"]
    else:
        raise ConvertError(f"{folder} was not written by `npu-compile convert`: give --hf-cfg-dir, the HF folder "
                           "whose config.json describes this model")
    family = family_for(model_type_hf or saved.get("model_type_hf"), cfg)
    args = architecture(family, cfg, divisible_by=saved.get("make_vocab_size_divisible_by", 128))
    _check_expected(family, args, expect)
    _check_same_architecture(args, saved, folder, hf_cfg_dir)
    rows = [r for r in family.tensors if _when(r, args)]
    layer_rows = [r for r in rows if r.layer and not r.expert]
    expert_rows = [r for r in rows if r.expert]
    top_rows = [r for r in rows if not r.layer]
    layers = args.num_layers

    if is_dist:
        metadata = torch_dist.tensor_metadata(folder)
        numbered = any(torch_dist.numbered_layer(k[len(torch_dist.LAYERS):]) for k in metadata
                       if k.startswith(torch_dist.LAYERS))

        def keys_of(name: str, layer: int | None) -> list[str]:
            if layer is None:
                return [name]
            split = next(((m, p) for m, p, _ in family.split if m == name), None)
            parts = [f"{name}.{p}" for p in split[1]] if split else [name]  # saved as several keys: read each
            # a hybrid block saves each layer under its own number (transformer_block.py, non_homogeneous_layers)
            stem = f"{torch_dist.LAYERS}{layer}." if numbered else torch_dist.LAYERS
            return [stem + torch_dist.sharded_name(n, args.normalization) for n in parts]

        def read(names: list[str], layer: int | None):
            keys = {n: keys_of(n, layer) for n in names}
            flat = [k for ks in keys.values() for k in ks]
            absent = [k for k in flat if k not in metadata]
            if absent:
                raise ConvertError(f"{folder} has no tensor {absent[0]!r}; is it a {family.name} model?")
            got = torch_dist.load_slices(folder, {k: None if numbered else layer for k in flat}, metadata)
            return {n: got[ks[0]] if len(ks) == 1 else torch.cat([got[k] for k in ks])
                    for n, ks in keys.items()}
    else:
        if any(r.expert for r in rows):
            raise ConvertError(f"{folder}: a --ckpt-format torch checkpoint of an MoE model ({family.name}) is not "
                               "read here; save it as torch_dist (the job's --ckpt-format torch_dist) and convert that")
        if _heterogeneous(family):
            raise ConvertError(f"{folder}: a --ckpt-format torch checkpoint of a hybrid model ({family.name}) is not "
                               "read here; save it as torch_dist (the job's --ckpt-format torch_dist) and convert that")
        read = legacy.reader(folder, family, args, saved)

    # the vocabulary is sliced to config.json's (the padding rows are Megatron's)
    args.padded_vocab_size = None
    writer = hf_io.HFWriter(save_dir, layers + 1)
    bar = _progress(layers + 1, "mg -> hf")
    dtype = None
    for layer in range(layers):
        here = [r for r in layer_rows if on_layer(r, args, layer)]
        got = read([r.mcore for r in here], layer)
        out = {}
        for r in here:
            for name, t in zip(r.hf, TRANSFORMS[r.transform].to_hf(got[r.mcore], args)):
                out[name.format(i=layer)] = t if params_dtype is None else t.to(params_dtype)
        for e in range(args.num_experts or 0) if expert_rows else ():
            got = _read_expert(folder, metadata, [r.mcore for r in expert_rows], layer, e, args)
            for r in expert_rows:
                for name, t in zip(r.hf, TRANSFORMS[r.transform].to_hf(got[r.mcore], args)):
                    out[name.format(i=layer, e=e)] = t if params_dtype is None else t.to(params_dtype)
        dtype = dtype or max(out.values(), key=torch.Tensor.numel).dtype  # the weights', not the norms'
        writer.write(out)
        del got, out
        bar.update(1)
    got = read([r.mcore for r in top_rows], None)
    out = {}
    for r in top_rows:
        for name, t in zip(r.hf, TRANSFORMS[r.transform].to_hf(got[r.mcore], args)):
            out[name] = t if params_dtype is None else t.to(params_dtype)
    writer.write(out)
    bar.update(1)
    bar.close()
    _write_config(cfg, family, hf_cfg_dir, save_dir, dtype)
    writer.close()
    return save_dir


def _read_expert(folder: str, metadata: dict, names: list[str], layer: int, expert: int, args) -> dict:
    """{per-expert name template: expert `expert`'s tensor of layer `layer`} from a torch_dist checkpoint."""
    keys = [torch_dist.LAYERS + torch_dist.sharded_name(n, args.normalization) for n in names]
    absent = [k for k in keys if k not in metadata]
    if absent:
        raise ConvertError(f"{folder} has no tensor {absent[0]!r}; is it an MoE model with SequentialMLP experts?")
    shape = metadata[keys[0]][0]
    if shape[1] != args.num_experts:
        raise ConvertError(f"{folder} has {shape[1]} experts per layer; the config gives {args.num_experts}")
    got = torch_dist.load_slices(folder, {k: (layer, expert) for k in keys}, metadata)
    return {n: got[k] for n, k in zip(names, keys)}


def _check_no_weights_in(save_dir: str) -> None:
    """MindSpeed-LLM's convert_ckpt.py writes mg -> hf into <--save-dir>/mg2hf, and its scripts give the original HF
    folder as --save-dir: weights written there would replace that model's."""
    if os.path.isdir(save_dir) and any(n.endswith((".safetensors", ".bin")) for n in os.listdir(save_dir)):
        raise ConvertError(f"--save-dir {save_dir} already holds model weights; give an empty or new folder (e.g. "
                           f"{os.path.join(save_dir, 'mg2hf')}, where MindSpeed-LLM's convert_ckpt.py writes)")


def _check_same_architecture(args, saved: dict, folder: str, hf_cfg_dir: str | None) -> None:
    from megatron_glue.training.checkpointing import ARCHITECTURE, resolved_architecture

    source = f"--hf-cfg-dir {hf_cfg_dir}" if hf_cfg_dir else "the recorded config.json"
    saved = resolved_architecture(saved)  # a job's defaults (kv_channels None: the head size) as values
    ours = resolved_architecture({k: getattr(args, k, None) for k in (*ARCHITECTURE, "group_query_attention")})
    for key in ARCHITECTURE:
        if key in ("padded_vocab_size",) or key not in saved:
            continue
        if ours[key] != saved[key]:
            raise ConvertError(f"{folder} was saved with {key} {saved[key]!r}; {source} gives "
                               f"{ours[key]!r}: it describes another model")


def check_job_architecture(job, family: Family, cfg: dict, source: str) -> None:
    """A training job's parsed args build the model `cfg` describes (the vocabulary aside: the job's tokenizer sets
    it later); ConvertError naming the first value that differs. The job's --enable-mg2hf-convert asks it before
    it starts, so that its saves convert."""
    from megatron_glue.training.checkpointing import ARCHITECTURE, resolved_architecture

    ours = architecture(family, cfg)
    keys = [k for k in ARCHITECTURE if k not in ("orig_vocab_size", "padded_vocab_size")]
    want = resolved_architecture({k: getattr(ours, k, None) for k in (*keys, "group_query_attention")})
    have = resolved_architecture({k: getattr(job, k, None) for k in (*keys, "group_query_attention")})
    for key in keys:
        if want[key] != have[key]:
            raise ConvertError(f"its config.json gives {key} {want[key]!r} ({family.name}: "
                               f"{' '.join(ours.flags)}); the job's flags give {have[key]!r}: it describes another "
                               "model")
    if bool(getattr(job, "qk_layernorm", False)) != ("--qk-layernorm" in ours.flags):
        raise ConvertError(f"its config.json gives qk_layernorm {'--qk-layernorm' in ours.flags} ({family.name}); the "
                           f"job's flags give {bool(getattr(job, 'qk_layernorm', False))}: it describes another model")


def _write_config(cfg: dict, family: Family, hf_cfg_dir: str | None, save_dir: str, dtype) -> None:
    if hf_cfg_dir is not None:
        hf_io.carry_files(hf_cfg_dir, save_dir)
    out = dict(cfg)
    out.setdefault("architectures", [family.hf_architecture])
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        out["dtype" if "dtype" in cfg or "torch_dtype" not in cfg else "torch_dtype"] = name
    with open(os.path.join(save_dir, "config.json"), "w") as f:
        json.dump(out, f, indent=2, sort_keys=True)
