"""`npu-compile preprocess --handler-name AlpacaStyleInstructionHandler --prompt-type NAME`: MindSpeed-LLM's
instruction datasets (three `_packed_*_document` datasets, prompt labelled -100), token by token."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from megatron_glue.capture.adaptations import megatron_core_in
from megatron_glue.capture.testing import megatron_cpu  # noqa: F401  (fixture)
from megatron_glue.data import instruction
from megatron_glue.data import preprocess as pp

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """A local HF tokenizer whose token id is the byte value (byte-level BPE without merges), the specials 256 on:
    expected ids are then the text's UTF-8 bytes, independent of any encoder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    from_byte = {b: c for b, c in zip(range(256), _bytes_to_unicode())}
    assert set(from_byte.values()) == set(alphabet)
    vocab = {from_byte[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)  # ids 256, 257, ... in this order
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|begin_of_text|>",
                                   additional_special_tokens=SPECIALS[1:])
    assert fast.convert_tokens_to_ids(SPECIALS) == list(range(256, 256 + len(SPECIALS)))
    path = str(tmp_path_factory.mktemp("byte_tokenizer"))
    fast.save_pretrained(path)
    return path


def _bytes_to_unicode():
    # GPT-2's byte -> printable character table (the ByteLevel pre-tokenizer's alphabet), in byte order
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


def _sp(token):
    return 256 + SPECIALS.index(token)


def _b(text):
    return list(text.encode())


RECORDS = [{"instruction": "Add", "input": "1+1", "output": "2"},
           {"instruction": "Say hi", "input": "", "output": "hi there"}]


def _run(tmp_path, tokenizer, prompt_type, *extra, records=RECORDS):
    tmp_path.mkdir(parents=True, exist_ok=True)
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    prefix = str(tmp_path / "out" / "alpaca")
    rc = pp.main(["--input", str(data), "--tokenizer-name-or-path", tokenizer, "--output-prefix", prefix,
                  "--handler-name", "AlpacaStyleInstructionHandler", "--tokenizer-type", "PretrainedFromHF",
                  "--prompt-type", prompt_type, *extra])
    return rc, prefix


