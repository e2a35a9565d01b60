"""TensorFlow's checkpoint format (the "V2" tensor bundle `tf.train.Saver` and `tf.train.Checkpoint` write), read
without TensorFlow: `PREFIX.index` holds one entry per tensor, `PREFIX.data-SSSSS-of-NNNNN` the tensors' bytes.

The format, from TensorFlow's sources (tensorflow/core/util/tensor_bundle/tensor_bundle.{h,cc},
tensorflow/core/protobuf/tensor_bundle.proto, tensorflow/core/lib/io/table_format.txt and format.h, which are
LevelDB's table format):

- `.index` is an immutable sorted table (LevelDB's SSTable). Its last 48 bytes are the footer: the metaindex
  block's handle and the index block's handle (each a varint64 offset and a varint64 size), zero padding, and the
  magic number 0xdb4775248b80fb57 (little-endian fixed64). Every block is followed by a 5-byte trailer: the
  compression type (TensorFlow writes bundles uncompressed, `TableBuilderOptions`: kNoCompression) and the masked
  crc32c of the block and that type byte. A block is a run of entries (varint32 shared key length, varint32
  unshared key length, varint32 value length, the unshared key bytes, the value), then the restart offsets
  (fixed32 each) and their count (fixed32). The index block's values are the handles of the data blocks.
- The entry of key "" is a `BundleHeaderProto` (num_shards = 1, endianness = 2); every other key is a tensor's
  name and its value a `BundleEntryProto`: dtype = 1 (tensorflow.DataType), shape = 2 (TensorShapeProto: dim = 2,
  each with size = 1), shard_id = 3, offset = 4, size = 5, crc32c = 6 (fixed32), slices = 7.
- A numeric tensor is `size` raw bytes at `offset` of data file `shard_id`, C order, in the header's
  endianness; `crc32c` is the masked CRC-32C of those bytes. TensorFlow checks it on every read
  (`BundleReader::GetValue`) and so does this reader.

Masked CRC (tensorflow/core/lib/hash/crc32c.h `Mask`): ((crc >> 15) | (crc << 17)) + 0xa282ead8, modulo 2**32.
"""

from __future__ import annotations

import os
import struct

import numpy as np
import torch

MAGIC = 0xdb4775248b80fb57
FOOTER = 48
HEADER_KEY = b""
# tensorflow.DataType (tensorflow/core/framework/types.proto) -> numpy, the numeric types a model holds
DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 4: np.uint8, 5: np.int16, 6: np.int8, 9: np.int64,
          10: np.bool_, 17: np.uint16, 19: np.float16, 22: np.uint32, 23: np.uint64}
DT_BFLOAT16 = 14
DT_NAMES = {7: "DT_STRING", 21: "DT_VARIANT", 20: "DT_RESOURCE"}


class TFCheckpointError(ValueError):
    """A TensorFlow checkpoint that cannot be read: names the file and what is wrong with it."""


# -- CRC-32C (Castagnoli) ----------------------------------------------------------------------------------------
# The reflected CRC with polynomial 0x82F63B78 (RFC 3720 appendix B.4), as TensorFlow's crc32c::Value. Byte by byte in
# Python it runs at about 3 MB/s, minutes for GPT-2's 500 MB; here numpy runs it over many chunks at once and joins
# the chunks' CRCs by linearity: the register after chunk i is Z(register after chunk i-1) ^ crc0(chunk i), where
# crc0 starts from 0 and Z is the (linear) effect of a chunk's length of zero bytes on the register.

def _table() -> np.ndarray:
    out = np.zeros(256, dtype=np.uint32)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        out[n] = c
    return out


_CRC_TABLE = _table()
_CRC_LIST = _CRC_TABLE.tolist()
# two bytes at a time: the register's low 16 bits (xor the data) through two zero bytes
_low = np.arange(1 << 16, dtype=np.uint32)
_once = _CRC_TABLE[_low & 0xFF] ^ (_low >> 8)
_CRC_TABLE16 = _CRC_TABLE[_once & 0xFF] ^ (_once >> 8)
del _low, _once
_CHUNKS = 16384          # chunks run side by side
_SEGMENT = 16 << 20      # at a time: the transposed copy numpy walks


