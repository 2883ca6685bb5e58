"""Every encoding a row can be answered in, defined once: the replica encodes its finished float32 rows here
before they go on the wire, the gateway answers the bytes it gets as JSON numbers or base64, and tests and
benchmarks decode them here. numpy only, so the gateway can use it. docs/encodings.md explains each one.

An `Encoding` is a row's bytes on the wire (the proto's enum, number for number), always little-endian; an API's
`encoding_format` names one of them and whether each row is answered as a base64 string of its bytes or as a
JSON list of its numbers (`FORMATS`).
"""

from __future__ import annotations

import base64
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np


class Encoding(IntEnum):
    """A row's bytes on the wire; the same names and numbers as embedding.proto's `Encoding`."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    INT8 = 3
    UINT8 = 4
    BINARY = 5
    UBINARY = 6
    UBINARY_LSB = 7
    FP8_E4M3 = 8
    FP8_E5M2 = 9


_INT8_SCALE = 127.0


def int8_rows(rows: np.ndarray) -> np.ndarray:  # [B, D] float32 -> [B, D] int8
    """round(127 * x / |x|): each row's direction on a fixed grid, whatever its length and whatever the other
    rows hold. A unit vector's values lie in [-1, 1], so nothing is ever clipped; every row is on the same scale,
    so a dot product or a distance between int8 rows ranks as the cosine between the float rows does."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    scale = np.divide(_INT8_SCALE, norms, out=np.zeros_like(norms), where=norms > 0)
    return np.clip(np.rint(rows * scale), -_INT8_SCALE, _INT8_SCALE).astype(np.int8)


def _uint8_rows(rows: np.ndarray) -> np.ndarray:  # [B, D] uint8: int8 + 128, sentence-transformers' relation
    return int8_rows(rows).view(np.uint8) ^ np.uint8(0x80)


def _ubinary_rows(rows: np.ndarray) -> np.ndarray:  # [B, ceil(D / 8)] uint8
    """One bit a value, 1 where it is > 0, eight to a byte with the first in the most significant bit; the last
    byte's unused low bits are 0 (np.packbits, as sentence-transformers' quantize_embeddings packs them)."""
    return np.packbits(rows > 0, axis=1)


def _binary_rows(rows: np.ndarray) -> np.ndarray:  # [B, ceil(D / 8)] int8: ubinary - 128
    return (_ubinary_rows(rows) ^ np.uint8(0x80)).view(np.int8)


def _ubinary_lsb_rows(rows: np.ndarray) -> np.ndarray:  # [B, ceil(D / 8)] uint8
    """The same bits with the first value in the least significant bit (Perplexity's base64_binary)."""
    return np.packbits(rows > 0, axis=1, bitorder="little")


