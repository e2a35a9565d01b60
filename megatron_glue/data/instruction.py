"""Instruction-tuning data: MindSpeed-LLM's `AlpacaStyleInstructionHandler` and `SharegptStyleInstructionHandler`
with their prompt templates, for `npu-compile preprocess --handler-name AlpacaStyleInstructionHandler
--prompt-type NAME [--seq-length N]` (or SharegptStyleInstructionHandler).

What MindSpeed-LLM's `preprocess_data.py` writes for that handler (mindspeed_llm/tasks/preprocess/data_handler.py,
`LlamaFactoryInstructionHandler`, master c77308a): three indexed datasets, int32,

    <prefix>_packed_input_ids_document.bin/.idx       the prompt tokens then the answer tokens
    <prefix>_packed_attention_mask_document.bin/.idx  ones, one per token
    <prefix>_packed_labels_document.bin/.idx          -100 on the prompt tokens, the answer tokens as they are

one document per record, labels aligned with the tokens (not shifted; the trainer shifts). `_packed` is in every
name, packed or not (`self.args.output_prefix + "_packed"`), and the three keys are fixed (`args.json_keys`).
With `--seq-length N` a record is first cut to N tokens the way the template cuts its turns (`Template._make_pairs`:
each (prompt, answer) pair gets a share of what is left proportional to its lengths, the answer at least 1), then a
record of N tokens or more is dropped (`_serialize_to_disk`). Without it nothing is cut (the cut-off is 100000).

ShareGPT records: `InstructionEncoder._sharegpt`. Alpaca records (parser.py `InstructionDatasetAttr`): `instruction`
and `input` (joined by a newline, the empty ones left out) make the user turn, `output` the answer; no history and
no system column unless `--map-keys` (refused here), so the template's default system prompt is used.

The templates (configs/finetune/templates.json) are text slots around the content; each slot is tokenized on its
own (`tokenizer.encode(slot, add_special_tokens=False)`), `bos_token`/`eos_token` slots are the tokenizer's ids.
Templates with `replace_eos` make their first stop word the tokenizer's eos first (templates.py
`fix_model_tokenizer`, called by MindSpeed-LLM's tokenizer builder when --prompt-type is given), so the answer ends
with it: `<|im_end|>` for qwen, `<|eot_id|>` for llama3.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_glue.data.tokenizer import DataError

IGNORE_INDEX = -100  # data_handler.py `self.ignored_label`
KEYS = ("input_ids", "attention_mask", "labels")  # data_handler.py LlamaFactoryInstructionHandler json_keys
NO_CUTOFF = 100000  # data_handler.py: cutoff_len without --seq-length
HANDLERS = ("AlpacaStyleInstructionHandler", "SharegptStyleInstructionHandler")


@dataclass(frozen=True)
class PromptTemplate:
    """One entry of MindSpeed-LLM's configs/finetune/templates.json, the fields the Alpaca handler uses. Slots:
    strings with `{{content}}`, or "bos_token" / "eos_token" for the tokenizer's ids."""

    user: tuple
    system: tuple
    assistant: tuple
    separator: tuple = ()
    prefix: tuple = ()
    default_system: str = ""
    stop_words: tuple = ()
    replace_eos: bool = False
    # ReasoningTemplate (templates.py): an LFDefaultTemplate (its own cut: `_make_pairs` keeps one token in reserve
    # and shares the room by `_infer_seqlen`) that puts an empty thought block before each answer without one
    reasoning: bool = False
    thought_words: tuple = ("<think>\n", "\n</think>\n\n")  # templates.py _register_template's default