def _read(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out = {}
    for key in ("input_ids", "attention_mask", "labels"):
        ds = IndexedDataset(f"{prefix}_packed_{key}_document")
        assert ds.index.dtype == np.int32
        out[key] = [ds[i].tolist() for i in range(len(ds))]
    return out


def test_qwen_template_ids_and_labels(tmp_path, byte_tokenizer):
    rc, prefix = _run(tmp_path, byte_tokenizer, "qwen", "--workers", "2")
    assert rc == 0
    got = _read(prefix)
    start, end = _sp("<|im_start|>"), _sp("<|im_end|>")
    prompt = ([start] + _b("system\nYou are a helpful assistant.") + [end] + _b("\n")
              + [start] + _b("user\nAdd\n1+1") + [end] + _b("\n") + [start] + _b("assistant\n"))
    answer = _b("2") + [end]  # eos replaced by the stop word <|im_end|>
    assert got["input_ids"][0] == prompt + answer
    assert got["labels"][0] == [-100] * len(prompt) + answer
    assert got["attention_mask"][0] == [1] * len(prompt + answer)
    assert got["input_ids"][1][-len(_b("hi there")) - 1:] == _b("hi there") + [end]
    assert _b("user\nSay hi") + [end] in [got["input_ids"][1][i:i + 12] for i in range(len(got["input_ids"][1]))]


def test_llama3_template_bos_no_system(tmp_path, byte_tokenizer):
    rc, prefix = _run(tmp_path, byte_tokenizer, "llama3")
    assert rc == 0
    got = _read(prefix)
    sh, eh, eot = _sp("<|start_header_id|>"), _sp("<|end_header_id|>"), _sp("<|eot_id|>")
    prompt = ([_sp("<|begin_of_text|>"), sh] + _b("user") + [eh] + _b("\n\nAdd\n1+1") + [eot, sh]
              + _b("assistant") + [eh] + _b("\n\n"))
    assert got["input_ids"][0] == prompt + _b("2") + [eot]
    assert got["labels"][0] == [-100] * len(prompt) + _b("2") + [eot]


def test_seq_length_cuts_and_drops_as_mindspeed(tmp_path, byte_tokenizer):
    long = {"instruction": "x" * 30, "input": "", "output": "y" * 30}
    rc, prefix = _run(tmp_path, byte_tokenizer, "llama3", "--seq-length", "40", records=[RECORDS[0], long])
    assert rc == 0
    got = _read(prefix)
    # the long record is cut to 40 tokens by the template (prompt and answer in proportion), then dropped: >= 40
    assert len(got["input_ids"]) == 1 and got["input_ids"][0][-2:] == _b("2") + [_sp("<|eot_id|>")]
    # the cut itself: 23 prompt + 31 answer tokens in room 40 -> answer int(40 * 31 / 54) = 22, prompt 18
    pairs = instruction._make_pairs([[1] * 23, [2] * 31], 40)
    assert [len(s) for s in pairs[0]] == [18, 22]


@pytest.mark.parametrize("name, why", [
    ("bailing_mini", "a ReasoningTemplate"), ("chatglm3", "not transcribed yet"),
    ("nope", "not a MindSpeed-LLM template")])
def test_unbuilt_templates_refused_by_name(name, why, tmp_path, byte_tokenizer, capsys):
    with pytest.raises(SystemExit):
        _run(tmp_path, byte_tokenizer, name)
    err = capsys.readouterr().err
    assert f"--prompt-type {name} is " in err and why in err and "supported: qwen, llama3" in err


def test_instruction_flags_still_refused(tmp_path, byte_tokenizer, capsys):
    for extra, msg in ((["--json-keys", "text", "more"], "--json-keys is not taken"),
                       (["--enable-thinking", "true"], "--enable-thinking: --prompt-type qwen has no thinking blocks"),
                       (["--enable-thinking", "maybe"], "--enable-thinking takes true, false or none")):
        with pytest.raises(SystemExit):
            _run(tmp_path, byte_tokenizer, "qwen", *extra)
        assert msg in capsys.readouterr().err
    for extra, msg in ((["--pack"], "--pack needs --seq-length"), (["--neat-pack", "--seq-length", "64"],
                                                                   "--neat-pack needs --pack")):
        assert _run(tmp_path, byte_tokenizer, "qwen", *extra)[0] == 1
        assert msg in capsys.readouterr().err
    for flag in (["--prompt-type", "qwen"], ["--pack"]):  # pretraining documents take neither
        with pytest.raises(SystemExit):
            pp.main(["--input", "x.jsonl", "--output-prefix", "o", *flag])
        assert f"{flag[0]} is taken here only for instruction data" in capsys.readouterr().err


def test_missing_output_key_names_the_line(tmp_path, byte_tokenizer, capsys):
    rc, prefix = _run(tmp_path, byte_tokenizer, "qwen", records=[RECORDS[0], {"instruction": "a"}])
    assert rc == 1
    err = capsys.readouterr().err
    assert "alpaca.jsonl:2: no key 'output'" in err
    assert not (tmp_path / "out" / "alpaca_packed_labels_document.bin").exists()


# -- -m megatron_glue.posttrain_gpt ---------------------------------------------------------------------------

def _alpaca_records(n=20):
    return [{"instruction": f"Count {i}", "input": "" if i % 3 else "go", "output": f"{i} {i + 1} {i + 2}"}
            for i in range(n)]


@pytest.fixture(scope="module")
def sft_data(byte_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft_data")
    rc, prefix = _run(folder, byte_tokenizer, "llama3", "--seq-length", "64", records=_alpaca_records())
    assert rc == 0
    return prefix


def _sft_args(tokenizer, prefix, *extra):
    from megatron_glue.training.arguments import parse_args

    return parse_args(["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "64",
                       "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
                       "--train-iters", "3", "--eval-iters", "0", "--lr", "1e-3", "--tokenizer-type",
                       "PretrainedFromHF", "--tokenizer-name-or-path", tokenizer, "--data-path", prefix, "--split",
                       "100,0,0", "--stage", "sft", "--is-instruction-dataset", "--prompt-type", "llama3",
                       "--handler-name", "AlpacaStyleInstructionHandler", *extra], world_size=1)


def test_sft_batch_counts_answer_tokens_only(byte_tokenizer, sft_data):
    from megatron_glue.training import gpt, sft

    args = _sft_args(byte_tokenizer, sft_data)
    gpt.set_vocabulary(args)
    train, valid, test = sft.datasets_provider(args)
    assert valid is None and test is None and len(train) == 3 * 4 + 8  # whole epochs of the 20 documents
    # MindSpeed-LLM's order: epochs of the documents, each shuffled by one RandomState(seed)
    rng = np.random.RandomState(args.seed)
    first = np.arange(20)
    rng.shuffle(first)
    assert train.order[:20].tolist() == first.tolist()
    doc = int(train.order[0])
    stored = _read(sft_data)
    ids, labels = stored["input_ids"][doc], stored["labels"][doc]
    item = {k: v[0] for k, v in train.collate([train[0]]).items()}
    n = len(ids)
    eot = _sp("<|eot_id|>")
    record = _alpaca_records()[doc]
    answer = _b(record["output"]) + [eot]
    assert item["tokens"][:n].tolist() == ids and item["tokens"][n:].eq(eot).all()  # padded with the stop word
    # position i predicts token i + 1; counted exactly where i + 1 is an answer token
    counted = item["loss_mask"].nonzero().view(-1).tolist()
    assert counted == list(range(n - len(answer) - 1, n - 1))
    assert item["labels"][counted].tolist() == answer and labels[-len(answer):] == answer
    assert item["labels"][item["loss_mask"] == 0].eq(0).all() and item["position_ids"].tolist() == list(range(64))


def test_posttrain_refusals(byte_tokenizer, sft_data):
    from megatron_glue.training import sft
    from megatron_glue.training.arguments import ArgumentError, parse_args

    assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data)) is None
    assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data, "--stage", "dpo")).startswith(
        "--stage dpo: only --stage sft is implemented here")
    assert "ReasoningTemplate" in sft.posttrain_refusal(
        _sft_args(byte_tokenizer, sft_data, "--prompt-type", "bailing_mini"))
    for extra, msg in ((["--neat-pack"], "--neat-pack needs --reset-attention-mask"),
                       (["--reset-position-ids"], "--reset-position-ids needs --reset-attention-mask"),
                       (["--eod-mask-loss"], "--eod-mask-loss is not taken by posttrain_gpt"),
                       (["--pad-to-multiple-of", "16"], "--pad-to-multiple-of rounds the batches of "
                                                         "--no-pad-to-seq-lengths")):
        assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data, *extra)).startswith(msg)
    for extra in (["--reset-attention-mask", "--neat-pack", "--reset-position-ids", "--padded-samples"],
                  ["--no-pad-to-seq-lengths", "--pad-to-multiple-of", "16"], ["--prompt-type", "qwen3"]):
        assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data, *extra)) is None
    assert sft.pretrain_refusal(_sft_args(byte_tokenizer, sft_data)).endswith("-m megatron_glue.posttrain_gpt")
    # start-time preprocessing flags (MindSpeed-LLM passes them on to preprocess_data.py for raw --data-path only)
    assert sft.posttrain_refusal(_sft_args(byte_tokenizer, sft_data, "--pack", "--enable-thinking", "true")) is None
    with pytest.raises(ArgumentError) as info:
        _sft_args(byte_tokenizer, sft_data, "--enable-thinking", "maybe")
    assert "--enable-thinking" in info.value.message


