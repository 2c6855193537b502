"""A large GGUF metadata array (a vocabulary, its merges, scores or token types), kept as the
file's encoded bytes and decoded when it is read.

A 49K-token vocabulary and its merges are ~1.6 MB of encoded bytes but ~9 MB as Python strings
(a 262K vocabulary: ~3 MB against ~20 MB), and a loaded model holds its checkpoint, metadata
included, for its whole life, while the tokenizer reads these arrays once, when it is built.

    tokens = metadata["tokenizer.ggml.tokens"]   # a GGUFArray: len(), iteration, [i], ==
    vocabulary = list(tokens)                     # decoded once, to work on the values
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hybridllm.errors import ModelLoadError

# Arrays with at least this many elements are kept encoded; shorter ones (a layer pattern, a
# list of end-of-sequence ids) are plain lists.
LAZY_MIN_ELEMENTS = 1024

_LENGTH = struct.Struct("<Q")  # a GGUF string's byte length, before its UTF-8 bytes


class GGUFArray(Sequence):
    """``count`` elements of one GGUF type in their encoded bytes, decoded on each read.

    Args:
        data: the array's bytes as the file stores them (after its element type and count).
        count: how many elements.
        dtype: the elements' numpy dtype (little-endian), or None for strings.
        path: the file (for errors).
    """

    def __init__(self, data: bytes, count: int, dtype: np.dtype | None, path: Path) -> None:
        self._data, self._count, self._dtype, self._path = data, count, dtype, path
        self._starts: np.ndarray | None = None  # strings: (count,) byte offset of each, built on first item access

    @classmethod
    def strings_at(cls, buf: memoryview, pos: int, count: int, path: Path) -> tuple[GGUFArray, int]:
        """The ``count`` strings starting at ``buf[pos]``, and the position after them. Raises
        ModelLoadError where the buffer ends inside them."""
        start, end = pos, len(buf)
        for _ in range(count):
            if pos + 8 > end:
                raise ModelLoadError(f"{path}: truncated GGUF file (header ends at byte {end})")
            pos += 8 + _LENGTH.unpack_from(buf, pos)[0]
        if pos > end:
            raise ModelLoadError(f"{path}: truncated GGUF file (header ends at byte {end})")
        return cls(bytes(buf[start:pos]), count, None, path), pos

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Any]:
        return iter(self._decode())

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._decode()[index]
        if not -self._count <= index < self._count:
            raise IndexError(f"GGUF array index {index} out of range ({self._count} elements)")
        index %= self._count
        if self._dtype is not None:
            return np.frombuffer(self._data, self._dtype, count=1, offset=index * self._dtype.itemsize)[0].item()
        at = int(self._string_starts()[index])
        (length,) = _LENGTH.unpack_from(self._data, at)
        return self._string(at + 8, length)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (GGUFArray, list, tuple)):
            return self._decode() == list(other)
        return NotImplemented

    __hash__ = None  # a sequence compared by value, like a list

    def __repr__(self) -> str:
        kind = "strings" if self._dtype is None else str(self._dtype)
        return f"GGUFArray({self._count} {kind})"

    def _decode(self) -> list[Any]:
        if self._dtype is not None:
            return np.frombuffer(self._data, self._dtype, count=self._count).tolist()
        data, pos, out, length_at = memoryview(self._data), 0, [], _LENGTH.unpack_from
        try:
            for _ in range(self._count):  # one tight loop: a vocabulary is 50K-260K strings
                (length,) = length_at(data, pos)
                out.append(str(data[pos + 8:pos + 8 + length], "utf-8"))
                pos += 8 + length
        except UnicodeDecodeError as exc:
            raise self._malformed(exc) from None
        return out

    def _string(self, at: int, length: int) -> str:
        try:
            return str(memoryview(self._data)[at:at + length], "utf-8")
        except UnicodeDecodeError as exc:
            raise self._malformed(exc) from None

    def _malformed(self, exc: UnicodeDecodeError) -> ModelLoadError:
        return ModelLoadError(f"{self._path}: malformed GGUF string in a metadata array: {exc}")

    def _string_starts(self) -> np.ndarray:
        if self._starts is None:
            starts, pos = np.empty(self._count, np.int64), 0
            for i in range(self._count):
                starts[i] = pos
                pos += 8 + _LENGTH.unpack_from(self._data, pos)[0]
            self._starts = starts
        return self._starts