# Facts from configs/finetune/templates.json (c77308a): the slots of "qwen" (Qwen, Qwen1.5, Qwen2, Qwen2.5 scripts)
# and "llama3"; neither sets format_assistant nor efficient_eos, so the answer is "{{content}}" then eos
# (templates.py `_register_template`).
TEMPLATES = {
    "qwen": PromptTemplate(
        user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
        system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
        assistant=("{{content}}", "eos_token"),
        separator=("\n",),
        default_system="You are a helpful assistant.",
        stop_words=("<|im_end|>",), replace_eos=True),
    "llama3": PromptTemplate(
        user=("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",),
        system=("<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>",),
        assistant=("{{content}}", "eos_token"),
        prefix=("bos_token",),
        stop_words=("<|eot_id|>",), replace_eos=True),
    # "qwen3" (Qwen3 dense and MoE scripts): template_class ReasoningTemplate, no separator, no default system, the
    # answer slot ends the turn itself ("{{content}}<|im_end|>\n", no eos slot)
    "qwen3": PromptTemplate(
        user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
        system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
        assistant=("{{content}}<|im_end|>\n",),
        stop_words=("<|im_end|>",), replace_eos=True, reasoning=True),
    # "plm": ChatML slots, the answer ending its turn, eos replaced by <|endoftext|>
    "plm": PromptTemplate(
        user=("<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n",),
        system=("<|im_start|>system\n{{content}}<|im_end|>\n",),
        assistant=("{{content}}<|im_end|>\n",),
        default_system="You are a helpful assistant.",
        stop_words=("<|endoftext|>",), replace_eos=True),
    # "deepseek3", "deepseek2-lite", "cpm": bos, then the user slot; the default system slot is "{{content}}"
    # (format_system falls back to the default user formatter) and the answer is "{{content}}" then eos
    "deepseek3": PromptTemplate(
        user=("<\uff5cUser\uff5c>{{content}}<\uff5cAssistant\uff5c>",), system=("{{content}}",),
        assistant=("{{content}}", "eos_token"), prefix=("bos_token",)),
    "deepseek2-lite": PromptTemplate(
        user=("User: {{content}}\n\nAssistant:",), system=("{{content}}\n\n",),
        assistant=("{{content}}", "eos_token"), prefix=("bos_token",)),
    "cpm": PromptTemplate(
        user=("<\u7528\u6237>{{content}}<AI>",), system=("{{content}}",),
        assistant=("{{content}}", "eos_token"), prefix=("bos_token",)),
}

# The other names of templates.json, refused by name with what they need.
_REASONING = "a ReasoningTemplate with tool formatters of its own, not transcribed yet"
REFUSED_TEMPLATES = {
    "qwen_r1": "R1-style reasoning data, not built here",
    "qwen_math_r1": "R1-style reasoning data, not built here", "bailing_mini": _REASONING,
    "magistral": "a ReasoningTemplate over MagistralTokenizer (tekken.json), not built here",
    "gemma": "its efficient_eos (the eos carried into the next turn's labels), not built here",
    "glm4_moe": "a ReasoningTemplate with efficient_eos, not built here",
    "deepseek4": "its own DeepSeek4Template encoder, not built here",
    "gpt_oss": "its own template class, not built here",
}
_OTHER_TEMPLATES = ("chatglm2", "chatglm3", "chatglm3_system", "glm4", "chatml", "chatml_de",
                    "default", "empty", "trl", "qwen_lf", "mistral", "mixtral", "llama2",
                    "alpaca", "deepseek2", "minicpm3", "baichuan2", "intern2", "hunyuan")


def template_refusal(name: str | None) -> str | None:
    """None for a template built here, else the error line for --prompt-type NAME."""
    supported = ", ".join(TEMPLATES)
    if name is None:
        return f"--prompt-type is required with an instruction handler (supported: {supported})"
    if name in TEMPLATES:
        return None
    if name in REFUSED_TEMPLATES:
        return f"--prompt-type {name} is not implemented here ({REFUSED_TEMPLATES[name]}); supported: {supported}"
    if name in _OTHER_TEMPLATES:
        return (f"--prompt-type {name} is not implemented here (a MindSpeed-LLM template whose slots are not "
                f"transcribed yet); supported: {supported}")
    return f"--prompt-type {name} is not a MindSpeed-LLM template; supported: {supported}"


