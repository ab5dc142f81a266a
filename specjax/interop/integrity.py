"""Byte-range checks of GGUF and safetensors files, before any reader touches their tensors.

`check_gguf(path)` parses a GGUF header (magic, version, metadata, tensor infos) on its own and
`check_safetensors(path)` a safetensors header (8-byte length, JSON); both then check that every
tensor's data (offset + byte size) lies inside the file. A file that fails raises
CorruptModelFileError naming the file, the tensor when one is concerned, and the bytes expected
and available. They return the tensors' byte ranges: {name: (start, end)} (absolute offsets).
`check_finite(path, name, array)` refuses a tensor holding NaN or infinite values the same way.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct

import numpy as np

from specjax.interop.errors import CorruptModelFileError

GGUF_MAGIC = b'GGUF'
GGUF_VERSIONS = (2, 3)
GGUF_DEFAULT_ALIGNMENT = 32
_GGUF_MAX_DIMS = 8
# GGUF metadata value type id -> struct code of its scalars (8 string, 9 array).
_GGUF_SCALARS = {0: 'B', 1: 'b', 2: 'H', 3: 'h', 4: 'I', 5: 'i', 6: 'f', 7: '?', 10: 'Q', 11: 'q',
                 12: 'd'}  # fmt: skip
_GGUF_STRING, _GGUF_ARRAY = 8, 9
# safetensors dtype -> bits per element.
_SAFETENSORS_BITS = {'BOOL': 8, 'U8': 8, 'I8': 8, 'F8_E5M2': 8, 'F8_E4M3': 8, 'F8_E8M0': 8,
                     'F4': 4, 'F6_E2M3': 6, 'F6_E3M2': 6, 'I16': 16, 'U16': 16, 'F16': 16,
                     'BF16': 16, 'I32': 32, 'U32': 32, 'F32': 32, 'I64': 64, 'U64': 64,
                     'F64': 64, 'C64': 64}  # fmt: skip


class _Cursor:
    """Reads a file's header sequentially; CorruptModelFileError when a read passes its end."""

    def __init__(self, path: str, buffer, order: str = '<'):
        self.path, self.buffer, self.offset, self.order = path, buffer, 0, order

    def take(self, n: int, what: str) -> bytes:
        end = self.offset + n
        if n < 0 or end > len(self.buffer):
            raise CorruptModelFileError(
                self.path,
                f'the header ends inside {what}: it needs bytes {self.offset}..{end} but the '
                f'file has {len(self.buffer)} bytes',
            )
        out = self.buffer[self.offset : end]
        self.offset = end
        return out

    def scalar(self, code: str, what: str):
        return struct.unpack(self.order + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> bytes:
        return self.take(self.scalar('Q', f'the length of {what}'), what)


def _mapped(path: str):
    """(size, buffer) of the file: an mmap, or b'' for an empty file."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, b''
    with open(path, 'rb') as f:
        return size, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _check_ranges(path, entries, size: int) -> dict[str, tuple[int, int]]:
    """{name: (start, end)} of entries (name, start, n_bytes); CorruptModelFileError naming the
    first tensor, in file order, whose data runs past `size` (the one the file is cut in)."""
    past = sorted((start, name, n) for name, start, n in entries if start + n > size)
    if past:
        start, name, n = past[0]
        more = f'; {len(past)} tensors end past the end of the file' if len(past) > 1 else ''
        raise CorruptModelFileError(
            path,
            f'its data needs {n} bytes at offset {start} (to byte {start + n}) but the file has '
            f'{size} bytes ({max(0, size - start)} of them available){more}',
            tensor=name,
        )
    return {name: (start, start + n) for name, start, n in entries}


def _skip_gguf_value(cur: _Cursor, kind: int, what: str):
    """Moves past one metadata value; returns it when it is a scalar (for general.alignment)."""
    if kind in _GGUF_SCALARS:
        return cur.scalar(_GGUF_SCALARS[kind], what)
    if kind == _GGUF_STRING:
        cur.string(what)
        return None
    if kind != _GGUF_ARRAY:
        raise CorruptModelFileError(cur.path, f'{what} has unknown value type {kind}')
    item = cur.scalar('I', f'the item type of {what}')
    count = cur.scalar('Q', f'the length of {what}')
    if item in _GGUF_SCALARS:
        cur.take(count * struct.calcsize(_GGUF_SCALARS[item]), what)
    else:
        for i in range(count):
            _skip_gguf_value(cur, item, f'{what}[{i}]')
    return None


def check_gguf(path: str) -> dict[str, tuple[int, int]]:
    """Every tensor's (start, end) byte range of a GGUF file; CorruptModelFileError if a header
    field or a tensor's data runs past the end of the file, or the header is malformed."""
    from gguf import GGML_QUANT_SIZES

    size, buffer = _mapped(path)
    try:
        cur = _Cursor(path, buffer)
        magic = cur.take(4, 'the GGUF magic')
        if magic != GGUF_MAGIC:
            raise CorruptModelFileError(path, f'it starts with {magic!r}, not the GGUF magic')
        version = cur.scalar('I', 'the GGUF version')
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            cur.order, version = '>', struct.unpack('>I', struct.pack('<I', version))[0]
        if version not in GGUF_VERSIONS:
            raise CorruptModelFileError(path, f'GGUF version {version} not in {GGUF_VERSIONS}')
        n_tensors = cur.scalar('Q', 'the tensor count')
        n_kv = cur.scalar('Q', 'the metadata count')
        if n_tensors > size or n_kv > size:
            raise CorruptModelFileError(
                path, f'its header claims {n_tensors} tensors and {n_kv} metadata keys'
            )
        alignment = GGUF_DEFAULT_ALIGNMENT
        for i in range(n_kv):
            key = cur.string(f'metadata key #{i}').decode('utf-8', 'replace')
            kind = cur.scalar('I', f'the type of metadata {key!r}')
            value = _skip_gguf_value(cur, kind, f'metadata {key!r}')
            if key == 'general.alignment':
                alignment = value
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise CorruptModelFileError(path, f'general.alignment={alignment!r} is invalid')
        infos = []
        for i in range(n_tensors):
            name = cur.string(f'the name of tensor #{i}').decode('utf-8', 'replace')
            n_dims = cur.scalar('I', f'the rank of tensor {name!r}')
            if n_dims > _GGUF_MAX_DIMS:
                raise CorruptModelFileError(path, f'rank {n_dims} > {_GGUF_MAX_DIMS}', tensor=name)
            dims = [cur.scalar('Q', f'the shape of tensor {name!r}') for _ in range(n_dims)]
            kind = cur.scalar('I', f'the type of tensor {name!r}')
            offset = cur.scalar('Q', f'the data offset of tensor {name!r}')
            infos.append((name, dims, kind, offset))
        data_start = -(-cur.offset // alignment) * alignment
        entries = []
        for name, dims, kind, offset in infos:
            if kind not in GGML_QUANT_SIZES:
                raise CorruptModelFileError(path, f'unknown GGML type id {kind}', tensor=name)
            block, type_size = GGML_QUANT_SIZES[kind]
            entries.append((name, data_start + offset, math.prod(dims) * type_size // block))
        return _check_ranges(path, entries, size)
    finally:
        if isinstance(buffer, mmap.mmap):
            buffer.close()


def check_safetensors(path: str) -> dict[str, tuple[int, int]]:
    """Every tensor's (start, end) byte range of a safetensors file; CorruptModelFileError if
    the header is cut off or not a JSON object of tensor entries, or if a tensor's data range
    does not match its dtype and shape or runs past the end of the file."""
    size = os.path.getsize(path)
    with open(path, 'rb') as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptModelFileError(path, f'it has {size} bytes, not even a header length')
        n = struct.unpack('<Q', head)[0]
        if 8 + n > size:
            raise CorruptModelFileError(
                path, f'its header needs {n} bytes after byte 8 but the file has {size} bytes'
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptModelFileError(path, f'its {n}-byte header is not valid JSON ({e})') from e
    if not isinstance(header, dict):
        raise CorruptModelFileError(path, 'its header is not a JSON object')
    entries = []
    for name, entry in header.items():
        if name == '__metadata__':
            continue
        try:
            dtype, shape = entry['dtype'], [int(d) for d in entry['shape']]
            begin, end = (int(x) for x in entry['data_offsets'])
        except (TypeError, KeyError, ValueError) as e:
            raise CorruptModelFileError(
                path, f'its header entry {entry!r} lacks dtype, shape or data_offsets', tensor=name
            ) from e
        bits = _SAFETENSORS_BITS.get(dtype)
        if begin < 0 or end < begin or (bits and end - begin != -(-math.prod(shape) * bits // 8)):
            raise CorruptModelFileError(
                path,
                f'data_offsets [{begin}, {end}] do not fit dtype {dtype} and shape {shape}',
                tensor=name,
            )
        entries.append((name, 8 + n + begin, end - begin))
    return _check_ranges(path, entries, size)


def check_finite(path: str | os.PathLike, name: str, array) -> None:
    """CorruptModelFileError naming the file and tensor if `array` holds NaN or Inf values."""
    values = np.asarray(array)
    if values.dtype.kind not in 'fc' and 'float' not in values.dtype.name:
        return
    finite = np.isfinite(values.astype(np.float32) if values.dtype.kind == 'V' else values)
    if not finite.all():
        bad = int(finite.size - np.count_nonzero(finite))
        raise CorruptModelFileError(
            path, f'{bad} of its {finite.size} values are NaN or infinite', tensor=name
        )