def _bfloat16_rows(rows: np.ndarray) -> np.ndarray:  # [B, D] uint16: bfloat16's bits
    """float32's upper 16 bits, rounded to nearest even (as torch converts); NaN stays NaN."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return np.where(np.isnan(rows), np.uint32(0x7FC0), rounded).astype(np.uint16)


@dataclass(frozen=True)
class Float8:
    """An 8-bit float format: 1 sign bit, `exponent_bits`, `mantissa_bits`, the exponent's `bias`; `max_bits`, the
    float32 magnitude's bits from which on a value is out of range, and the code it becomes then (`overflow`).
    Both as torch converts, which is what vLLM sends: e4m3fn has no infinity and saturates (anything from 464 up,
    infinity included, is 448, 0x7E); e5m2 has IEEE's infinity (0x7C)."""

    exponent_bits: int
    mantissa_bits: int
    bias: int
    max_bits: int
    overflow: int
    nan: int = 0x7F

    def encode(self, rows: np.ndarray) -> np.ndarray:  # [B, D] float32 -> [B, D] uint8
        """Round to nearest even, subnormals included, by float32 bit arithmetic (numpy has no float8)."""
        bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
        sign = ((bits >> np.uint32(24)) & np.uint32(0x80)).astype(np.uint8)
        magnitude = bits & np.uint32(0x7FFFFFFF)
        shift = 23 - self.mantissa_bits
        # Normal: rebias the exponent, then round the dropped bits to nearest, ties to the even result.
        odd = (magnitude >> np.uint32(shift)) & np.uint32(1)
        rebias = np.uint32(((self.bias - 127) << 23) % (1 << 32))
        normal = (magnitude + rebias + np.uint32((1 << (shift - 1)) - 1) + odd) >> np.uint32(shift)
        # Subnormal: adding a float32 whose last mantissa bit weighs the format's smallest step makes the FPU
        # round to that step (to nearest, ties to even); its bits less the float's are the code.
        step_bits = np.uint32((127 + shift - (self.bias - 1)) << 23)
        step = np.array([step_bits], dtype=np.uint32).view(np.float32)[0]
        subnormal = (magnitude.view(np.float32) + step).view(np.uint32) - step_bits
        smallest_normal = np.uint32((128 - self.bias) << 23)
        out = np.where(magnitude < smallest_normal, subnormal, normal)
        out = np.where(magnitude >= np.uint32(self.max_bits), np.uint32(self.overflow), out)
        out = np.where(magnitude > np.uint32(0x7F800000), np.uint32(self.nan), out)
        return out.astype(np.uint8) | sign

    def decode(self, data: np.ndarray, _dimension: int = 0) -> np.ndarray:  # [B, D] uint8 -> [B, D] float32
        return _float8_values(self)[data.view(np.uint8)]

    def table(self) -> np.ndarray:
        """The 256 values, by the format's definition (e4m3fn: no infinity, 0x7F and 0xFF NaN; e5m2: IEEE's)."""
        codes = np.arange(256, dtype=np.int64)
        exponent = (codes >> self.mantissa_bits) & ((1 << self.exponent_bits) - 1)
        mantissa = (codes & ((1 << self.mantissa_bits) - 1)).astype(np.float64) / (1 << self.mantissa_bits)
        magnitude = np.where(
            exponent == 0,
            np.ldexp(mantissa, 1 - self.bias),
            np.ldexp(1 + mantissa, (exponent - self.bias).astype(np.int32)),
        )
        values = np.where(codes & 0x80, -magnitude, magnitude)
        top_exponent = exponent == (1 << self.exponent_bits) - 1
        if self.has_infinity:
            values = np.where(top_exponent, np.where(mantissa == 0, np.inf, np.nan), values)
            values = np.where(top_exponent & (codes & 0x80 > 0), -values, values)
        else:
            values = np.where((codes & 0x7F) == self.nan, np.nan, values)
        return values.astype(np.float32)

    @property
    def has_infinity(self) -> bool:
        return self.overflow != 0x7E


@functools.cache
def _float8_values(form: Float8) -> np.ndarray:
    return form.table()


# torch's float8_e4m3fn (max 448) and float8_e5m2 (max 57,344; from 61,440 up infinity): vLLM's `embed_dtype`
# fp8_e4m3 and fp8_e5m2.
FLOAT8_E4M3 = Float8(exponent_bits=4, mantissa_bits=3, bias=7, max_bits=0x43E80000, overflow=0x7E)
FLOAT8_E5M2 = Float8(exponent_bits=5, mantissa_bits=2, bias=15, max_bits=0x47800000, overflow=0x7C)


def _unpack_bits(bits: np.ndarray, dimension: int, bitorder: str) -> np.ndarray:  # [B, D] float32 of -1 and +1
    return np.unpackbits(bits, axis=1, count=dimension, bitorder=bitorder).astype(np.float32) * 2 - 1