class InstructionEncoder:
    """A record -> (input_ids, attention_mask, labels), MindSpeed-LLM's Alpaca- or ShareGPT-style handler with one
    template over a local Hugging Face tokenizer folder."""

    def __init__(self, tokenizer_dir: str, prompt_type: str, seq_length: int | None,
                 handler: str = "AlpacaStyleInstructionHandler", *, enable_thinking: bool | None = None,
                 pack: bool = False, neat_pack: bool = False, append_eod: bool = False) -> None:
        if handler not in HANDLERS:
            raise DataError(f"--handler-name {handler}: not an instruction handler built here ({', '.join(HANDLERS)})")
        self.sharegpt = handler == "SharegptStyleInstructionHandler"
        refusal = template_refusal(prompt_type)
        if refusal:
            raise DataError(refusal)
        if seq_length is not None and seq_length < 2:
            raise DataError(f"--seq-length must be >= 2, got {seq_length}")
        from megatron_glue.data.tokenizer import HuggingFaceTokenizer

        try:
            self.tokenizer = HuggingFaceTokenizer(tokenizer_dir)._tok
        except (DataError, FileNotFoundError) as error:
            raise type(error)(str(error).replace("--tokenizer-model ", "--tokenizer-name-or-path ", 1)) from None
        self.template = TEMPLATES[prompt_type]
        self.enable_thinking = enable_thinking
        self.pack, self.neat_pack, self.append_eod = pack, neat_pack, append_eod
        if pack and seq_length is None:
            raise DataError("--pack needs --seq-length (the length of each packed row)")
        if neat_pack and not pack:
            raise DataError("--neat-pack needs --pack (it numbers the records of a packed row; MindSpeed-LLM's "
                            "preprocess_data.py refuses it alone too)")
        self.seq_length = seq_length
        self.cutoff = NO_CUTOFF if seq_length is None else seq_length
        stops = self.template.stop_words
        if self.template.replace_eos:
            # templates.py fix_model_tokenizer: the first stop word becomes eos (added to the vocabulary if absent,
            # as there); the others become special tokens.
            self.tokenizer.add_special_tokens({"eos_token": stops[0]})
            stops = stops[1:]
        if stops:
            self.tokenizer.add_special_tokens({"additional_special_tokens": list(stops)})
        if self.tokenizer.pad_token_id is None:  # fix_model_tokenizer: a tokenizer without a pad pads with eos
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def _ids(self, slots: tuple, content: str | None = None) -> list[int]:
        ids: list[int] = []
        for slot in slots:
            if slot in ("bos_token", "eos_token"):
                token = self.tokenizer.bos_token_id if slot == "bos_token" else self.tokenizer.eos_token_id
                if token is not None:  # templates.py _convert_elements_to_ids skips a missing one
                    ids.append(token)
                continue
            text = slot if content is None else slot.replace("{{content}}", content, 1)
            if text:
                ids += self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    def messages(self, record: dict, where: str) -> tuple[list[str], str]:
        """(the turns, user first, alternating; the system prompt, "" for the template's default)."""
        return self._sharegpt(record, where) if self.sharegpt else (self._alpaca(record, where), "")

    @staticmethod
    def _sharegpt(record: dict, where: str) -> tuple[list[str], str]:
        """A ShareGPT record (utils.py convert_sharegpt_to_intermediate, parser.py tags): `conversations`, a list of
        {"from": "human" | "gpt", "value": text}, human first, alternating, ending with gpt; a first message from
        "system" is the system prompt. MindSpeed-LLM turns a record breaking these rules into an empty exchange
        (data_handler.py `_tokenize_prompt`); here it is an error naming the record."""
        messages = record.get("conversations")
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: expected a non-empty list under 'conversations' (a ShareGPT record); the "
                             f"object has {sorted(record)}")
        system, offset = "", 0
        if isinstance(messages[0], dict) and messages[0].get("from") == "system":
            system, messages, offset = messages[0].get("value", ""), messages[1:], 1
        turns = []
        for i, message in enumerate(messages):
            want = "human" if i % 2 == 0 else "gpt"
            if not isinstance(message, dict) or message.get("from") != want or not isinstance(message.get("value"),
                                                                                            str):
                got = message.get("from") if isinstance(message, dict) else type(message).__name__
                extra = (" (observation and function_call turns are not implemented here)"
                         if got in ("observation", "function_call") else "")
                raise DataError(f"{where}: conversations[{i + offset}] should be {{\"from\": \"{want}\", "
                                 f"\"value\": text}}, got from {got!r}{extra}")
            turns.append(message["value"])
        if len(turns) % 2:
            raise DataError(f"{where}: the conversation ends with a human turn; it must end with a gpt answer")
        if not isinstance(system, str):
            raise DataError(f"{where}: the system message's value is a {type(system).__name__}, expected a string")
        return turns, system

    @staticmethod
    def _alpaca(record: dict, where: str) -> list[str]:
        """The turns of an Alpaca record: [user, assistant] (utils.py convert_alpaca_to_intermediate)."""
        for key in ("instruction", "output"):
            if key not in record:
                raise DataError(f"{where}: no key {key!r} (an Alpaca record has instruction, input, output); the "
                                 f"object has {sorted(record)}")
        for key in ("instruction", "input", "output"):
            if record.get(key) is not None and not isinstance(record[key], str):
                raise DataError(f"{where}: key {key!r} holds a {type(record[key]).__name__}, expected a string")
        user = "\n".join(p for p in (record["instruction"], record.get("input")) if p)
        return [user, record["output"]]

    def encode(self, record: dict, where: str) -> dict[str, list[int]] | None:
        """The three rows of one record, or None where --seq-length drops it (unpacked data; packed data is cut or
        dropped when packed: pack_rows)."""
        turns, system = self.messages(record, where)
        t = self.template
        system = system or t.default_system
        if t.reasoning and self.enable_thinking is False:  # ReasoningTemplate.encode_multiturn: remove all thoughts
            turns = [_remove_thought(c, t.thought_words) if i % 2 else c for i, c in enumerate(turns)]
        encoded = []
        for i, content in enumerate(turns):
            ids = []
            if i == 0:
                ids += self._ids(t.prefix)
                if system:
                    ids += self._ids(t.system, system)
            elif i % 2 == 0:
                ids += self._ids(t.separator)
            ids += self._ids(t.user if i % 2 == 0 else t.assistant, content)
            encoded.append(ids)
        if t.reasoning:
            # an answer without a thought block gets an empty one: in the prompt (no loss) unless --enable-thinking
            # true, then at the head of the answer (in the loss)
            thought = self.tokenizer.encode("".join(t.thought_words), add_special_tokens=False)
            for i in range(0, len(turns), 2):
                if t.thought_words[0] not in turns[i + 1] and t.thought_words[1] not in turns[i + 1]:
                    if self.enable_thinking:
                        encoded[i + 1] = thought + encoded[i + 1]
                    else:
                        encoded[i] = encoded[i] + thought
            pairs = _make_pairs_lf(encoded, self.cutoff)
        else:
            pairs = _make_pairs(encoded, self.cutoff)
        input_ids: list[int] = []
        labels: list[int] = []
        for source, target in pairs:
            if self.neat_pack:  # data_handler.py _tokenize_prompt: each pair cut again to seq_length - 1
                source_len, target_len = _infer_seqlen(len(source), len(target), self.seq_length - 1)
                source, target = source[:source_len], target[:target_len]
            input_ids += source + target
            labels += [IGNORE_INDEX] * len(source) + target
        mask = [1] * len(input_ids)
        if self.append_eod:  # data_handler.py _filter: the eod (the template's eos) after the record, in the loss
            eod = self.tokenizer.eos_token_id
            input_ids, mask, labels = input_ids + [eod], mask + [1], labels + [eod]
        if not self.pack and self.seq_length is not None and len(input_ids) >= self.seq_length:
            return None
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _remove_thought(content: str, words: tuple) -> str:
    """templates.py remove_thought: every thought block out, then the leading newlines."""
    import re

    pattern = re.compile(f"{re.escape(words[0])}(.*?){re.escape(words[1])}", re.DOTALL)
    return re.sub(pattern, "", content).lstrip("\n")


