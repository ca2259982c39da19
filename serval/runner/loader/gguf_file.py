"""The GGUF container: its header, metadata and tensor directory, read from a memory map in one pass.

Owns the byte format only (llama.cpp's gguf.md, versions 2 and 3, little-endian): what the metadata keys
hold and where each tensor's bytes lie. What the keys and tensors mean for a model is gguf.py's business.

`gguf.GGUFReader` does the same job, but it wraps every value in numpy views: a 128k-token vocabulary makes
~400k small arrays and takes seconds, and serval opens the file twice (weights and tokenizer). Here a
string array is decoded straight to Python strings and numeric arrays are one numpy view each, so a 7B
file's directory reads in a fraction of a second. Tensor data are views into the mapping, typed the way
GGUFReader types them (float arrays for F32/F16, (rows, bytes) uint8 for block types), so nothing is read
until a tensor is used.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# Value type codes of the metadata (gguf.md): scalars as struct formats, 8 = string, 9 = array.
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_NUMPY_TYPES: dict[int, str] = {
    0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8",
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Element types GGUFReader gives as typed arrays; every other type is given as (rows, bytes) uint8.
_TYPED_DATA = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # ggml order: fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # a view into the mapping


class GGUFFile:
    """An open GGUF file: `metadata` (key -> int, float, bool, str or list of them), `tensors` in file order.

    Raises ValueError for anything that is not a well-formed GGUF file.
    """

    def __init__(self, path: str) -> None:
        with open(path, "rb") as file:
            self._mmap = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        self.data = np.frombuffer(self._mmap, dtype=np.uint8)
        self._pos = 0
        if self._bytes(4) != _MAGIC:
            raise ValueError("bad magic (not a GGUF file)")
        version = self._scalar("<I")
        if version not in (2, 3):
            swapped = struct.unpack(">I", struct.pack("<I", version))[0]
            detail = "big-endian files are not supported" if swapped in (2, 3) else f"version {version}"
            raise ValueError(f"unsupported GGUF file: {detail}")
        num_tensors, num_metadata = self._scalar("<Q"), self._scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_metadata):
            key = self._string()
            self.metadata[key] = self._value(self._scalar("<I"))
        directory = [self._tensor_info() for _ in range(num_tensors)]
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"bad general.alignment {alignment!r}")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(data_start, *info) for info in directory]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("a tensor name occurs twice")

    def _bytes(self, count: int) -> bytes:
        end = self._pos + count
        if count < 0 or end > len(self._mmap):
            raise ValueError("truncated file")
        chunk = self._mmap[self._pos : end]
        self._pos = end
        return chunk

    def _scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._bytes(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        # GGUF strings are UTF-8 by the spec; undecodable bytes become U+FFFD instead of failing the load
        return self._bytes(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self._scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown metadata value type {value_type}")
        item_type, count = self._scalar("<I"), self._scalar("<Q")
        if item_type in _NUMPY_TYPES:  # one view for the whole array, not a read per item
            dtype = np.dtype(_NUMPY_TYPES[item_type])
            items = np.frombuffer(self._bytes(count * dtype.itemsize), dtype=dtype)
            return (items != 0).tolist() if item_type == 7 else items.tolist()
        if item_type == _STRING:
            return self._strings(count)
        return [self._value(item_type) for _ in range(count)]

    def _strings(self, count: int) -> list[str]:
        """An array of strings (a vocabulary: 50k-250k of them), read in one tight loop."""
        data, pos, size = self._mmap, self._pos, len(self._mmap)
        unpack_length = struct.Struct("<Q").unpack_from
        strings = []
        for _ in range(count):
            if pos + 8 > size:
                raise ValueError("truncated file")
            (length,) = unpack_length(data, pos)
            end = pos + 8 + length
            if end > size:
                raise ValueError("truncated file")
            strings.append(data[pos + 8 : end].decode("utf-8", errors="replace"))
            pos = end
        self._pos = pos
        return strings

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        num_dims = self._scalar("<I")
        if num_dims > 8:
            raise ValueError(f"tensor {name!r} has {num_dims} dimensions")
        shape = struct.unpack(f"<{num_dims}Q", self._bytes(8 * num_dims))
        return name, shape, self._scalar("<I"), self._scalar("<Q")

    def _tensor(
        self, data_start: int, name: str, shape: tuple[int, ...], raw_type: int, offset: int
    ) -> GGUFTensor:
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(f"tensor {name!r} has unknown type {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if shape and shape[0] % block_size:
            raise ValueError(f"tensor {name!r}: a row of {shape[0]} is not whole {tensor_type.name} blocks")
        n_bytes = n_elements // block_size * type_size
        begin = data_start + offset
        if begin + n_bytes > len(self.data):
            raise ValueError(f"tensor {name!r} lies past the end of the file (truncated?)")
        raw = self.data[begin : begin + n_bytes]
        numpy_shape = tuple(reversed(shape))
        if tensor_type in _TYPED_DATA:
            data = raw.view(_TYPED_DATA[tensor_type]).reshape(numpy_shape)
        else:  # a row of blocks per row, as bytes
            data = raw.reshape(*numpy_shape[:-1], shape[0] // block_size * type_size)
        return GGUFTensor(name, tensor_type, shape, n_elements, n_bytes, begin, data)

    def release_pages(self, offset: int, length: int) -> None:
        """Drop pages of the mapping from this process's resident memory (they stay in the page cache).

        The file is mapped whole; every page read stays resident, counted in this process, until the
        mapping goes, so a load would otherwise peak at the file's size on top of the packed model."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        begin = offset // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(-(-(offset + length) // mmap.PAGESIZE) * mmap.PAGESIZE, len(self._mmap))
        if end > begin:
            self._mmap.madvise(mmap.MADV_DONTNEED, begin, end - begin)
