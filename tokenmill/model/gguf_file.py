"""A small, strict GGUF (v2/v3) reader: metadata, tensor index, raw tensor bytes.

gguf's own GGUFReader wraps every string of a 49k-token vocabulary in numpy
views and takes seconds; this reads the header with ``struct`` in tens of
milliseconds, checks every offset against the file size (so a truncated file is
named as such), and hands tensor bytes out as memory-mapped uint8 rows that
``gguf.dequantize`` accepts.

Layout: magic "GGUF", version u32, tensor count u64, KV count u64, the KV pairs,
the tensor infos (name, dims, type, offset), padding to ``general.alignment``,
then the tensor data.
"""

from __future__ import annotations

import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.errors import ModelLoadError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy order (outermost first), the reverse of GGUF's ne[]
    type_name: str
    data: np.ndarray  # uint8 [rows, bytes per row]


class _Cursor:
    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ModelLoadError(f"truncated GGUF file {self.path}: header ends early at byte {len(self.buf)}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (a vocabulary's 49k tokens and merges): one tight loop,
        not three calls a string (1.4 s of a 1B model's 3 s load before)."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        for _ in range(count):
            if pos + 8 > end:
                break
            n = int.from_bytes(buf[pos : pos + 8], "little")
            if pos + 8 + n > end:
                break
            out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8", "replace"))
            pos += 8 + n
        else:
            self.pos = pos
            return out
        raise ModelLoadError(f"truncated GGUF file {self.path}: header ends early at byte {end}")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALARS and item_type != 7:
                dtype = np.dtype(_SCALARS[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise ModelLoadError(f"corrupt GGUF file {self.path}: unknown metadata value type {vtype}")


_SPLIT_NAME = re.compile(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$")


def read_gguf(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    """Metadata dict and tensor list of a GGUF file (tensor data memory-mapped). A model split
    into parts (llama.cpp's gguf-split: ``NAME-00001-of-00003.gguf`` ...) is read whole from its
    first part, the others found beside it by name."""
    metadata, tensors = _read_one(path)
    count = int(metadata.get("split.count", 1) or 1)
    if count <= 1:
        return metadata, tensors
    m = _SPLIT_NAME.match(path.name)
    if int(metadata.get("split.no", 0)) != 0 or m is None or int(m.group(2)) != 1:
        first = f"{m.group(1)}-00001-of-{count:05d}.gguf" if m else "its -00001-of- file"
        raise ModelLoadError(f"{path} is one part of a GGUF split in {count}: give the first part ({first})")
    for i in range(2, count + 1):
        part = path.with_name(f"{m.group(1)}-{i:05d}-of-{count:05d}.gguf")
        if not part.exists():
            raise ModelLoadError(f"{path} is split in {count} parts and part {i} is missing: {part}")
        tensors += _read_one(part)[1]
    expected = metadata.get("split.tensors.count")
    if expected is not None and len(tensors) != int(expected):
        raise ModelLoadError(f"{path}: its {count} parts hold {len(tensors)} tensors, the first part says {expected}")
    return metadata, tensors


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """A GGUF file's metadata alone (a split model's first part holds all of it)."""
    return _read_one(path)[0]


def _read_one(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            f.seek(0)
            raise ModelLoadError(f"not a GGUF file (magic bytes {f.read(4)!r}, expected b'GGUF'): {path}")
        try:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as e:
            raise ModelLoadError(f"cannot map GGUF file {path}: {e}") from e
    cur = _Cursor(memoryview(mm), path)
    cur.take(4)
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ModelLoadError(f"unsupported GGUF version {version} in {path} (tokenmill reads 2 and 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(f"unknown GGUF tensor type id {type_id} (tensor {name}) in {path}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        row = dims[0] if dims else 1
        rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
        if row % block:
            raise ModelLoadError(f"tensor {name} in {path}: row of {row} is not a multiple of {qtype.name} blocks")
        row_bytes = row // block * type_size
        start = data_start + offset
        if start + rows * row_bytes > len(mm):
            raise ModelLoadError(
                f"truncated GGUF file {path}: tensor {name} needs bytes up to {start + rows * row_bytes}, "
                f"file has {len(mm)}"
            )
        data = np.frombuffer(mm, dtype=np.uint8, count=rows * row_bytes, offset=start).reshape(rows, row_bytes)
        tensors.append(GGUFTensor(name, tuple(reversed(dims)), qtype.name, data))
    return metadata, tensors