def _infer_seqlen(source: int, target: int, cutoff: int) -> tuple[int, int]:
    """decoder_packed_mtf_dataset.py _infer_seqlen: (prompt, answer) lengths cut to `cutoff` in all: the prompt
    alone is cut while the answer takes less than half, the answer alone while the prompt does, else both in
    proportion."""
    if target * 2 < cutoff:
        max_target = cutoff
    elif source * 2 < cutoff:
        max_target = cutoff - source
    else:
        max_target = int(cutoff * (target / (source + target)))
    new_target = min(max_target, target)
    return min(max(cutoff - new_target, 0), source), new_target


def _make_pairs_lf(encoded: list[list[int]], cutoff: int) -> list[tuple[list[int], list[int]]]:
    """templates.py LFDefaultTemplate._make_pairs: one token kept in reserve, each pair cut by _infer_seqlen to
    what is left."""
    pairs, total, cutoff = [], 0, cutoff - 1
    for i in range(0, len(encoded), 2):
        if total >= cutoff:
            break
        max_source, max_target = _infer_seqlen(len(encoded[i]), len(encoded[i + 1]), cutoff - total)
        source, target = encoded[i][:max_source], encoded[i + 1][:max_target]
        total += len(source) + len(target)
        pairs.append((source, target))
    return pairs


