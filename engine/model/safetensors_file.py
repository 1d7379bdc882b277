"""Raw safetensors: the header parsed here and the data memory-mapped, so any dtype tag can be read,
including the ones numpy (and `mx.load`) cannot type — `F8_E4M3`, `F8_E8M0`, packed FP4 in `I8`.

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}},
then the data. Every error names the file and, where there is one, the tensor and its shape.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

# dtype tag -> (bytes per stored element, numpy dtype used to view the bytes)
DTYPE_TAGS: dict[str, tuple[int, np.dtype]] = {
    "F32": (4, np.dtype("<f4")),
    "F16": (2, np.dtype("<f2")),
    "BF16": (2, np.dtype("<u2")),  # raw bits; engine/model/loader.py turns them into mx.bfloat16
    "I64": (8, np.dtype("<i8")),
    "I32": (4, np.dtype("<i4")),
    "I8": (1, np.dtype("i1")),
    "U8": (1, np.dtype("u1")),
    "U32": (4, np.dtype("<u4")),
    "F8_E4M3": (1, np.dtype("u1")),
    "F8_E8M0": (1, np.dtype("u1")),
}


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read; the message names the file and tensor."""


@dataclass(frozen=True)
class RawTensor:
    name: str
    dtype: str  # the safetensors tag, e.g. "F8_E4M3"
    shape: tuple[int, ...]
    data: np.ndarray  # a memory-mapped view of the bytes, typed by DTYPE_TAGS, shaped `shape`
    file: Path


def read_header(path: Path) -> tuple[dict, int]:
    """-> (header without __metadata__, offset of the data section)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError(f"{path}: truncated file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SafetensorsError(f"{path}: truncated file (header says {n} bytes, file has {size - 8} after the length)")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as exc:
            raise SafetensorsError(f"{path}: unreadable header ({exc})") from exc
    header.pop("__metadata__", None)
    return header, 8 + n


def open_tensors(path: Path) -> dict[str, RawTensor]:
    """Every tensor of one file as a typed memory-mapped view (nothing is read until used)."""
    path = Path(path)
    header, start = read_header(path)
    data_size = path.stat().st_size - start
    mapped = np.memmap(path, dtype=np.uint8, mode="r", offset=start, shape=(data_size,)) if data_size else np.zeros(0, np.uint8)
    out: dict[str, RawTensor] = {}
    by_offset = sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", (0, 0))[0])
    for name, info in by_offset:  # a truncated file names the first tensor it cuts
        out[name] = _view(path, name, info, mapped, data_size)
    return out


def _view(path: Path, name: str, info: dict, mapped: np.ndarray, data_size: int) -> RawTensor:
    dtype, shape = info.get("dtype"), tuple(info.get("shape", ()))
    begin, end = info.get("data_offsets", (0, 0))
    if dtype not in DTYPE_TAGS:
        raise SafetensorsError(f"{path}: tensor {name!r} {shape} has dtype {dtype!r}, which Tessera does not read")
    width, np_dtype = DTYPE_TAGS[dtype]
    if end - begin != prod(shape) * width:
        raise SafetensorsError(f"{path}: tensor {name!r} {dtype} {shape} needs {prod(shape) * width} bytes, header gives {end - begin}")
    if end > data_size:
        raise SafetensorsError(f"{path}: truncated file: tensor {name!r} {dtype} {shape} ends at byte {end} of the data, file has {data_size}")
    return RawTensor(name, dtype, shape, mapped[begin:end].view(np_dtype).reshape(shape), path)


def write_file(path: Path, tensors: dict[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None) -> int:
    """tensors: name -> (dtype tag, array whose bytes are the stored bytes). Returns the file size."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, (tag, array) in tensors.items():
        width = DTYPE_TAGS[tag][0]
        nbytes = array.nbytes
        shape = list(array.shape)
        if tag == "I8" and array.dtype.itemsize != 1:
            raise SafetensorsError(f"tensor {name!r}: I8 data must be bytes")
        if nbytes != prod(shape) * width:
            raise SafetensorsError(f"tensor {name!r}: {nbytes} bytes do not make {tag} {tuple(shape)}")
        header[name] = {"dtype": tag, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # align the data section as the format recommends
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, array in tensors.values():
            f.write(np.ascontiguousarray(array).tobytes())
    return 8 + len(encoded) + offset


class ShardedWriter:
    """Writes tensors into `model-0000i-of-0000n.safetensors` shards of at most `shard_bytes` (one
    tensor may exceed it alone) plus `model.safetensors.index.json`; a full shard is written and
    freed as soon as the next tensor does not fit."""

    def __init__(self, out_dir: Path, shard_bytes: int) -> None:
        self.out_dir, self.shard_bytes = Path(out_dir), shard_bytes
        self._pending: dict[str, tuple[str, np.ndarray]] = {}
        self._size = 0
        self._shards: list[list[str]] = []  # names per written shard

    def add(self, name: str, tag: str, array: np.ndarray) -> None:
        if self._pending and self._size + array.nbytes > self.shard_bytes:
            self._write_pending()
        self._pending[name] = (tag, array)
        self._size += array.nbytes

    def close(self) -> int:
        """Names the shards, writes the index; returns the bytes written."""
        if self._pending or not self._shards:
            self._write_pending()
        n, weight_map, total = len(self._shards), {}, 0
        for i, names in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tmp = self.out_dir / f".shard-{i}.safetensors"
            total += tmp.stat().st_size
            tmp.rename(self.out_dir / final)
            weight_map.update({k: final for k in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        return total

    def _write_pending(self) -> None:
        # the shard count is known only at the end: a temporary name now, renamed in close()
        write_file(self.out_dir / f".shard-{len(self._shards)}.safetensors", self._pending)
        self._shards.append(list(self._pending))
        self._pending, self._size = {}, 0