@dataclass(frozen=True)
class Layout:
    """How one encoding lays a row out: its element type, how many values share an element, and the way there
    (`encode`: finished float32 rows in) and back (`decode`: float32 rows that compare as the encoded ones do)."""

    dtype: np.dtype  # one element, little-endian
    values_per_element: int  # 8 for packed bits, else 1
    encode: Callable[[np.ndarray], np.ndarray]  # [B, D] float32 -> [B, elements]
    decode: Callable[[np.ndarray, int], np.ndarray]  # ([B, elements], D) -> [B, D] float32

    def elements(self, dimension: int) -> int:
        """How many elements a row of `dimension` values takes (packed bits round up to a whole byte)."""
        return -(-dimension // self.values_per_element)


LAYOUTS: dict[Encoding, Layout] = {
    Encoding.FLOAT32: Layout(
        np.dtype("<f4"), 1, lambda rows: rows.astype("<f4", copy=False), lambda data, _: data.astype(np.float32)
    ),
    Encoding.FLOAT16: Layout(np.dtype("<f2"), 1, lambda rows: rows.astype("<f2"), lambda data, _: data.astype("f4")),
    Encoding.BFLOAT16: Layout(
        np.dtype("<u2"), 1, _bfloat16_rows, lambda data, _: (data.astype(np.uint32) << 16).view(np.float32)
    ),
    Encoding.INT8: Layout(np.dtype("i1"), 1, int8_rows, lambda data, _: data / np.float32(_INT8_SCALE)),
    Encoding.UINT8: Layout(
        np.dtype("u1"), 1, _uint8_rows, lambda data, _: (data.astype(np.float32) - 128) / np.float32(_INT8_SCALE)
    ),
    Encoding.BINARY: Layout(
        np.dtype("i1"), 8, _binary_rows, lambda data, d: _unpack_bits(data.view(np.uint8) ^ np.uint8(0x80), d, "big")
    ),
    Encoding.UBINARY: Layout(np.dtype("u1"), 8, _ubinary_rows, lambda data, d: _unpack_bits(data, d, "big")),
    Encoding.UBINARY_LSB: Layout(np.dtype("u1"), 8, _ubinary_lsb_rows, lambda data, d: _unpack_bits(data, d, "little")),
    Encoding.FP8_E4M3: Layout(np.dtype("u1"), 1, FLOAT8_E4M3.encode, FLOAT8_E4M3.decode),
    Encoding.FP8_E5M2: Layout(np.dtype("u1"), 1, FLOAT8_E5M2.encode, FLOAT8_E5M2.decode),
}


def encode_rows(rows: np.ndarray, encoding: Encoding) -> np.ndarray:  # [B, D] float32 -> [B, elements]
    return LAYOUTS[encoding].encode(rows)


def decode_rows(data: np.ndarray, encoding: Encoding, dimension: int) -> np.ndarray:  # -> [B, D] float32
    """Encoded rows back as float32 that rank as they do: the floats themselves, int8 and uint8 as the unit
    direction (value / 127), bits as -1 and +1 (their dot product is D - 2 * the Hamming distance)."""
    return LAYOUTS[encoding].decode(data, dimension)


def rows_from_bytes(data: bytes, encoding: Encoding, num_rows: int, dimension: int) -> np.ndarray:
    """[num_rows, elements] read in place from the wire's bytes; ValueError when their length does not fit."""
    layout = LAYOUTS[encoding]
    elements = layout.elements(dimension)
    if len(data) != num_rows * elements * layout.dtype.itemsize:
        raise ValueError(
            f"{len(data)} bytes of {encoding.name} rows, not {num_rows} rows of {dimension} values "
            f"({elements} x {layout.dtype.itemsize} bytes each)"
        )
    return np.frombuffer(data, dtype=layout.dtype).reshape(num_rows, elements)


@dataclass(frozen=True)
class ResponseFormat:
    """What an API's `encoding_format` asks for: the encoding the replica sends, and whether each row is
    answered as a base64 string of its bytes (else as a JSON list of its numbers), big-endian if asked."""

    encoding: Encoding = Encoding.FLOAT32
    base64: bool = False
    big_endian: bool = False  # vLLM's endianness="big" for base64 of float32, float16 or bfloat16

    def answer(self, rows: np.ndarray) -> np.ndarray | list[str]:
        """Each row as the response holds it: the rows themselves (orjson writes their numbers) or base64."""
        if not self.base64:
            return rows
        if self.big_endian:
            rows = rows.byteswap()
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in rows]


# The API's encoding_format values (OpenAI's float and base64, sentence-transformers' precisions, Perplexity's
# base64 forms); `base64` takes vLLM's embed_dtype and endianness too (EMBED_DTYPES, ENDIANNESS).
FORMATS: dict[str, ResponseFormat] = {
    "float": ResponseFormat(Encoding.FLOAT32),
    "base64": ResponseFormat(Encoding.FLOAT32, base64=True),
    "int8": ResponseFormat(Encoding.INT8),
    "uint8": ResponseFormat(Encoding.UINT8),
    "binary": ResponseFormat(Encoding.BINARY),
    "ubinary": ResponseFormat(Encoding.UBINARY),
    "base64_int8": ResponseFormat(Encoding.INT8, base64=True),
    "base64_binary": ResponseFormat(Encoding.UBINARY_LSB, base64=True),
}
EMBED_DTYPES: dict[str, Encoding] = {
    "float32": Encoding.FLOAT32,
    "float16": Encoding.FLOAT16,
    "bfloat16": Encoding.BFLOAT16,
    "fp8_e4m3": Encoding.FP8_E4M3,
    "fp8_e5m2": Encoding.FP8_E5M2,
}
ENDIANNESS: dict[str, bool] = {"native": sys.byteorder == "big", "little": False, "big": True}  # -> big_endian