def pack_rows(rows: list[dict[str, list[int]]], seq_length: int, neat: bool, pad_id: int):
    """data_handler.py `_pack_serialize_to_disk`: records into rows of exactly `seq_length` tokens. A record of
    seq_length tokens or more is dropped (--neat-pack: cut to seq_length - 1); the lengths are packed greedily
    into rows of seq_length - 1 (one token kept for padding; utils.py greedy_knapsack: the lengths sorted, each row
    filled by taking the largest length that still fits until none does), each length's records taken last first;
    a row is its records back to back, then pad_id / attention 0 (--neat-pack; else 1) / label -100 to seq_length.
    With --neat-pack the attention mask numbers the records of a row 1, 2, ... (the training side reads them as
    documents). Returns (packed rows, records dropped)."""
    import bisect

    kept, dropped = [], 0
    for row in rows:
        n = len(row["input_ids"])
        if n >= seq_length:
            if not neat:
                dropped += 1
                continue
            row = {key: value[:seq_length - 1] for key, value in row.items()}
        kept.append(row)
    by_length: dict[int, list[int]] = {}
    for index, row in enumerate(kept):
        by_length.setdefault(len(row["input_ids"]), []).append(index)
    lengths = sorted(len(row["input_ids"]) for row in kept)
    packed = []
    while lengths:
        room, chosen = seq_length - 1, []
        while True:
            at = bisect.bisect(lengths, room)
            if at == 0:
                break
            room -= lengths[at - 1]
            chosen.append(lengths.pop(at - 1))
        out = {key: [] for key in KEYS}
        for number, length in enumerate(chosen, 1):
            row = kept[by_length[length].pop()]
            out["input_ids"] += row["input_ids"]
            out["labels"] += row["labels"]
            out["attention_mask"] += [number] * length if neat else row["attention_mask"]
        pad = seq_length - len(out["input_ids"])
        out["input_ids"] += [pad_id] * pad
        out["attention_mask"] += [0 if neat else 1] * pad
        out["labels"] += [IGNORE_INDEX] * pad
        packed.append(out)
    return packed, dropped


def _max_lengths(source: int, target: int, room: int, reserved: int = 1) -> tuple[int, int]:
    """templates.py infer_max_len: the answer's share of `room` in proportion, at least `reserved`."""
    max_target = 0 if source + target == 0 else int(room * (target / (source + target)))
    max_target = max(max_target, reserved)
    return room - min(max_target, target), max_target


def _make_pairs(encoded: list[list[int]], cutoff: int) -> list[tuple[list[int], list[int]]]:
    """templates.py Template._make_pairs: (prompt, answer) pairs cut to `cutoff` tokens in all."""
    pairs, total = [], 0
    for i in range(0, len(encoded), 2):
        if total >= cutoff:
            break
        max_source, max_target = _max_lengths(len(encoded[i]), len(encoded[i + 1]), cutoff - total)
        source, target = encoded[i][:max_source], encoded[i + 1][:max_target]
        total += len(source) + len(target)
        pairs.append((source, target))
    return pairs