@pytest.mark.slow
@pytest.mark.training
def test_posttrain_compiled_equals_eager(byte_tokenizer, sft_data, tmp_path):
    """3 iterations of instruction tuning (llama3 template, padded to 64): losses and gradient norms of the
    compiled job within 1e-5 of --no-npu-compile; the loss is over the answers only (the batch test above)."""
    from pretrain_runs import TINY, assert_close, pretrain

    base = list(TINY)
    del base[base.index("--mock-data")]
    del base[base.index("--vocab-size"):base.index("--vocab-size") + 2]
    for flag, value in (("--seq-length", "64"), ("--max-position-embeddings", "64"), ("--num-layers", "1")):
        base[base.index(flag) + 1] = value
    base += ["--data-path", sft_data, "--tokenizer-type", "PretrainedFromHF", "--tokenizer-name-or-path",
             byte_tokenizer, "--split", "100,0,0", "--train-iters", "3", "--eval-iters", "0", "--stage", "sft",
             "--is-instruction-dataset", "--prompt-type", "llama3", "--handler-name", "AlpacaStyleInstructionHandler"]
    module = "megatron_glue.posttrain_gpt"
    compiled = pretrain(tmp_path / "compiled", base=base, module=module).check()
    eager = pretrain(tmp_path / "eager", "--no-npu-compile", base=base, module=module).check()
    assert len(compiled.losses) == 3 and compiled.losses[-1] < compiled.losses[0]
    assert_close(compiled.losses, eager.losses, what="losses")
    norms = [[r["grad_norm"] for r in run.rows("train")] for run in (compiled, eager)]
    assert_close(*norms, what="grad norms")


