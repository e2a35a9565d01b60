"""`npu-compile convert --load-model-type tf`: OpenAI's GPT-2 TensorFlow checkpoint layout, on a checkpoint that
TensorFlow itself wrote (fixtures/tf_gpt2, made by its make_tf_gpt2.py with tensorflow-cpu 2.21.0), read without
TensorFlow. The oracle is the same checkpoint loaded by transformers 4.57's own `load_tf_weights_in_gpt2` and
saved as a transformers folder (fixtures/tf_gpt2/hf): every tensor read equals it bitwise, and the TF conversion
is the HF conversion of that folder, tensor for tensor. The job's evaluation of both is test_convert_job.py's."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_glue.convert import main, tf_bundle, tf_io
from test_convert_cli import _fails

pytestmark = [pytest.mark.any_megatron_line, pytest.mark.usefixtures("process_state_kept")]

FIXTURE = Path(__file__).parent / "fixtures" / "tf_gpt2"


def _convert(src, dst, kind="tf", *flags):
    return ["--load-model-type", kind, "--save-model-type", "mg", "--load-dir", str(src), "--save-dir", str(dst),
            *flags]


def _dist_tensors(folder: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(folder / "release"), str(tmp))
    return {k: v for k, v in torch.load(tmp, weights_only=False).items() if isinstance(v, torch.Tensor)}


def test_every_tensor_equals_transformers_tf_loader():
    reader = tf_io.TFGPT2Reader(str(FIXTURE / "tf"))
    hf = load_file(FIXTURE / "hf" / "model.safetensors")
    assert sorted(reader.names()) == sorted(hf)  # 28: 12 per layer, wte, wpe, ln_f's two
    for name in hf:
        got = reader.get(name)
        assert got.dtype == hf[name].dtype and torch.equal(got, hf[name]), name
    # the names both ways, as load_tf_weights_in_gpt2 walks them
    for tf_name in reader.bundle.names():
        assert tf_io.tf_name(tf_io.transformers_name(tf_name)) == tf_name
    assert tf_io.transformers_name("model/h1/attn/c_attn/w") == "transformer.h.1.attn.c_attn.weight"
    assert tf_io.transformers_name("model/ln_f/g") == "transformer.ln_f.weight"
    assert tf_io.transformers_name("model/wte") == "transformer.wte.weight"
    entry = reader.bundle.entries["model/h0/attn/c_attn/w"]
    assert (entry.dtype, entry.shape) == (1, [1, 32, 96])  # DT_FLOAT, OpenAI's conv1d [1, nx, nf]
    assert tuple(reader.get("transformer.h.0.attn.c_attn.weight").shape) == (32, 96)


def test_dtypes_and_crc_against_tensorflows_own_definitions():
    """The DataType numbers against tensorboard's copy of tensorflow/core/framework/types.proto, and the masked
    CRC-32C against its independent implementation (the TFRecord writer's)."""
    from tensorboard.compat.proto import types_pb2
    from tensorboard.compat.tensorflow_stub import pywrap_tensorflow as tb

    names = {1: "DT_FLOAT", 2: "DT_DOUBLE", 3: "DT_INT32", 4: "DT_UINT8", 5: "DT_INT16", 6: "DT_INT8",
             9: "DT_INT64", 10: "DT_BOOL", 17: "DT_UINT16", 19: "DT_HALF", 22: "DT_UINT32", 23: "DT_UINT64"}
    assert sorted(names) == sorted(tf_bundle.DTYPES)
    for number, name in names.items():
        assert types_pb2.DataType.Value(name) == number, name
    assert types_pb2.DataType.Value("DT_BFLOAT16") == tf_bundle.DT_BFLOAT16
    data = (FIXTURE / "tf" / "model.ckpt.data-00000-of-00001").read_bytes()[:5000]
    assert tf_bundle.crc32c(data) == tb.crc32c(data)
    assert tf_bundle.unmask(tb.masked_crc32c(data)) == tb.crc32c(data)
    # a tensor of a megabyte and more runs numpy's chunked CRC (the fixture's are smaller): an odd length, so
    # that the tail after the chunks is bytes too
    big = torch.randint(0, 256, (16384 * 66 + 1,), generator=torch.Generator().manual_seed(0),
                        dtype=torch.uint8).numpy().tobytes()
    assert tf_bundle.crc32c(big) == tb.crc32c(big)


def test_the_tf_conversion_is_the_hf_conversion(tmp_path, capsys):
    assert main(_convert(FIXTURE / "tf", tmp_path / "tf")) == 0
    assert main(_convert(FIXTURE / "hf", tmp_path / "hf", "hf")) == 0
    assert (tmp_path / "tf" / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert (tmp_path / "tf" / "model_flags.txt").read_text() == (tmp_path / "hf" / "model_flags.txt").read_text()
    a, b = _dist_tensors(tmp_path / "tf", tmp_path / "a.pt"), _dist_tensors(tmp_path / "hf", tmp_path / "b.pt")
    assert sorted(a) == sorted(b) and len(a) == 16
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    # and back to transformers: the weights transformers' TF loader gave, bitwise
    back = tmp_path / "back"
    assert main(["--load-model-type", "mg", "--save-model-type", "hf", "--load-dir", str(tmp_path / "tf"),
                 "--save-dir", str(back)]) == 0
    want = load_file(FIXTURE / "hf" / "model.safetensors")
    got = {}
    for f in back.glob("*.safetensors"):
        got.update(load_file(f))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_legacy_format_too(tmp_path):
    """--ckpt-format torch at TP=2: the per-rank files of the tf and hf conversions hold the same tensors."""
    for kind in ("tf", "hf"):
        assert main(_convert(FIXTURE / kind, tmp_path / kind, kind, "--ckpt-format", "torch",
                             "--target-tensor-parallel-size", "2")) == 0
    for rank in ("mp_rank_00", "mp_rank_01"):
        a, b = (torch.load(tmp_path / kind / "release" / rank / "model_optim_rng.pt", weights_only=False)["model"]
                for kind in ("tf", "hf"))
        assert list(a) == list(b)
        for name, t in a.items():
            assert (t is None and b[name] is None) or torch.equal(t, b[name]), (rank, name)


def test_a_checkpoint_missing_a_tensor_names_it(tmp_path, capsys):
    folder = FIXTURE / "tf_missing"
    assert _fails(_convert(folder, tmp_path), capsys) == (
        1, f"{folder}: the gpt2 table reads 'model/h1/attn/c_attn/w', which the checkpoint does not have; is it a "
           "complete GPT-2 checkpoint (OpenAI's gpt-2 layout)?")
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()


def _copy(tmp_path: Path) -> Path:
    folder = tmp_path / "tf"
    shutil.copytree(FIXTURE / "tf", folder)
    return folder


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_corrupted_data_file_fails_its_crc(tmp_path, capsys):
    folder = _copy(tmp_path)
    entry = tf_io.TFGPT2Reader(str(folder)).bundle.entries["model/h0/mlp/c_fc/w"]
    data = folder / "model.ckpt.data-00000-of-00001"
    _flip(data, entry.offset + 100)
    computed = tf_bundle.crc32c(data.read_bytes()[entry.offset:entry.offset + entry.size])
    code, err = _fails(_convert(folder, tmp_path / "mg"), capsys)
    assert (code, err) == (1, f"{data}: 'model/h0/mlp/c_fc/w' (16384 bytes at offset {entry.offset}) fails its "
                              f"crc32c check (stored {tf_bundle.unmask(entry.crc32c):08x}, computed {computed:08x}); "
                              "the file is corrupt")
    assert not (tmp_path / "mg" / "latest_checkpointed_iteration.txt").exists()


def test_a_corrupted_or_truncated_index(tmp_path, capsys):
    folder = _copy(tmp_path)
    index = folder / "model.ckpt.index"
    _flip(index, 40)  # inside the one data block's entries
    assert _fails(_convert(folder, tmp_path / "mg"), capsys) == (
        1, f"{index}: the block at offset 0 fails its crc32c check; the file is corrupt")
    index.write_bytes((FIXTURE / "tf" / "model.ckpt.index").read_bytes()[:-10])
    assert _fails(_convert(folder, tmp_path / "mg"), capsys) == (
        1, f"{index}: not a TensorFlow checkpoint index (no table magic number at its end)")


def test_a_truncated_data_file(tmp_path, capsys):
    folder = _copy(tmp_path)
    data = folder / "model.ckpt.data-00000-of-00001"
    data.write_bytes(data.read_bytes()[:1000])
    code, err = _fails(_convert(folder, tmp_path / "mg"), capsys)
    assert code == 1 and err.startswith(f"{data}: '") and err.endswith(" the file is truncated"), err


def test_refusals(tmp_path, capsys):
    assert _fails(["--load-model-type", "tf", "--save-model-type", "hf", "--load-dir", str(FIXTURE / "tf"),
                   "--save-dir", str(tmp_path)], capsys) == (
        2, "--load-model-type tf --save-model-type hf: converts hf -> mg, mg -> hf or tf -> mg")
    assert _fails(_convert(FIXTURE / "tf", tmp_path, "tf", "--model-type-hf", "llama3"), capsys) == (
        2, "--load-model-type tf --model-type-hf llama3: TensorFlow checkpoints are read in OpenAI's GPT-2 layout "
           "only; give --model-type-hf gpt2 or leave it out")
    folder = _copy(tmp_path)
    os.remove(folder / "hparams.json")
    assert _fails(_convert(folder, tmp_path / "mg"), capsys) == (
        1, f"{folder}: no hparams.json; OpenAI's gpt-2 checkpoints give the model's sizes there (n_vocab, n_ctx, "
           "n_embd, n_head, n_layer)")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "hparams.json").write_text((FIXTURE / "tf" / "hparams.json").read_text())
    assert _fails(_convert(empty, tmp_path / "mg"), capsys) == (
        1, f"{empty}: no *.index files and no `checkpoint` file; expected OpenAI's gpt-2 layout (model.ckpt.index, "
           "model.ckpt.data-00000-of-00001, checkpoint, hparams.json)")