def output_prefixes(output_prefix: str) -> dict[str, str]:
    """key -> the data prefix MindSpeed-LLM writes and its --data-path + suffix reads."""
    return {key: f"{output_prefix}_packed_{key}_document" for key in KEYS}


# -- writing -----------------------------------------------------------------------------------------------

_worker: dict = {}


def _init(tokenizer_dir: str, prompt_type: str, seq_length: int | None, handler: str, options: dict) -> None:
    _worker["encoder"] = InstructionEncoder(tokenizer_dir, prompt_type, seq_length, handler, **options)


def _encode_item(item) -> dict[str, list[int]] | None:
    import json

    where, data, _ = item
    if isinstance(data, str):
        try:
            data = json.loads(data.rstrip("\r\n"))
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    if not isinstance(data, dict):
        raise DataError(f"{where}: expected a JSON object, got a JSON {type(data).__name__}")
    return _worker["encoder"].encode(data, where)


def write(files: list[str], output_prefix: str, *, tokenizer_dir: str, prompt_type: str, seq_length: int | None,
          workers: int, log_interval: int, log, records,
          handler: str = "AlpacaStyleInstructionHandler", **options) -> tuple[dict[str, str], int, int]:
    """Encodes the records of `files` (`records` yields them as preprocess reads them) into the three datasets;
    returns (key -> prefix, documents written, records dropped by --seq-length). `options`: InstructionEncoder's
    (enable_thinking, pack, neat_pack, append_eod); packed, the documents are the packed rows. Files are written
    under temporary names and renamed at the end, as the pretraining path does."""
    import multiprocessing
    import os

    import numpy

    _init(tokenizer_dir, prompt_type, seq_length, handler, options)  # here first: a bad tokenizer is reported first
    pack, neat, pad_id = options.get("pack", False), options.get("neat_pack", False), _worker["encoder"].pad_id
    from megatron_glue.capture import quiet_megatron

    with quiet_megatron():
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefixes = output_prefixes(output_prefix)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    tmp = {key: (f"{p}.bin.tmp{os.getpid()}", f"{p}.idx.tmp{os.getpid()}") for key, p in prefixes.items()}
    builders = {}
    written = dropped = 0
    pool = None
    try:
        for key in KEYS:  # int32 for all three: labels hold -100 (data_handler.py builds them with no vocab size)
            builders[key] = IndexedDatasetBuilder(tmp[key][0], dtype=numpy.int32)
        items = records(files, ())
        if workers == 1:
            encoded = map(_encode_item, items)
        else:
            context = multiprocessing.get_context("fork")
            pool = context.Pool(workers, initializer=_init, initargs=(tokenizer_dir, prompt_type, seq_length, handler,
                                                                              options))
            encoded = pool.imap(_encode_item, items, chunksize=32)
        collected = []
        for n, rows in enumerate(encoded, 1):
            if rows is None:
                dropped += 1
            elif pack:
                collected.append(rows)
            else:
                written += 1
                for key in KEYS:
                    builders[key].add_document(rows[key], [len(rows[key])])
            if n % log_interval == 0:
                print(f"Processed {n} records.", file=log)
        if pack:  # all records first, then the rows (MindSpeed-LLM packs the whole dataset at once)
            packed, dropped = pack_rows(collected, seq_length, neat, pad_id)
            for rows in packed:
                written += 1
                for key in KEYS:
                    builders[key].add_document(rows[key], [len(rows[key])])
            print(f"Packed {len(collected) - dropped} records into {len(packed)} rows of {seq_length} tokens.",
                  file=log)
        for key in KEYS:
            builders[key].finalize(tmp[key][1])
        for key in KEYS:
            os.replace(tmp[key][0], prefixes[key] + ".bin")
            os.replace(tmp[key][1], prefixes[key] + ".idx")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _worker.clear()
        for builder in builders.values():
            builder.data_file.close()
        for path in (p for paths in tmp.values() for p in paths):
            if os.path.exists(path):
                os.remove(path)
    return prefixes, written, dropped