def _update_bytes(reg: int, data) -> int:
    table = _CRC_LIST
    for byte in bytes(data):
        reg = table[(reg ^ byte) & 0xFF] ^ (reg >> 8)
    return reg


_ZEROS: dict[int, list[list[int]]] = {}


def _zeros_operator(length: int) -> list[list[int]]:
    """The register's change over `length` zero bytes, a linear map, as four byte-indexed tables."""
    if length not in _ZEROS:
        basis = np.array([1 << k for k in range(32)], dtype=np.uint32)
        for _ in range(length):
            basis = _CRC_TABLE[basis & 0xFF] ^ (basis >> 8)
        columns = basis.tolist()
        tables = []
        for b in range(4):
            t = [0] * 256
            for x in range(1, 256):
                low = x & -x
                t[x] = t[x ^ low] ^ columns[8 * b + low.bit_length() - 1]
            tables.append(t)
        _ZEROS[length] = tables
    return _ZEROS[length]


def _update(reg: int, data: memoryview) -> int:
    length = len(data) // _CHUNKS // 2 * 2  # bytes per chunk, even
    if length < 64:
        return _update_bytes(reg, data)
    body = np.frombuffer(data, dtype="<u2", count=length * _CHUNKS // 2).reshape(_CHUNKS, length // 2).T.copy()
    crcs = np.zeros(_CHUNKS, dtype=np.uint32)
    x = np.empty(_CHUNKS, dtype=np.uint32)
    for column in body:
        np.bitwise_xor(crcs, column, out=x)
        x &= 0xFFFF
        crcs >>= 16
        crcs ^= _CRC_TABLE16[x]
    t0, t1, t2, t3 = _zeros_operator(length)
    for c in crcs.tolist():
        reg = t0[reg & 0xFF] ^ t1[(reg >> 8) & 0xFF] ^ t2[(reg >> 16) & 0xFF] ^ t3[reg >> 24] ^ c
    return _update_bytes(reg, data[length * _CHUNKS:])


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C of `data` (numpy over 16384 chunks of each 16 MiB, two bytes a step)."""
    view = memoryview(data).cast("B")
    reg = 0xFFFFFFFF
    for start in range(0, len(view), _SEGMENT):
        reg = _update(reg, view[start:start + _SEGMENT])
    return reg ^ 0xFFFFFFFF


def unmask(masked: int) -> int:
    rot = (masked - 0xa282ead8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


# -- protobuf wire format and the table's varints ----------------------------------------------------------------

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) of a serialized message: varints as int, fixed32/64 as int, length-delimited as
    bytes."""
    out, pos = [], 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        else:
            raise ValueError(f"wire type {wire}")
        out.append((number, value))
    return out


class Entry:
    """A BundleEntryProto."""

    def __init__(self, value: bytes):
        self.dtype = self.shard_id = self.offset = self.size = self.crc32c = 0
        self.shape: list[int] = []
        self.sliced = False
        for number, v in _fields(value):
            if number == 1:
                self.dtype = v
            elif number == 2:
                self.shape = [dict(_fields(d)).get(1, 0) for n, d in _fields(v) if n == 2]
            elif number == 3:
                self.shard_id = v
            elif number == 4:
                self.offset = v
            elif number == 5:
                self.size = v
            elif number == 6:
                self.crc32c = v
            elif number == 7:
                self.sliced = True


# -- the table ---------------------------------------------------------------------------------------------------

def _block(data: bytes, offset: int, size: int, path: str) -> bytes:
    if offset + size + 5 > len(data):
        raise TFCheckpointError(f"{path}: a block at {offset} ({size} bytes) runs past the end of the file "
                                f"({len(data)} bytes); the file is truncated")
    block, kind = data[offset:offset + size], data[offset + size]
    stored = struct.unpack_from("<I", data, offset + size + 1)[0]
    if crc32c(data[offset:offset + size + 1]) != unmask(stored):
        raise TFCheckpointError(f"{path}: the block at offset {offset} fails its crc32c check; the file is corrupt")
    if kind != 0:
        raise TFCheckpointError(f"{path}: a block compressed with type {kind}; TensorFlow writes checkpoint "
                                "indexes uncompressed (type 0), only those are read here")
    return block


def _entries(block: bytes) -> list[tuple[bytes, bytes]]:
    restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 - 4 * restarts
    out, pos, key = [], 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + unshared]
        pos += unshared
        out.append((key, block[pos:pos + length]))
        pos += length
    return out


