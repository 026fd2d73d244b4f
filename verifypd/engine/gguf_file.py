"""A minimal GGUF reader: scalar metadata, array lengths and tensor views over a memory map.

``gguf.GGUFReader`` materialises every metadata array element as a numpy view, which takes
seconds for a 49k-token vocabulary; the loader needs only scalars, the vocabulary size and the
tensors, so this reader skips array contents. Dequantization stays ``gguf.quants.dequantize``.
Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (v2/v3, little-endian).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF metadata value types -> struct format of one scalar (8 = string, 9 = array).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] is the contiguous (innermost) axis
    ggml_type: int
    offset: int  # from the start of the tensor data section


class GGUFFile:
    """Parses the header of a GGUF file; tensor bytes are read lazily from a memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        self._pos = 4
        self.version = self._scalar(4)
        if self.version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {self.version}")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        self.fields: dict[str, Any] = {}  # scalars and strings
        self.array_lengths: dict[str, int] = {}  # arrays: only their length is kept
        for _ in range(num_fields):
            self._read_field()
        self.tensors = [self._read_tensor_info() for _ in range(num_tensors)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        self._data_start = -(-self._pos // alignment) * alignment

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The raw tensor as ``gguf.quants.dequantize`` expects it: uint8, numpy axis order
        (reversed ggml dims) with the last axis in bytes."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        ggml_type = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        num_bytes = int(np.prod(info.dims)) * type_size // block_size
        start = self._data_start + info.offset
        shape = quant_shape_to_byte_shape(tuple(reversed(info.dims)), ggml_type)
        return self._buf[start : start + num_bytes].reshape(shape)

    # ------------------------------------------------------------------ parsing
    def _scalar(self, value_type: int) -> Any:
        fmt = _SCALAR_FORMATS[value_type]
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._scalar(10)
        raw = bytes(self._buf[self._pos : self._pos + length])
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _read_field(self) -> None:
        key, value_type = self._string(), self._scalar(4)
        if value_type == _ARRAY:
            self.array_lengths[key] = self._skip_array()
        else:
            self.fields[key] = self._value(value_type)

    def _value(self, value_type: int) -> Any:
        return self._string() if value_type == _STRING else self._scalar(value_type)

    def _skip_array(self) -> int:
        """Moves past an array (contents unread); returns its length."""
        item_type, length = self._scalar(4), self._scalar(10)
        if item_type in _SCALAR_FORMATS:
            self._pos += length * struct.calcsize(_SCALAR_FORMATS[item_type])
        elif item_type == _STRING:
            for _ in range(length):
                self._pos += 8 + struct.unpack_from("<Q", self._buf, self._pos)[0]
        else:
            for _ in range(length):
                self._skip_array()
        return length

    def _read_tensor_info(self) -> GGUFTensorInfo:
        name = self._string()
        num_dims = self._scalar(4)
        dims = tuple(self._scalar(10) for _ in range(num_dims))
        return GGUFTensorInfo(name, dims, self._scalar(4), self._scalar(10))
