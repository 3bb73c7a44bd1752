"""CRC32C, the one checksum distckpt writes and checks, and its algebra over blocks (the ground
floor: it imports nothing of ours).

``fastcrc`` folds the bytes with carry-less multiplies (VPCLMULQDQ / PMULL where the CPU has them)
and releases the GIL for inputs of 16 KiB and more: on the 2-core development VM it runs at
51 GiB/s on cached bytes against 25 GiB/s for the SSE4.2 ``crc32c`` package distckpt used before,
which makes a save to tmpfs 6-12% faster (docs/performance-history.md).

The algebra (:func:`shift`, :func:`combine`, :func:`extend`) combines the CRC32Cs of pieces into
the CRC32C of their concatenation; :mod:`distckpt.formats.blockcrc` builds the per-file block
tables on it, and :mod:`distckpt.formats.manifest` checks a range against its block CRC32Cs with it.
"""

from __future__ import annotations

import struct
from typing import Dict, List, Tuple

import fastcrc.crc32 as _fastcrc32

__all__ = ["BLOCK_SIZE", "combine", "crc32c", "extend", "pack_block_crcs", "shift", "shift_tables"]

# 256 KiB: a partial read wastes at most one block at each end of each range it fetches; objects
# stores answer a GET with ~tens of ms of latency (worth a few MB of transfer), so finer blocks
# would save little, while 4 table shifts per MiB keep the writer's bookkeeping invisible and the
# table at 16 KiB per GiB of data. Every dtype's itemsize divides it, so blocks hold whole elements.
BLOCK_SIZE = 256 << 10


def crc32c(data, value: int = 0) -> int:
    """CRC32C (Castagnoli, iSCSI) of any bytes-like object (writable buffers too), continuing
    from ``value``."""
    return _fastcrc32.iscsi(data, value)


def pack_block_crcs(crcs: List[int]) -> bytes:
    """Block CRC32Cs as the manifest keeps them (little-endian 32-bit words)."""
    return struct.pack(f"<{len(crcs)}I", *crcs)


# --------------------------------------------------------------------------- CRC32C algebra

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (reflected bit order)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


_X2N = [1 << 30]  # x^(2^k) mod p
for _ in range(63):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _x8n(n: int) -> int:
    """x^(8n) mod p."""
    p, k = 1 << 31, 3
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 63], p)
        n >>= 1
        k += 1
    return p


_TABLES: Dict[int, Tuple[List[int], ...]] = {}


def shift_tables(n: int) -> Tuple[List[int], ...]:
    """Four byte tables applying the shift by ``n`` bytes: ``shift(crc, n) == t0[crc & 255] ^
    t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]`` (cached)."""
    t = _TABLES.get(n)
    if t is None:
        op = _x8n(n)
        basis = [_multmodp(op, 1 << i) for i in range(32)]
        out = []
        for byte in range(4):
            row = [0] * 256
            for v in range(1, 256):
                low = v & -v
                row[v] = row[v ^ low] ^ basis[byte * 8 + low.bit_length() - 1]
            out.append(row)
        t = _TABLES[n] = tuple(out)
    return t


def shift(crc: int, n: int) -> int:
    """``crc`` advanced over ``n`` zero bytes of message (the combine operator)."""
    if n == 0:
        return crc
    if n in _TABLES or n == BLOCK_SIZE:  # the block size: tables built once (~1 ms), ~1 us a shift
        t0, t1, t2, t3 = shift_tables(n)
        return t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24]
    return _multmodp(_x8n(n), crc)  # any other length: ~0.1 ms, nothing cached


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32C of ``A || B`` from ``crc1`` = CRC32C(A), ``crc2`` = CRC32C(B), ``len2`` = len(B)."""
    return shift(crc1, len2) ^ crc2


def extend(crc: int, data, crcs: List[int], block: int = BLOCK_SIZE) -> int:
    """Append the CRC32C of each ``block``-byte piece of ``data`` (the last may be shorter) to
    ``crcs``; return ``crc`` continued over ``data``, combined from the full pieces' CRCs so
    each of their bytes goes through the CRC instruction once (the last, shorter piece twice:
    cheaper than a shift by an arbitrary length). What a writer calls on the bytes it writes."""
    view = memoryview(data).cast("B")
    t0, t1, t2, t3 = shift_tables(block)
    for s in range(0, len(view), block):
        piece = view[s : s + block]
        c = crc32c(piece)
        crcs.append(c)
        if len(piece) == block:  # the running CRC shifted over the block (`shift`, inlined)
            crc = t0[crc & 255] ^ t1[(crc >> 8) & 255] ^ t2[(crc >> 16) & 255] ^ t3[crc >> 24] ^ c
        else:
            crc = crc32c(piece, crc)
    return crc