def test_sharegpt_multi_turn_with_system(tmp_path, byte_tokenizer, capsys):
    """Two exchanges and a system message through the qwen template: every answer kept in the labels (each ends
    with <|im_end|>), every prompt turn -100, the turns after the first led by the template's separator."""
    record = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                {"from": "gpt", "value": "Yo"}, {"from": "human", "value": "Bye"},
                                {"from": "gpt", "value": "Ciao"}]}
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps(record) + "\n" + json.dumps({"conversations": [{"from": "human", "value": "x"}]}) + "\n")
    args = ["--input", str(data), "--tokenizer-name-or-path", byte_tokenizer, "--output-prefix",
            str(tmp_path / "chat"), "--handler-name", "SharegptStyleInstructionHandler", "--prompt-type", "qwen"]
    assert pp.main(args) == 1  # the second record ends with a human turn
    assert "chat.jsonl:2: the conversation ends with a human turn" in capsys.readouterr().err
    data.write_text(json.dumps(record) + "\n")
    assert pp.main(args) == 0
    got = _read(str(tmp_path / "chat"))
    start, end = _sp("<|im_start|>"), _sp("<|im_end|>")
    first = ([start] + _b("system\nBe brief.") + [end] + _b("\n") + [start] + _b("user\nHi") + [end] + _b("\n")
             + [start] + _b("assistant\n"))
    second = _b("\n") + [start] + _b("user\nBye") + [end] + _b("\n") + [start] + _b("assistant\n")
    a1, a2 = _b("Yo") + [end], _b("Ciao") + [end]
    assert got["input_ids"] == [first + a1 + second + a2]
    assert got["labels"] == [[-100] * len(first) + a1 + [-100] * len(second) + a2]


# -- packed rows (--pack, --neat-pack) and per-batch lengths (--no-pad-to-seq-lengths) ----------------------------

def _row(n, tag):
    return {"input_ids": [tag] * n, "attention_mask": [1] * n, "labels": [-100] + [tag] * (n - 1)}


def test_pack_rows_greedy_knapsack_as_mindspeed():
    """MindSpeed-LLM's _pack_serialize_to_disk: lengths sorted, each row (seq_length - 1 of room) filled with the
    largest length that fits until none does; a length's records taken last first; padding to seq_length."""
    rows = [_row(5, 1), _row(3, 2), _row(7, 3), _row(2, 4), _row(9, 5), _row(3, 6), _row(15, 7)]
    packed, dropped = instruction.pack_rows(rows, 12, neat=False, pad_id=99)
    assert dropped == 1  # 15 >= 12: dropped without --neat-pack
    # room 11: [9, 2], then [7, 3 (the later of the two 3s)], then [5, 3]
    assert [r["input_ids"] for r in packed] == [[5] * 9 + [4] * 2 + [99], [3] * 7 + [6] * 3 + [99] * 2,
                                                [1] * 5 + [2] * 3 + [99] * 4]
    assert packed[0]["attention_mask"] == [1] * 12 and packed[0]["labels"][-1] == -100
    assert packed[1]["labels"] == [-100] + [3] * 6 + [-100] + [6] * 2 + [-100] * 2
    neat, dropped = instruction.pack_rows(rows, 12, neat=True, pad_id=99)
    assert dropped == 0  # --neat-pack cuts the long record to seq_length - 1 instead
    assert neat[0]["input_ids"] == [7] * 11 + [99] and neat[0]["attention_mask"] == [1] * 11 + [0]
    assert neat[1]["attention_mask"] == [1] * 9 + [2] * 2 + [0]  # the records of a row numbered 1, 2, ...
    assert all(len(r[k]) == 12 for r in neat for k in instruction.KEYS)