def _handle(buf: bytes, pos: int = 0) -> tuple[int, int, int]:
    offset, pos = _varint(buf, pos)
    size, pos = _varint(buf, pos)
    return offset, size, pos


class BundleReader:
    """The tensors of the checkpoint `prefix` (`prefix.index`, `prefix.data-*`): `entries` by name, `read(name)`
    one tensor from disk, crc-checked."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        path = prefix + ".index"
        if not os.path.isfile(path):
            raise TFCheckpointError(f"{path}: no such file; a TensorFlow checkpoint is PREFIX.index with "
                                    "PREFIX.data-00000-of-00001")
        with open(path, "rb") as f:
            data = f.read()
        if len(data) < FOOTER or struct.unpack_from("<Q", data, len(data) - 8)[0] != MAGIC:
            raise TFCheckpointError(f"{path}: not a TensorFlow checkpoint index (no table magic number at its end)")
        try:
            _, _, pos = _handle(data, len(data) - FOOTER)  # the metaindex block: empty in a bundle
            index_offset, index_size, _ = _handle(data, pos)
            entries: dict[bytes, bytes] = {}
            for _, handle in _entries(_block(data, index_offset, index_size, path)):
                offset, size, _ = _handle(handle)
                entries.update(_entries(_block(data, offset, size, path)))
        except (ValueError, struct.error, IndexError) as e:
            if isinstance(e, TFCheckpointError):
                raise
            raise TFCheckpointError(f"{path}: cannot be parsed as a table ({e}); the file is corrupt")
        if HEADER_KEY not in entries:
            raise TFCheckpointError(f"{path}: no bundle header (the entry of key \"\"); not a TensorFlow V2 checkpoint")
        header = dict(_fields(entries.pop(HEADER_KEY)))
        self.num_shards = header.get(1, 0)
        if header.get(2, 0) != 0:
            raise TFCheckpointError(f"{path}: a big-endian checkpoint; only little-endian ones are read here")
        self.entries = {k.decode("utf-8", "backslashreplace"): Entry(v) for k, v in entries.items()}
        sliced = [n for n, e in self.entries.items() if e.sliced]
        if sliced:
            raise TFCheckpointError(f"{path}: {sliced[0]!r} is saved as slices (a partitioned variable); only whole "
                                    "tensors are read here")

    def names(self) -> list[str]:
        return list(self.entries)

    def data_file(self, shard: int) -> str:
        return f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}"

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        if e.dtype not in DTYPES and e.dtype != DT_BFLOAT16:
            raise TFCheckpointError(f"{self.prefix}: {name!r} is a {DT_NAMES.get(e.dtype, f'DataType {e.dtype}')} "
                                    "tensor, not a numeric one")
        dtype = np.dtype(np.uint16 if e.dtype == DT_BFLOAT16 else DTYPES[e.dtype])
        count = int(np.prod(e.shape, dtype=np.int64))
        if e.size != count * dtype.itemsize:
            raise TFCheckpointError(f"{self.prefix}: {name!r} of shape {e.shape} says {e.size} bytes, not "
                                    f"{count * dtype.itemsize}; the index is corrupt")
        path = self.data_file(e.shard_id)
        if not os.path.isfile(path):
            raise TFCheckpointError(f"{path}: no such file; {name!r} is in it (shard {e.shard_id} of "
                                    f"{self.num_shards})")
        with open(path, "rb") as f:
            f.seek(e.offset)
            raw = f.read(e.size)
        if len(raw) != e.size:
            raise TFCheckpointError(f"{path}: {name!r} is {e.size} bytes at offset {e.offset}, the file ends "
                                    f"after {len(raw)} of them; the file is truncated")
        actual = crc32c(raw)
        if actual != unmask(e.crc32c):
            raise TFCheckpointError(f"{path}: {name!r} ({e.size} bytes at offset {e.offset}) fails its crc32c check "
                                    f"(stored {unmask(e.crc32c):08x}, computed {actual:08x}); the file is corrupt")
        t = torch.from_numpy(np.frombuffer(raw, dtype=dtype).reshape(e.shape).copy())
        return t.view(torch.bfloat16) if e.dtype == DT_BFLOAT16 else t
