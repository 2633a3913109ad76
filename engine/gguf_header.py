"""A `.gguf` file's header read light: its metadata, tensor count and parameter count.

Input: the path of a GGUF file (llama.cpp's single-file format). Output: `read_header(path)
-> GgufHeader` (the metadata's scalars and strings, the length of each array, the tensor count
and parameter count, whether the embeddings are tied), memoized by (path, size, mtime); no
numpy, no torch, no gguf package: `pipe validate` reads it. `is_gguf(value)` tells a `model:`
value that names one. The file converted into a checkpoint folder is
`stages.lib.model.gguf`'s; the chat template it carries, `stages.lib.chat.template`'s.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from dataclasses import dataclass, field
from typing import Any

MAGIC = b"GGUF"
# metadata value types (gguf's GGUFValueType): the fixed-size ones, then string (8), array (9)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class NotGGUF(ValueError):
    """The file is not a GGUF file this reader understands (its message says why)."""


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF file says about itself, without its tensors' data."""

    version: int
    metadata: dict[str, Any]  # scalars and strings; an array is listed in `arrays` instead
    arrays: dict[str, int] = field(default_factory=dict)  # array key -> its length
    tensors: int = 0
    parameters: int = 0  # elements of every tensor
    tied: bool = True  # no separate output projection (`output.weight`): tied embeddings

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def chat_template(self) -> str | None:
        template = self.metadata.get("tokenizer.chat_template")
        return template if isinstance(template, str) and template.strip() else None

    @property
    def vocab_size(self) -> int:
        return self.arrays.get("tokenizer.ggml.tokens", 0)

    def arch_value(self, key: str) -> Any:
        """`<architecture>.<key>` of the metadata (e.g. `block_count`), None when absent."""
        return self.metadata.get(f"{self.architecture}.{key}")


def read_header(path: str) -> GgufHeader:
    """The file's metadata (module docstring), memoized by (path, size, mtime); `NotGGUF`
    when it is not a GGUF file of version 2 or 3."""
    st = os.stat(path)
    return _read_header(os.path.abspath(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _read_header(path: str, size: int, mtime_ns: int) -> GgufHeader:
    with open(path, "rb") as f:
        if size < 24 or f.read(4) != MAGIC:
            raise NotGGUF("not a GGUF file (it does not start with 'GGUF')")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse(blob)


def _parse(blob: Any) -> GgufHeader:
    version, tensors, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise NotGGUF(f"GGUF version {version}; this reader knows versions 2 and 3")
    pos = 24
    metadata: dict[str, Any] = {}
    arrays: dict[str, int] = {}
    try:
        for _ in range(kv_count):
            key, pos = _string(blob, pos)
            (vtype,) = struct.unpack_from("<I", blob, pos)
            pos += 4
            if vtype == _ARRAY:
                (item, count) = struct.unpack_from("<IQ", blob, pos)
                arrays[key] = count
                pos = _skip_array(blob, pos + 12, item, count)
            else:
                metadata[key], pos = _value(blob, pos, vtype)
        parameters, tied = 0, True
        for _ in range(tensors):
            name, pos = _string(blob, pos)
            tied = tied and name != "output.weight"
            (dims,) = struct.unpack_from("<I", blob, pos)
            shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
            pos += 4 + 8 * dims + 12  # the dims, then the ggml type (u32) and offset (u64)
            n = 1
            for d in shape:
                n *= d
            parameters += n
    except (struct.error, UnicodeDecodeError, IndexError) as e:
        raise NotGGUF(
            f"a damaged GGUF header: {kv_count} metadata entries and {tensors} tensors "
            "announced, not all readable"
        ) from e
    return GgufHeader(version, metadata, arrays, tensors, parameters, tied)


def _string(blob: Any, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    end = pos + 8 + n
    if end > len(blob):
        raise IndexError("a string runs past the end of the file")
    return bytes(blob[pos + 8 : end]).decode("utf-8"), end


def _value(blob: Any, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(blob, pos)
    fmt = _SCALARS.get(vtype)
    if fmt is None:
        raise struct.error(f"unknown metadata value type {vtype}")
    return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)


def _skip_array(blob: Any, pos: int, item: int, count: int) -> int:
    if item == _STRING:  # each string's length leads it
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", blob, pos)
            pos += 8 + n
        return pos
    if item == _ARRAY:
        raise struct.error("nested metadata arrays")
    fmt = _SCALARS.get(item)
    if fmt is None:
        raise struct.error(f"unknown metadata array type {item}")
    return pos + struct.calcsize(fmt) * count


def is_gguf(path: Any) -> bool:
    """Whether a `model:` value names a GGUF file (by its suffix: the file may not exist yet)."""
    return isinstance(path, str) and path.lower().endswith(".gguf")