def _segments(mask):
    """The records of a --neat-pack row: (start, stop) of each run of one number > 0."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            if mask[start]:
                out.append((start, i))
            start = i
    return out


def test_preprocess_neat_pack_rows_hold_the_records(tmp_path, byte_tokenizer):
    """`npu-compile preprocess --pack --neat-pack --seq-length 128`: every row 128 tokens; its numbered runs are the
    unpacked records, token for token and label for label; the rest is padding (pad = the template's eos here: the
    tokenizer has no pad), labels -100."""
    records = _alpaca_records(12)
    rc, plain = _run(tmp_path / "plain", byte_tokenizer, "llama3", "--seq-length", "128", records=records)
    rc2, packed = _run(tmp_path / "packed", byte_tokenizer, "llama3", "--seq-length", "128", "--pack",
                       "--neat-pack", records=records)
    assert rc == rc2 == 0
    want, got = _read(plain), _read(packed)
    assert len(got["input_ids"]) < len(want["input_ids"])
    seen = []
    for ids, mask, labels in zip(got["input_ids"], got["attention_mask"], got["labels"]):
        assert len(ids) == len(mask) == len(labels) == 128
        runs = _segments(mask)
        assert [mask[a] for a, _ in runs] == list(range(1, len(runs) + 1))
        for a, b in runs:
            seen.append((ids[a:b], labels[a:b]))
        end = runs[-1][1]
        assert set(mask[end:]) <= {0} and set(ids[end:]) <= {_sp("<|eot_id|>")} and set(labels[end:]) <= {-100}
    assert sorted(seen) == sorted(zip(want["input_ids"], want["labels"]))


def test_qwen3_thinking_blocks(tmp_path, byte_tokenizer):
    """qwen3 (ReasoningTemplate): an answer without a thought block gets an empty one, "<think>\\n\\n</think>\\n\\n",
    at the end of the prompt (no loss; --enable-thinking none or false) or at the head of the answer (in the loss;
    --enable-thinking true); --enable-thinking false removes the answer's own thoughts first. No default system;
    the answer slot ends the turn ("<|im_end|>\\n")."""
    start, end = _sp("<|im_start|>"), _sp("<|im_end|>")
    empty = _b("<think>\n\n</think>\n\n")
    prompt = [start] + _b("user\nAdd\n1+1") + [end] + _b("\n") + [start] + _b("assistant\n")
    thought = {"instruction": "Add", "input": "1+1", "output": "<think>\nsum\n</think>\n\n2"}
    cases = {(): (prompt + empty, _b("2") + [end] + _b("\n"), _b("<think>\nsum\n</think>\n\n2") + [end] + _b("\n")),
             ("--enable-thinking", "true"): (prompt, empty + _b("2") + [end] + _b("\n"),
                                             _b("<think>\nsum\n</think>\n\n2") + [end] + _b("\n")),
             ("--enable-thinking", "false"): (prompt + empty, _b("2") + [end] + _b("\n"), None)}
    for i, (extra, (source, target, with_thought)) in enumerate(cases.items()):
        rc, prefix = _run(tmp_path / str(i), byte_tokenizer, "qwen3", *extra, records=[RECORDS[0], thought])
        assert rc == 0
        got = _read(prefix)
        assert got["input_ids"][0] == source + target, extra
        assert got["labels"][0] == [-100] * len(source) + target, extra
        # the record's own thoughts: kept in the answer, no empty block added; false: removed, then the empty one
        if with_thought is None:
            assert got["input_ids"][1] == source + target
        else:
            assert got["input_ids"][1] == prompt + with_thought and got["labels"][1][len(prompt):] == with_thought


@pytest.fixture(scope="module")
def packed_data(byte_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("packed_data")
    rc, prefix = _run(folder, byte_tokenizer, "llama3", "--seq-length", "128", "--pack", "--neat-pack",
                      records=_alpaca_records())
    assert rc == 0
    return prefix


def _answers(labels):
    """Positions whose label is an answer token (not -100)."""
    return [i for i, x in enumerate(labels) if x != -100]


@pytest.mark.parametrize("how", ["neat", "eos"])
def test_packed_batch_counts_answers_and_attends_within_records(how, byte_tokenizer, packed_data):
    """Packed rows read with --reset-attention-mask (--neat-pack: the rows' numbered records; without: cut after
    each eos): the loss counts exactly each record's answer tokens (position i for label i + 1; fails if a prompt
    or padding position counts, or an answer across a record's end), each token attends causally within its
    document only (eager: the dense mask; compiled: the same documents as lengths), positions restart per document
    with --reset-position-ids."""
    from npu_compile.ops.varlen_attention import cu_seqlens_from_eod, document_mask

    from megatron_glue.training import gpt, sft

    extra = ["--reset-attention-mask", "--reset-position-ids"] + (["--neat-pack"] if how == "neat" else [])
    args = _sft_args(byte_tokenizer, packed_data, *extra, "--seq-length", "128", "--max-position-embeddings", "128")
    gpt.set_vocabulary(args)
    (train, _, _) = sft.datasets_provider(args)
    stored = _read(packed_data)
    samples = [train[i] for i in range(2)]
    # the compiled job on megatron-core >= 0.13: lengths; 0.12 and --no-npu-compile: the mask
    assert train.batching.lengths == megatron_core_in(">=0.13")
    batch = sft.collate(samples, dataclasses.replace(train.batching, lengths=False))
    assert batch["tokens"].shape == (2, 128) and "packed_seq_params" not in batch
    eot = _sp("<|eot_id|>")
    cu = []
    for r, idx in enumerate(train.order[:2].tolist()):
        ids, mask, labels = (stored[k][idx] for k in ("input_ids", "attention_mask", "labels"))
        runs = _segments(mask)
        counted = batch["loss_mask"][r].nonzero().view(-1).tolist()
        assert counted == [i - 1 for i in _answers(labels)]  # every answer token, predicted by the one before
        assert batch["labels"][r][counted].tolist() == [labels[i] for i in _answers(labels)]
        if how == "neat":  # the records, then the padding as one document
            ends = [b for _, b in runs] + [128]
        else:  # after each eos of the stored row (llama3's <|eot_id|> ends the prompt, the answer and, as the pad
            # of a tokenizer without one, each padding token), then the row's end: Megatron's EOD cut
            ends = cu_seqlens_from_eod(torch.tensor([ids]), eot).tolist()
            assert len(ends) > 2 * len(runs)
        cu += [r * 128 + e for e in ends]
        starts = [0] + ends[:-1]
        assert batch["position_ids"][r].tolist() == [i - a for a, b in zip(starts, ends) for i in range(a, b)]
    cu = torch.tensor(cu)
    assert torch.equal(batch["attention_mask"], document_mask(cu, 2, 128))
    if how == "neat":  # a record sees none of the others: each is one document
        assert len(cu) == sum(len(_segments(stored["attention_mask"][i])) + 1 for i in train.order[:2].tolist())
    lengths = train.collate(samples) if train.batching.lengths else sft.collate(samples, dataclasses.replace(
        train.batching, lengths=True))  # 0.12: the same lengths, as 0.13 passes them
    assert "attention_mask" not in lengths
    params = lengths["packed_seq_params"]
    assert params.cu_seqlens_q.shape == (256,) and torch.equal(params.cu_seqlens_q[:len(cu)], cu)
    assert params.cu_seqlens_q[len(cu):].eq(256).all()


def test_no_pad_batches_round_up_the_longest(byte_tokenizer, sft_data):
    """--no-pad-to-seq-lengths: a micro-batch as long as its longest sample rounded up to --pad-to-multiple-of
    (MindSpeed-LLM's training default 8), padded with the pad id and labels -100, the loss over the answers."""
    from megatron_glue.training import gpt, sft

    rounded = []
    for extra, multiple in (([], 8), (["--pad-to-multiple-of", "16"], 16), (["--pad-to-multiple-of", "1"], 1)):
        args = _sft_args(byte_tokenizer, sft_data, "--no-pad-to-seq-lengths", *extra)
        gpt.set_vocabulary(args)
        (train, _, _) = sft.datasets_provider(args)
        samples = [train[i] for i in range(4)]
        longest = max(len(s["input_ids"]) for s in samples)
        batch = train.collate(samples)
        assert batch["tokens"].shape == (4, -(-longest // multiple) * multiple) and longest < 64
        rounded.append(batch["tokens"].shape[1] != longest)
        for r, s in enumerate(samples):
            assert batch["loss_mask"][r].nonzero().view(-1).tolist() == [i - 1 for i in _answers(s["labels"])]
    assert any(rounded) and not rounded[-1]
    assert sft.Batching(64, 0).pad_to_multiple_of is None  # without the flag: every batch --seq-length long


def _relative(actual, expected):
    return ((actual.detach().double() - expected.detach().double()).abs().max()
            / expected.detach().double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.skipif(not megatron_core_in(">=0.13"), reason="megatron-core 0.12 takes any PackedSeqParams for THD: "
                    "the job passes the dense mask there (gpt.passes_lengths)")
def test_packed_rows_equal_the_records_one_by_one(byte_tokenizer, packed_data, megatron_cpu):
    """Two packed rows (--neat-pack) through megatron-core's GPTModel (Llama style: RoPE, GQA), compiled
    (backend ascend, target reference: the varlen attention) and eager over the dense document mask: the summed
    answer loss and every gradient equal those of the same records run one by one, each alone in its own
    batch (fp32, 1e-5)."""
    from megatron_glue.capture.models import build_gpt_model, llama_config
    from megatron_glue.training import gpt, sft

    args = _sft_args(byte_tokenizer, packed_data, "--reset-attention-mask", "--neat-pack",
                     "--seq-length", "128", "--max-position-embeddings", "128")
    gpt.set_vocabulary(args)
    (train, _, _) = sft.datasets_provider(args)
    samples = [train[i] for i in range(2)]
    vocab = 384
    config = lambda: llama_config(hidden_size=64, num_query_groups=2)  # noqa: E731

    def loss_and_grads(model, batch):
        model.zero_grad(set_to_none=True)
        losses = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                       labels=batch["labels"], packed_seq_params=batch.get("packed_seq_params"))
        loss = (losses.float() * batch["loss_mask"]).sum()
        loss.backward()
        return loss.detach(), {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters()}

    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):
        eager = build_gpt_model(config(), vocab, 128, seed=0)
        # the records one by one, each alone (its own length, causal, no mask): the sums over them
        records = []
        for s in samples:
            for a, b in _segments(s["attention_mask"].tolist()):
                records.append({k: s[k][a:b] for k in ("input_ids", "labels", "attention_mask")})
        assert len(records) > 2
        one_by_one = [loss_and_grads(eager, sft.collate([r], sft.Batching(len(r["input_ids"]), 0)))
                      for r in records]
        want_loss = sum(loss for loss, _ in one_by_one)
        want_grads = {n: sum(g[n] for _, g in one_by_one) for n in one_by_one[0][1]}
        dense = loss_and_grads(eager, sft.collate(samples, dataclasses.replace(train.batching, lengths=False)))
    compiled_model = torch.compile(build_gpt_model(config(), vocab, 128, seed=0), backend="ascend",
                                   options={"target": "reference"})
    from npu_compile.debug.report import collect

    with collect() as reports:
        compiled = loss_and_grads(compiled_model, train.collate(samples))
    torch._dynamo.reset()
    assert reports[0].fusions["varlen_attention"] == 2
    for what, (loss, grads) in (("eager, dense mask", dense), ("compiled, lengths", compiled)):
        assert _relative(loss, want_loss) <= 1e-5, what
        bad = {n: _relative(grads[n], want_grads[n]) for n in want_grads if _relative(grads[n], want_grads[n]) > 1e-5}
        assert not bad, (what, bad)
