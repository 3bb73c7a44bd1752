"""The hostile suite: generated damaged and crafted checkpoints run against every entry point.

A *case* is ``(base, file, mutator, seed)``: a tiny checkpoint of one backend (``torch_dist`` or
``zarr``, see :func:`base_state`), one of its files, one mutator (a byte-level damage or a
structure-aware lie in that file's format) and the seed that drives the mutator's choices. The same
four values rebuild the same case (``python -m tests.support.hostile_fuzz case ...``). For a metadata-like
file an odd seed also *reseals* the checkpoint afterwards: the manifest (and the torch_dist
sidecar index) are rewritten to agree with the damaged file, as a buggy writer or a hand edit
would leave them; mutators tagged ``+reseal`` in the tables are those.

Each case runs against every entry point (:data:`ENTRY_POINTS`: the API calls, among them the
loads through the ``torch_dcp`` reader (DCP's own engine), and the CLI commands, the CLI
in-process through its click entry point) and each run gets one outcome:

=============  =================================================================================
ok-exact       it succeeded and everything it returned (or wrote) equals the original
ok             it succeeded and returns nothing to compare (inspect, verify's "intact", ...)
skipped        the entry point does not apply to the base (the torch_dcp reader on zarr)
refused        CheckpointingException, or the CLI exited 1/2 with a message and no traceback
SILENT-WRONG   it succeeded but values differ from the original (verify: said intact while a
               load in the same case returned wrong values; convert/rm-prefix/rename: the
               result reads back wrong)
DISAGREE       ``verify`` broke the agreement with the loads: it said intact while a load of
               the same case refused, or it refused naming none of the files the load named
crash          any other exception, a traceback, a CLI exit code other than 0/1/2, a dead worker
hang           it ran past the per-call time limit
oom            MemoryError / allocation failure under the worker's address-space limit
escaped        a file outside the checkpoint (and outside the destination) was opened, read,
               written, created or deleted: inotify watches on the canaries' folders, plus
               listings, sizes and digests of the canaries before and after every call
=============  =================================================================================

The agreement (issue #45, docs/reliability.md): over every case, ``verify`` exit 0 implies that
every load (default, ``verify=True``, resharded, through the ``torch_dcp`` reader, the queries)
returns exactly the saved values, and a load that refuses implies ``verify`` exit 1 naming one of
the files the load's error names (:meth:`Worker._cross_check`).

Soft outcomes, reported but not failures by default: ``vague`` (refused without naming any file
of the checkpoint), ``meta-differs`` (``load_tensors_metadata`` reported other shapes/dtypes
without complaint).

Cases run in long-lived worker processes (``python -m tests.support.hostile_fuzz worker``; importing
torch per case would cost seconds) that execute case after case. Each call gets a time limit
(``setitimer``, and a watchdog in the parent that kills a stuck worker) and the worker an
address-space limit (``RLIMIT_AS`` = its size after start-up + ``mem_limit``); a worker that dies,
hangs or runs out of memory is replaced and the case goes on with the next entry point.

The parent side (:func:`run_cases`, :func:`summarize`) imports neither torch nor distckpt.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import dataclasses
import io
import json
import os
import pickle
import pickletools
import random
import re
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
import zlib
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("torch_dist", "zarr")
FAILURES = ("SILENT-WRONG", "DISAGREE", "crash", "hang", "oom", "escaped", "fuzzer-error")
SOFT = ("vague", "meta-differs")
CANARY = b"DISTCKPT-CANARY-"  # 16 bytes: the content of every canary file
CANARY_NAMES = ("secret.distcp", "secret.bin", "precious.txt")
HUGE = 1 << 40

# --------------------------------------------------------------------------- file classes


def file_kind(rel: str) -> str:
    """The byte class of a checkpoint file, by its path inside the checkpoint."""
    name = rel.rsplit("/", 1)[-1]
    if rel == "metadata.json":
        return "config"
    if rel == "common.pt":
        return "common"
    if rel == ".metadata":
        return "dcp-metadata"
    if name.endswith(".distcp"):
        return "dcp-data"
    if rel == ".distckpt_manifest.json":
        return "manifest"
    if rel == ".distckpt_index":
        return "sidecar"
    if rel == "zarr.json":
        return "zarr-group"
    if name == "zarr.json":
        return "zarr-array"
    if name.endswith(".pt"):
        return "object"
    if "/c/" in rel:
        return "zarr-chunk"
    return "other"


# Files whose damage a writer's own bookkeeping could hide: for these an odd seed reseals, after
# a mutator that edits the file's content (not one that replaces or moves files).
RESEALABLE = {"config", "dcp-metadata", "sidecar", "zarr-group", "zarr-array"}
NOT_RESEALED = {"delete", "as-dir", "fifo", "symlink-out", "symlink-dir-out", "file-swap", "none"}

# --------------------------------------------------------------------------- hostile values


def hostile_names(outside: Path) -> List[str]:
    """Names that leave the checkpoint (towards the canaries) or are otherwise malformed."""
    return [
        "../secret.distcp",
        "../../outside/secret.bin",
        str(outside / "secret.bin"),
        "..",
        ".",
        "",
        "a/../../secret.distcp",
        "..\\secret.distcp",
        "x\x00y",
        "/",
        "w",
        "common.pt",
        "sub/" * 300 + "x",
        "../precious.txt",
    ]


HOSTILE_NUMBERS: List[Any] = [HUGE, 1 << 63, (1 << 64) + 1, -1, -HUGE, 0, 1, 2.5, 1e308, True, 10**40]


def _leaves(doc: Any, path: Tuple[Any, ...] = ()) -> Iterable[Tuple[Tuple[Any, ...], Any]]:
    yield path, doc
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _leaves(v, path + (i,))


def _set(doc: Any, path: Tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return doc


def _get(doc: Any, path: Tuple[Any, ...]) -> Any:
    for p in path:
        doc = doc[p]
    return doc


DEEP = "\x00DEEP\x00"


def _dump_json(doc: Any) -> bytes:
    text = json.dumps(doc)
    # A placeholder string becomes 100,000 nested lists (json.dumps itself would recurse).
    return text.replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000).encode()


# --------------------------------------------------------------------------- mutation context


@dataclasses.dataclass
class Ctx:
    """What a mutator sees: the file to damage inside the case's checkpoint, and its rng."""

    ckpt: Path
    rel: str
    kind: str
    backend: str
    outside: Path
    rng: random.Random

    @property
    def path(self) -> Path:
        return self.ckpt / self.rel

    def read(self) -> bytes:
        return self.path.read_bytes()

    def write(self, data: bytes) -> None:
        self.path.write_bytes(data)


Mutator = Callable[[Ctx], str]


@dataclasses.dataclass(frozen=True)
class MutatorSpec:
    fn: Mutator
    kinds: frozenset
    klass: str  # the column of docs/reliability.md's table


MUTATORS: Dict[str, MutatorSpec] = {}
ALL_KINDS = frozenset(
    {
        "config",
        "common",
        "dcp-metadata",
        "dcp-data",
        "manifest",
        "sidecar",
        "zarr-group",
        "zarr-array",
        "zarr-chunk",
        "object",
    }
)
JSON_KINDS = frozenset({"config", "manifest", "zarr-group", "zarr-array", "sidecar"})
PICKLE_KINDS = frozenset({"dcp-metadata", "common", "object"})
ZIP_KINDS = frozenset({"common", "object", "dcp-data"})


def mutator(name: str, kinds: Iterable[str], klass: str) -> Callable[[Mutator], Mutator]:
    def register(fn: Mutator) -> Mutator:
        MUTATORS[name] = MutatorSpec(fn, frozenset(kinds), klass)
        return fn

    return register


# ---- bytes


@mutator("none", {"config"}, "none")
def _m_none(c: Ctx) -> str:
    return "pristine (the control case)"


@mutator("byte", ALL_KINDS, "bytes")
def _m_byte(c: Ctx) -> str:
    data = bytearray(c.read())
    if not data:
        c.write(b"\x80")
        return "empty file given one byte"
    spots = sorted(c.rng.randrange(len(data)) for _ in range(c.rng.randint(1, 4)))
    for i in spots:
        data[i] ^= c.rng.randint(1, 255)
    c.write(bytes(data))
    return f"bytes at {spots} replaced"


@mutator("bitflip", ALL_KINDS, "bytes")
def _m_bitflip(c: Ctx) -> str:
    data = bytearray(c.read())
    if not data:
        c.write(b"\x01")
        return "empty file given one byte"
    i, bit = c.rng.randrange(len(data)), c.rng.randrange(8)
    data[i] ^= 1 << bit
    c.write(bytes(data))
    return f"bit {bit} of byte {i} flipped"


@mutator("truncate", ALL_KINDS, "lengths")
def _m_truncate(c: Ctx) -> str:
    data = c.read()
    n = c.rng.choice([0, c.rng.randrange(max(len(data), 1)), max(len(data) - 1, 0)])
    c.write(data[:n])
    return f"truncated {len(data)} -> {n} bytes"


@mutator("extend", ALL_KINDS, "lengths")
def _m_extend(c: Ctx) -> str:
    n = c.rng.choice([1, 7, 64, 4096])
    tail = bytes(c.rng.randrange(256) for _ in range(n)) if c.rng.random() < 0.5 else CANARY * (n // 16 + 1)
    c.write(c.read() + tail[:n])
    return f"{n} bytes appended"


@mutator("zero-range", ALL_KINDS, "bytes")
def _m_zero(c: Ctx) -> str:
    data = bytearray(c.read())
    if not data:
        return "empty file left empty"
    start = c.rng.randrange(len(data))
    n = min(c.rng.choice([4, 16, 64, 512]), len(data) - start)
    data[start : start + n] = bytes(n)
    c.write(bytes(data))
    return f"bytes {start}..{start + n} zeroed"


@mutator("delete", ALL_KINDS, "files")
def _m_delete(c: Ctx) -> str:
    c.path.unlink()
    return "file deleted"


@mutator("as-dir", ALL_KINDS, "files")
def _m_dir(c: Ctx) -> str:
    c.path.unlink()
    c.path.mkdir()
    (c.path / "x").write_bytes(CANARY)
    return "file replaced by a directory"


@mutator("fifo", ALL_KINDS, "files")
def _m_fifo(c: Ctx) -> str:
    c.path.unlink()
    os.mkfifo(c.path)
    return "file replaced by a FIFO (an open for reading blocks)"


@mutator("symlink-out", ALL_KINDS, "symlinks")
def _m_symlink(c: Ctx) -> str:
    target = c.outside / ("link-" + c.rel.replace("/", "_"))
    shutil.move(str(c.path), str(target))
    if c.rng.random() < 0.5:
        os.symlink(target, c.path)
    else:
        os.symlink(os.path.relpath(target, c.path.parent), c.path)
    return f"file moved outside, replaced by a symlink to {target.name}"


@mutator(
    "symlink-dir-out",
    ALL_KINDS - {"config", "common", "dcp-metadata", "dcp-data", "manifest", "sidecar", "zarr-group"},
    "symlinks",
)
def _m_symlink_dir(c: Ctx) -> str:
    top = c.rel.split("/")[0]
    target = c.outside / ("linkdir-" + top)
    shutil.move(str(c.ckpt / top), str(target))
    os.symlink(target, c.ckpt / top)
    return f"folder {top!r} moved outside, replaced by a symlink"


@mutator("file-swap", ALL_KINDS, "swaps")
def _m_swap(c: Ctx) -> str:
    same = sorted(
        str(p.relative_to(c.ckpt))
        for p in c.ckpt.rglob("*")
        if p.is_file()
        and not p.is_symlink()
        and str(p.relative_to(c.ckpt)) != c.rel
        and file_kind(str(p.relative_to(c.ckpt))) == c.kind
    )
    if not same:
        same = sorted(
            str(p.relative_to(c.ckpt))
            for p in c.ckpt.rglob("*")
            if p.is_file() and str(p.relative_to(c.ckpt)) != c.rel
        )
    other = c.ckpt / c.rng.choice(same)
    a, b = c.read(), other.read_bytes()
    c.write(b)
    other.write_bytes(a)
    return f"content swapped with {other.relative_to(c.ckpt)}"


# ---- JSON (plain files, and the sidecar's directory with its CRC32C fixed)


def _json_edit(c: Ctx, edit: Callable[[Any], Tuple[Any, str]]) -> str:
    raw = c.read()
    if c.kind == "sidecar":
        from distckpt.formats.manifest import crc32c

        length = struct.unpack_from("<Q", raw, 8)[0]
        doc = json.loads(raw[20 : 20 + length])
        doc, what = edit(doc)
        body = _dump_json(doc)
        c.write(raw[:8] + struct.pack("<QI", len(body), crc32c(body)) + body + raw[20 + length :])
        return what + " (sidecar directory, CRC fixed)"
    doc, what = edit(json.loads(raw))
    c.write(_dump_json(doc))
    return what


def _pick(c: Ctx, doc: Any, want: Callable[[Any], bool]) -> Tuple[Any, ...]:
    paths = [p for p, v in _leaves(doc) if want(v) and p]
    if not paths:
        paths = [p for p, _ in _leaves(doc) if p] or [()]
    return c.rng.choice(paths)


@mutator("json-number", JSON_KINDS, "numbers")
def _m_json_number(c: Ctx) -> str:
    def edit(doc):
        path = _pick(c, doc, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
        value = c.rng.choice(HOSTILE_NUMBERS)
        return _set(doc, path, value), f"{list(path)} = {value!r}"

    return _json_edit(c, edit)


@mutator("json-name", JSON_KINDS, "names")
def _m_json_name(c: Ctx) -> str:
    def edit(doc):
        name = c.rng.choice(hostile_names(c.outside))
        keyed = [(p, k) for p, v in _leaves(doc) if isinstance(v, dict) for k in v]
        if keyed and c.rng.random() < 0.4:
            path, key = c.rng.choice(keyed)
            parent = _get(doc, path)
            parent[name] = parent.pop(key)
            return doc, f"key {list(path) + [key]} renamed to {name!r}"
        path = _pick(c, doc, lambda v: isinstance(v, str))
        return _set(doc, path, name), f"{list(path)} = {name!r}"

    return _json_edit(c, edit)


@mutator("json-type", JSON_KINDS, "structure")
def _m_json_type(c: Ctx) -> str:
    def edit(doc):
        path = c.rng.choice([p for p, _ in _leaves(doc)])
        old = _get(doc, path)
        choices = [{}, [], "x", None, 0, True, [old], {"x": old}, str(old)[:20]]
        value = c.rng.choice([v for v in choices if type(v) is not type(old)] or choices)
        return _set(doc, path, value), f"{list(path)}: {type(old).__name__} -> {json.dumps(value)[:40]}"

    return _json_edit(c, edit)


@mutator("json-deep", JSON_KINDS, "structure")
def _m_json_deep(c: Ctx) -> str:
    def edit(doc):
        path = c.rng.choice([p for p, _ in _leaves(doc)])
        return _set(doc, path, DEEP), f"{list(path)} = 100,000 nested lists"

    return _json_edit(c, edit)


@mutator("json-drop", JSON_KINDS, "structure")
def _m_json_drop(c: Ctx) -> str:
    def edit(doc):
        containers = [(p, v) for p, v in _leaves(doc) if isinstance(v, (dict, list)) and v]
        if not containers:
            return doc, "nothing to drop"
        path, v = c.rng.choice(containers)
        if isinstance(v, dict):
            key = c.rng.choice(list(v))
            del v[key]
            return doc, f"key {list(path) + [key]} dropped"
        i = c.rng.randrange(len(v))
        if c.rng.random() < 0.5:
            del v[i]
            return doc, f"element {list(path) + [i]} dropped"
        v.insert(i, v[i])
        return doc, f"element {list(path) + [i]} duplicated"

    return _json_edit(c, edit)


# ---- zarr metadata, field by field

ZARR_ARRAY_FIELDS: List[Tuple[Tuple[str, ...], List[Any]]] = [
    (
        ("shape",),
        [
            [HUGE],
            [HUGE, 8],
            [6, HUGE],
            [-1, 8],
            [0, 8],
            [6],
            [6, 8, 1],
            [],
            "6,8",
            [6.5, 8],
            [1 << 20, 1 << 20],
        ],
    ),
    (
        ("chunk_grid", "configuration", "chunk_shape"),
        [[0, 8], [HUGE, 8], [-1, 8], [1], [3, 8, 1], [1, 1], "3,8"],
    ),
    (("chunk_grid", "name"), ["rectilinear", "../x", None]),
    (("data_type",), ["int32", "float16", "bfloat16", "float64", "uint8", "bool", "complex64", "bogus", 7]),
    (
        ("attributes", "distckpt", "torch_dtype"),
        ["torch.int32", "torch.bfloat16", "os.system", "torch.float64"],
    ),
    (
        ("codecs",),
        [
            [],
            [{"name": "bytes", "configuration": {"endian": "big"}}],
            [{"name": "transpose", "configuration": {"order": [1, 0]}}, {"name": "bytes"}],
            [{"name": "bytes"}, {"name": "gzip", "configuration": {"level": 1}}],
            [{"name": "blosc"}],
            "bytes",
        ],
    ),
    (
        ("chunk_key_encoding",),
        [
            {"name": "v2", "configuration": {"separator": "."}},
            {"name": "default", "configuration": {"separator": "."}},
            {"name": "default", "configuration": {"separator": "/../"}},
        ],
    ),
    (("fill_value",), [float("nan"), "NaN", 1e40, None, "x"]),
    (("node_type",), ["group", "array2"]),
    (("zarr_format",), [2, 4, "3"]),
    (("attributes", "distckpt", "key"), ["b", "../x", "/abs", ""]),
    (("storage_transformers",), [[{"name": "x"}]]),
]


@mutator("zarr-field", {"zarr-array"}, "numbers")
def _m_zarr_field(c: Ctx) -> str:
    def edit(doc):
        if c.rng.random() < 0.15:  # a 2^40-chunk grid of one-element chunks
            doc["shape"], doc["chunk_grid"]["configuration"]["chunk_shape"] = [1 << 20, 1 << 20], [1, 1]
            return doc, "shape [2^20, 2^20] in chunks of [1, 1] (a 2^40-chunk grid)"
        path, values = c.rng.choice(ZARR_ARRAY_FIELDS)
        value = c.rng.choice(values)
        if path == ("data_type",) and isinstance(value, str) and c.rng.random() < 0.5:
            doc["attributes"]["distckpt"]["torch_dtype"] = f"torch.{value}"
        parent = doc
        for p in path[:-1]:
            parent = parent.setdefault(p, {})
        parent[path[-1]] = value
        return doc, f"{'.'.join(path)} = {json.dumps(value)[:60]}"

    return _json_edit(c, edit)


@mutator("zarr-keys", {"zarr-group"}, "names")
def _m_zarr_keys(c: Ctx) -> str:
    def edit(doc):
        meta = doc["attributes"]["distckpt"]
        keys = list(meta["keys"])
        choice = c.rng.randrange(5)
        if choice == 0:
            keys[c.rng.randrange(len(keys))] = c.rng.choice(hostile_names(c.outside))
        elif choice == 1:
            keys.append(c.rng.choice(keys))
        elif choice == 2:
            keys = [f"k{i}" for i in range(100_000)]
        elif choice == 3:
            keys = {k: k for k in keys}
        else:
            keys.append(c.rng.choice(hostile_names(c.outside)))
        meta["keys"] = keys
        return doc, f"keys = {json.dumps(keys)[:80]}"

    return _json_edit(c, edit)


# ---- pickles (.metadata; data.pkl inside common.pt and object files)


def _zip_entries(data: bytes) -> List[Tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def _zip_bytes(entries: Sequence[Tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name, body in entries:
            zf.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), body)
    return buf.getvalue()


def _pickle_edit(c: Ctx, edit: Callable[[bytes], Tuple[bytes, str]]) -> str:
    raw = c.read()
    if c.kind == "dcp-metadata":
        # Protocol 2 has no frames, so an edit may change lengths anywhere in the stream.
        out, what = edit(pickle.dumps(pickle.loads(raw), protocol=2))
        c.write(out)
        return what
    entries = _zip_entries(raw)
    i = next(i for i, (n, _) in enumerate(entries) if n.endswith("data.pkl"))
    out, what = edit(entries[i][1])
    entries[i] = (entries[i][0], out)
    c.write(_zip_bytes(entries))
    return what + " (data.pkl)"


_OPCODES = [
    b"R",
    b"b",
    b"c",
    b"\x93",
    b"i",
    b"o",
    b"0",
    b".",
    b"\x81",
    b"e",
    b"u",
    b"s",
    b"h",
    b"q",
    b"N",
    b"]",
    b"}",
    b"(",
    b"t",
    b"\x85",
    b"\x86",
    b"\x87",
    b"a",
]


@mutator("pickle-opcode", PICKLE_KINDS, "pickle")
def _m_pickle_opcode(c: Ctx) -> str:
    def edit(p: bytes):
        ops = [pos for _, _, pos in pickletools.genops(p)]
        pos = c.rng.choice(ops[1:] or ops)
        new = c.rng.choice(_OPCODES + [bytes([c.rng.randrange(256)])])
        return p[:pos] + new + p[pos + 1 :], f"opcode at {pos} -> {new!r}"

    return _pickle_edit(c, edit)


def _encode_int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if -(1 << 31) <= v < (1 << 31):
        return b"J" + struct.pack("<i", v)
    body = v.to_bytes((v.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(body)]) + body


@mutator("pickle-arg", PICKLE_KINDS, "pickle")
def _m_pickle_arg(c: Ctx) -> str:
    def edit(p: bytes):
        ops = [(op, arg, pos) for op, arg, pos in pickletools.genops(p)]
        ends = [pos for _, _, pos in ops[1:]] + [len(p)]
        cands = [
            (op, arg, pos, end)
            for (op, arg, pos), end in zip(ops, ends)
            if op.name
            in (
                "BININT",
                "BININT1",
                "BININT2",
                "LONG1",
                "BINUNICODE",
                "SHORT_BINUNICODE",
                "BINSTRING",
                "SHORT_BINSTRING",
                "BINFLOAT",
            )
        ]
        if not cands:
            return p, "no argument to change"
        op, arg, pos, end = c.rng.choice(cands)
        if isinstance(arg, str):
            new = c.rng.choice(hostile_names(c.outside)).encode("utf-8", "surrogatepass")
            enc = b"X" + struct.pack("<I", len(new)) + new
        elif isinstance(arg, float):
            new = c.rng.choice([float("nan"), float("inf"), -1.0, 1e300])
            enc = b"G" + struct.pack(">d", new)
        else:
            new = c.rng.choice([HUGE, -1, 0, 1 << 63, -HUGE, (arg or 0) + 1])
            enc = _encode_int(new)
        return p[:pos] + enc + p[end:], f"{op.name} {arg!r} at {pos} -> {new!r}"[:160]

    return _pickle_edit(c, edit)


@mutator("pickle-exec", PICKLE_KINDS, "pickle")
def _m_pickle_exec(c: Ctx) -> str:
    target = str(c.outside / "pwned")

    def edit(p: bytes):
        call = c.rng.choice([(b"posix", b"mkdir"), (b"builtins", b"exec"), (b"os", b"system")])
        arg = (
            target
            if call[1] == b"mkdir"
            else (f"open({target!r}, 'w')" if call[1] == b"exec" else f"touch {target}")
        )
        inject = (
            b"c" + call[0] + b"\n" + call[1] + b"\n(X" + struct.pack("<I", len(arg)) + arg.encode() + b"tR0"
        )
        return p[:2] + inject + p[2:], f"{call[0].decode()}.{call[1].decode()} call injected"

    return _pickle_edit(c, edit)


@mutator("pickle-deep", PICKLE_KINDS, "structure")
def _m_pickle_deep(c: Ctx) -> str:
    def edit(p: bytes):
        n = 100_000
        deep = b"]" * n + b"a" * (n - 1)
        if c.rng.random() < 0.5:
            return b"\x80\x02" + deep + b".", "the whole pickle: 100,000 nested lists"
        return b"\x80\x02}X\x04\x00\x00\x00deep" + deep + b"s.", "a dict holding 100,000 nested lists"

    return _pickle_edit(c, edit)


@mutator("pickle-long", PICKLE_KINDS, "lengths")
def _m_pickle_long(c: Ctx) -> str:
    def edit(p: bytes):
        op = c.rng.choice(
            [
                b"X" + struct.pack("<I", 0xFFFFFFF0),
                b"\x8e" + struct.pack("<Q", 1 << 50),
                b"\x8b" + struct.pack("<i", 0x7FFFFFF0),
                b"B" + struct.pack("<i", 0x7FFFFFF0),
            ]
        )
        return p[:2] + op + p[2:], f"an argument claiming huge length injected ({op[:1]!r})"

    return _pickle_edit(c, edit)


# ---- zip headers (common.pt, object files, the torch.save items inside .distcp files)

_ZIP_FIELDS = {
    b"PK\x03\x04": [
        ("method", 8, "H"),
        ("crc", 14, "I"),
        ("csize", 18, "I"),
        ("usize", 22, "I"),
        ("name_len", 26, "H"),
        ("extra_len", 28, "H"),
        ("flags", 6, "H"),
    ],
    b"PK\x01\x02": [
        ("method", 10, "H"),
        ("crc", 16, "I"),
        ("csize", 20, "I"),
        ("usize", 24, "I"),
        ("name_len", 28, "H"),
        ("extra_len", 30, "H"),
        ("local_offset", 42, "I"),
    ],
    b"PK\x05\x06": [
        ("entries_here", 8, "H"),
        ("entries", 10, "H"),
        ("cd_size", 12, "I"),
        ("cd_offset", 16, "I"),
    ],
    b"PK\x06\x06": [("entries", 32, "Q"), ("cd_size", 40, "Q"), ("cd_offset", 48, "Q")],
}


@mutator("zip-header", ZIP_KINDS, "zip")
def _m_zip_header(c: Ctx) -> str:
    data = bytearray(c.read())
    spots = [(m.start(), sig) for sig in _ZIP_FIELDS for m in re.finditer(re.escape(sig), bytes(data))]
    if not spots:
        return _m_byte(c)
    start, sig = c.rng.choice(spots)
    if sig in (b"PK\x03\x04", b"PK\x01\x02") and c.rng.random() < 0.3:  # the entry's name
        name_at = start + (30 if sig == b"PK\x03\x04" else 46)
        n = struct.unpack_from("<H", data, start + (26 if sig == b"PK\x03\x04" else 28))[0]
        new = c.rng.choice([b"../", b"/", b"..", b"a/../../"])[:n]
        data[name_at : name_at + len(new)] = new
        c.write(bytes(data))
        return f"name of the entry at {start} starts with {new!r}"
    name, off, fmt = c.rng.choice(_ZIP_FIELDS[sig])
    width = struct.calcsize("<" + fmt)
    top = (1 << (8 * width)) - 1
    value = c.rng.choice(
        {"method": [8, 12, 14, 99, 0xFFFF]}.get(name, [0, top, top - 1, 1, 1 << (8 * width - 1)])
    )
    if start + off + width > len(data):
        return _m_byte(c)
    struct.pack_into("<" + fmt, data, start + off, value)
    c.write(bytes(data))
    return f"{sig!r}@{start}.{name} = {value}"


BOMB_BYTES = 3 << 30


def _deflated_bomb(prefix: bytes, size: int, tail: bytes) -> Tuple[bytes, int, int]:
    """Raw deflate of ``prefix + size zero bytes + tail`` built without compressing ``size`` bytes:
    after a full flush every zero block compresses to the same bytes."""
    block = 1 << 24
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = comp.compress(prefix) + comp.flush(zlib.Z_FULL_FLUSH)
    zeros = comp.compress(bytes(block)) + comp.flush(zlib.Z_FULL_FLUSH)
    end = comp.compress(tail) + comp.flush()
    count = size // block
    crc = zlib.crc32(prefix)
    zero_block = bytes(block)
    for _ in range(count):
        crc = zlib.crc32(zero_block, crc)
    crc = zlib.crc32(tail, crc)
    return head + zeros * count + end, crc, len(prefix) + count * block + len(tail)


def _zip_with_raw(entries: Sequence[Tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip of ``(name, raw data, method, crc32, uncompressed size)`` entries, sizes below 4 GiB."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, body, method, crc, usize in entries:
        offset = out.tell()
        encoded = name.encode()
        out.write(
            struct.pack(
                "<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(body), usize, len(encoded), 0
            )
            + encoded
            + body
        )
        central.write(
            struct.pack(
                "<4sHHHHHHIIIHHHHHII",
                b"PK\x01\x02",
                20,
                20,
                0,
                method,
                0,
                0x21,
                crc,
                len(body),
                usize,
                len(encoded),
                0,
                0,
                0,
                0,
                0,
                offset,
            )
            + encoded
        )
    cd = central.getvalue()
    cd_offset = out.tell()
    out.write(
        cd + struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(entries), len(entries), len(cd), cd_offset, 0)
    )
    return out.getvalue()


@mutator("zip-bomb", {"common", "object"}, "zip")
def _m_zip_bomb(c: Ctx) -> str:
    entries = _zip_entries(c.read())
    name = next(n for n, _ in entries if n.endswith("data.pkl"))
    # {"iteration": 11, "bomb": <3 GiB str>}: the string is the last thing before SETITEMS and STOP.
    prefix = b"\x80\x02}(X\x09\x00\x00\x00iterationK\x0bX\x04\x00\x00\x00bombX" + struct.pack(
        "<I", BOMB_BYTES
    )
    raw, crc, usize = _deflated_bomb(prefix, BOMB_BYTES, b"u.")
    rest = [(n, b, 0, zlib.crc32(b), len(b)) for n, b in entries if n != name]
    c.write(_zip_with_raw([(name, raw, 8, crc, usize)] + rest))
    return f"data.pkl deflated: {len(raw)} bytes inflating to {usize}"


# ---- torch_dist .metadata, object by object


def _md_load(c: Ctx):
    return pickle.loads(c.read())


def _md_store(c: Ctx, md: Any) -> None:
    c.write(pickle.dumps(md))


def _tensor_keys(md: Any) -> List[str]:
    return sorted(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks"))


@mutator("md-record", {"dcp-metadata"}, "names")
def _m_md_record(c: Ctx) -> str:
    md = _md_load(c)
    index = c.rng.choice(sorted(md.storage_data, key=str))
    info = md.storage_data[index]
    field = c.rng.choice(["relative_path", "relative_path", "offset", "length"])
    value = (
        c.rng.choice(hostile_names(c.outside))
        if field == "relative_path"
        else c.rng.choice(HOSTILE_NUMBERS + [info.length + 1, max(info.length - 1, 0)])
    )
    md.storage_data[index] = dataclasses.replace(info, **{field: value})
    _md_store(c, md)
    return f"storage record {index.fqn}@{list(index.offset or ())}: {field} = {value!r}"[:200]


@mutator("md-chunk", {"dcp-metadata"}, "numbers")
def _m_md_chunk(c: Ctx) -> str:
    import torch

    md = _md_load(c)
    key = c.rng.choice(_tensor_keys(md))
    meta = md.state_dict_metadata[key]
    i = c.rng.randrange(len(meta.chunks))
    chunk = meta.chunks[i]
    field = c.rng.choice(["offsets", "sizes"])
    old = list(getattr(chunk, field))
    new = list(old)
    if c.rng.random() < 0.2:
        new = new + [1]
    else:
        new[c.rng.randrange(len(new))] = c.rng.choice([HUGE, -1, 0, 1, 3, old[0] + 1])
    meta.chunks[i] = dataclasses.replace(chunk, **{field: torch.Size(new)})
    _md_store(c, md)
    return f"{key} chunk {i}: {field} {old} -> {new}"


@mutator("md-size", {"dcp-metadata"}, "numbers")
def _m_md_size(c: Ctx) -> str:
    import torch

    md = _md_load(c)
    key = c.rng.choice(_tensor_keys(md))
    new = c.rng.choice([[HUGE], [HUGE, 8], [0, 8], [1 << 30, 1 << 30], [6, 8, 1], [], [6, 9], [3, 8]])
    try:
        md.state_dict_metadata[key].size = torch.Size(new)
    except (RuntimeError, ValueError):
        return f"{key}: size {new} not representable"
    _md_store(c, md)
    return f"{key}: global size -> {new}"


@mutator("md-dtype", {"dcp-metadata"}, "numbers")
def _m_md_dtype(c: Ctx) -> str:
    import torch

    md = _md_load(c)
    key = c.rng.choice(_tensor_keys(md))
    dtype = c.rng.choice([torch.int32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.bool])
    props = md.state_dict_metadata[key].properties
    md.state_dict_metadata[key].properties = dataclasses.replace(props, dtype=dtype)
    _md_store(c, md)
    return f"{key}: dtype -> {dtype}"


@mutator("md-key", {"dcp-metadata"}, "names")
def _m_md_key(c: Ctx) -> str:
    md = _md_load(c)
    old = c.rng.choice(sorted(md.state_dict_metadata))
    new = c.rng.choice(hostile_names(c.outside) + ["b", "opt.f", "../escaped/shard_0_2", "rng/../../x"])
    md.state_dict_metadata[new] = md.state_dict_metadata.pop(old)
    md.storage_data = {
        (dataclasses.replace(i, fqn=new) if i.fqn == old else i): v for i, v in md.storage_data.items()
    }
    _md_store(c, md)
    return f"key {old!r} renamed to {new!r}"


@mutator("md-swap", {"dcp-metadata"}, "swaps")
def _m_md_swap(c: Ctx) -> str:
    md = _md_load(c)
    items = sorted(md.storage_data, key=str)
    pairs = [
        (a, b)
        for a in items
        for b in items
        if str(a) < str(b) and md.storage_data[a].length == md.storage_data[b].length
    ]
    a, b = c.rng.choice(pairs or [(x, y) for x in items for y in items if str(x) < str(y)])
    md.storage_data[a], md.storage_data[b] = md.storage_data[b], md.storage_data[a]
    _md_store(c, md)
    return f"storage records of {a.fqn}@{list(a.offset or ())} and {b.fqn}@{list(b.offset or ())} swapped"


@mutator("md-many", {"dcp-metadata"}, "numbers")
def _m_md_many(c: Ctx) -> str:
    import torch

    md = _md_load(c)
    key = "w"
    meta = md.state_dict_metadata[key]
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[index]
    n = 20_000
    meta.size = torch.Size([n, 8])
    meta.chunks = [
        dataclasses.replace(meta.chunks[0], offsets=torch.Size([r, 0]), sizes=torch.Size([1, 8]))
        for r in range(n)
    ]
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn != key}
    for r in range(n):
        md.storage_data[dataclasses.replace(index, offset=torch.Size([r, 0]), index=None)] = info
    _md_store(c, md)
    return f"{key}: {n} chunks of [1, 8], every record the same bytes"


# ---- the manifest


@mutator("manifest-swap", {"manifest"}, "swaps")
def _m_manifest_swap(c: Ctx) -> str:
    doc = json.loads(c.read())
    ranges = [(f, i) for f, rs in doc["ranges"].items() for i in range(len(rs))]
    (fa, ia), (fb, ib) = c.rng.sample(ranges, 2)
    a, b = doc["ranges"][fa][ia], doc["ranges"][fb][ib]
    field = c.rng.choice([2, 3])  # the CRC32C or the key
    a[field], b[field] = b[field], a[field]
    c.write(json.dumps(doc).encode())
    return f"{'crc' if field == 2 else 'key'} of ranges {fa}#{ia} and {fb}#{ib} swapped"


# --------------------------------------------------------------------------- resealing


def reseal(ckpt: Path, touched: str) -> str:
    """Make the manifest (and the torch_dist sidecar) agree with the files as they are now."""
    from distckpt.formats.manifest import crc32c, read_manifest, write_manifest

    manifest = read_manifest(ckpt)
    if manifest is None:
        return "no manifest to reseal"
    if touched == ".metadata" and (ckpt / ".distckpt_index").is_file() and (ckpt / ".metadata").is_file():
        from distckpt.formats.index_write import index_from_metadata

        manifest.drop(".distckpt_index")
        try:
            md_bytes = (ckpt / ".metadata").read_bytes()
            index = index_from_metadata(pickle.loads(md_bytes), manifest.range_index(), len(md_bytes))
            (ckpt / ".distckpt_index").write_bytes(index)
        except Exception:  # noqa: BLE001 - a metadata the index cannot describe: drop the sidecar
            (ckpt / ".distckpt_index").unlink()
    for name in list(manifest.files):
        path = ckpt / name
        if path.is_symlink() or not path.is_file():
            manifest.drop(name)
            continue
        data = path.read_bytes()
        whole = manifest.ranges.get(name, [])
        if len(whole) == 1 and whole[0].offset == 0 and whole[0].length == manifest.files[name]:
            whole = [dataclasses.replace(whole[0], length=len(data))]
        manifest.files[name] = len(data)
        manifest.ranges[name] = [
            dataclasses.replace(r, crc32c=crc32c(data[r.offset : r.offset + r.length])) for r in whole
        ]
    if (ckpt / ".distckpt_index").is_file() and ".distckpt_index" not in manifest.files:
        manifest.set_bytes(".distckpt_index", (ckpt / ".distckpt_index").read_bytes())
    write_manifest(ckpt, manifest)
    return "manifest resealed"


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
    base: str
    file: str
    mutator: str
    seed: int

    @property
    def kind(self) -> str:
        return file_kind(self.file)

    @property
    def resealed(self) -> bool:
        return self.seed % 2 == 1 and self.kind in RESEALABLE and self.mutator not in NOT_RESEALED

    @property
    def label(self) -> str:
        return self.mutator + ("+reseal" if self.resealed else "")

    def command(self) -> str:
        return (
            f"python -m tests.support.hostile_fuzz case --base {self.base} --file {self.file} "
            f"--mutator {self.mutator} --seed {self.seed}"
        )


def generate(
    files: Dict[str, List[str]], count: int, seed: int = 0, mutators: Optional[Sequence[str]] = None
) -> List[Case]:
    """The two control cases (no mutation), then ``count - 2`` cases that take the mutators in
    turn (each as often as the others, however many files it applies to) and, for each mutator,
    the files it applies to in a seeded order; a short run still touches every mutator."""
    order = random.Random(f"order|{seed}")
    names = sorted(m for m in (mutators or MUTATORS) if m != "none")
    targets = {
        m: [(b, f) for b in BACKENDS for f in sorted(files[b]) if file_kind(f) in MUTATORS[m].kinds]
        for m in names
    }
    names = [m for m in names if targets[m]]
    order.shuffle(names)
    for m in names:
        order.shuffle(targets[m])
    control = [Case(b, "metadata.json", "none", seed * 1_000_000 + i) for i, b in enumerate(BACKENDS)]
    cases = []
    for i in range(max(count - len(control), 0)):
        m = names[i % len(names)]
        b, f = targets[m][(i // len(names)) % len(targets[m])]
        cases.append(Case(b, f, m, seed * 1_000_000 + len(control) + i))
    return control + cases


def apply(case: Case, ckpt: Path, outside: Path) -> str:
    """Damage ``ckpt`` (a fresh copy of the base) as ``case`` says; returns what was done."""
    rng = random.Random(f"{case.base}|{case.file}|{case.mutator}|{case.seed}")
    ctx = Ctx(ckpt, case.file, case.kind, case.base, outside, rng)
    what = MUTATORS[case.mutator].fn(ctx)
    if case.resealed:
        what += "; " + reseal(ckpt, case.file)
    return what


# --------------------------------------------------------------------------- the base checkpoints


def base_values():
    import torch

    w = torch.arange(48, dtype=torch.float32).reshape(6, 8) * 0.25 + 0.125 - 3
    b = ((torch.arange(20, dtype=torch.float32) - 7.5) / 7).to(torch.bfloat16).reshape(4, 5)
    f = torch.arange(24, dtype=torch.float32) * 0.5 + 100.25  # opt.f, [4, 6], held flat in two ranges
    return w, b, f


RNG_STATE = {"seed": 7}
COMMON = {"iteration": 11, "args": {"lr": 0.5, "name": "tiny"}}


def base_state(with_data: bool = True) -> dict:
    """The state every base holds: ``w`` [6, 8] float32 saved as two chunks, ``b`` bf16, ``opt.f``
    [4, 6] float32 saved as two flattened ranges, a ShardedObject ``rng`` and common state."""
    import torch

    from distckpt import ShardedObject, ShardedTensor

    w, b, f = base_values()
    if not with_data:
        w, b, f = torch.zeros_like(w), torch.zeros_like(b), torch.zeros_like(f)
    sd = {
        "w0": ShardedTensor.from_rank_offsets("w", w[:3].clone(), (0, 0, 2)),
        "w1": ShardedTensor.from_rank_offsets("w", w[3:].clone(), (0, 1, 2)),
        "b": ShardedTensor.from_rank_offsets("b", b.clone()),
        "f0": ShardedTensor.from_rank_offsets_flat(
            "opt.f", f[:10].clone(), (4, 6), flattened_range=slice(0, 10)
        ),
        "f1": ShardedTensor.from_rank_offsets_flat(
            "opt.f", f[10:].clone(), (4, 6), flattened_range=slice(10, 24)
        ),
        "rng": ShardedObject(
            "rng", ({**RNG_STATE, "state": torch.arange(5)} if with_data else None), (1,), (0,)
        ),
    }
    if with_data:
        sd.update(json.loads(json.dumps(COMMON)))
    return sd


def expected_load() -> dict:
    import torch

    w, b, f = base_values()
    return {
        "w0": w[:3],
        "w1": w[3:],
        "b": b,
        "f0": f[:10],
        "f1": f[10:],
        "rng": {**RNG_STATE, "state": torch.arange(5)},
        **COMMON,
    }


def reshard_request() -> dict:
    """Other pieces than were saved (a single process must still cover every tensor): ``w`` by
    columns, ``b`` by rows, ``opt.f`` in flat ranges [0, 5), [5, 18), [18, 24)."""
    import torch

    from distckpt import ShardedObject, ShardedTensor

    flat = {
        f"f{i}": ShardedTensor.from_rank_offsets_flat(
            "opt.f", torch.zeros(hi - lo), (4, 6), flattened_range=slice(lo, hi)
        )
        for i, (lo, hi) in enumerate([(0, 5), (5, 18), (18, 24)])
    }
    return {
        "w0": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 4), (1, 0, 2)),
        "w1": ShardedTensor.from_rank_offsets("w", torch.zeros(6, 4), (1, 1, 2)),
        "b0": ShardedTensor.from_rank_offsets("b", torch.zeros(2, 5, dtype=torch.bfloat16), (0, 0, 2)),
        "b1": ShardedTensor.from_rank_offsets("b", torch.zeros(2, 5, dtype=torch.bfloat16), (0, 1, 2)),
        **flat,
        "rng": ShardedObject("rng", None, (1,), (0,)),
    }


def expected_reshard() -> dict:
    import torch

    w, b, f = base_values()
    return {
        "w0": w[:, :4],
        "w1": w[:, 4:],
        "b0": b[:2],
        "b1": b[2:],
        "f0": f[:5],
        "f1": f[5:18],
        "f2": f[18:],
        "rng": {**RNG_STATE, "state": torch.arange(5)},
        **COMMON,
    }


def expected_plain(prefix_removed: bool = False, renamed: bool = False) -> dict:
    w, b, f = base_values()
    out = {"w2" if renamed else "w": w, "b": b}
    if not prefix_removed:
        out["opt.f"] = f.reshape(4, 6)
    return out


def build_bases(root: Path) -> Dict[str, List[str]]:
    """Save one base per backend under ``root`` (once); returns each base's files."""
    import distckpt

    files = {}
    for backend in BACKENDS:
        path = root / backend
        if not (path / "metadata.json").exists():
            shutil.rmtree(path, ignore_errors=True)
            distckpt.save(base_state(), path, sharded_strategy=(backend, 1))
        files[backend] = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())
    return files


# --------------------------------------------------------------------------- comparing


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of nested dicts/lists of tensors and plain values."""
    import torch

    if isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        )
    if isinstance(b, dict):
        return isinstance(a, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in b)
    if isinstance(b, (list, tuple)):
        return isinstance(a, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    import torch

    if isinstance(b, dict) and isinstance(a, dict):
        if set(a) != set(b):
            return f"{path or 'keys'}: {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in b:
            if not same(a[k], b[k]):
                return _first_difference(a[k], b[k], f"{path}.{k}" if path else str(k))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype == b.dtype and a.shape == b.shape:
            differ = int((a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)).sum())
            return f"{path}: {differ} of {a.numel() * a.element_size()} bytes differ"
        return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    return f"{path}: {str(a)[:60]} vs {str(b)[:60]}"


# --------------------------------------------------------------------------- escape detection

_IN = {
    "ACCESS": 0x1,
    "MODIFY": 0x2,
    "ATTRIB": 0x4,
    "CLOSE_WRITE": 0x8,
    "OPEN": 0x20,
    "MOVED_FROM": 0x40,
    "MOVED_TO": 0x80,
    "CREATE": 0x100,
    "DELETE": 0x200,
    "DELETE_SELF": 0x400,
    "MOVE_SELF": 0x800,
}
_IN_ISDIR = 0x40000000
_CHANGES = (
    _IN["MODIFY"]
    | _IN["ATTRIB"]
    | _IN["CLOSE_WRITE"]
    | _IN["MOVED_FROM"]
    | _IN["MOVED_TO"]
    | _IN["CREATE"]
    | _IN["DELETE"]
)


class Watch:
    """inotify watches on the folders around a case's checkpoint: which outside files were touched.

    Layout of a case (``root``)::

        outside/   canaries (``secret.bin``, ``secret.distcp``, ``precious.txt``) and the targets
                   of planted symlinks: nothing may touch anything here
        work/      ``ckpt`` (the damaged checkpoint), ``copy`` (a copy for in-place commands),
                   their ``.<name>.*`` siblings (staging, trash), and canaries beside them
        dst/       ``out``, a conversion's destination, and its siblings
    """

    def __init__(self, root: Path) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        self._libc = libc
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.root = root
        self.dirs: Dict[int, str] = {}
        mask = sum(_IN.values())
        for sub in ("", "outside", "work", "dst"):
            wd = libc.inotify_add_watch(self.fd, str(root / sub).encode(), mask)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {root / sub}")
            self.dirs[wd] = sub

    def add(self, path: Path, label: str) -> None:
        wd = self._libc.inotify_add_watch(self.fd, str(path).encode(), sum(_IN.values()))
        if wd >= 0:
            self.dirs[wd] = label

    def close(self) -> None:
        os.close(self.fd)

    def events(self) -> List[Tuple[str, str, int]]:
        out = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            i = 0
            while i < len(buf):
                wd, mask, _, n = struct.unpack_from("iIII", buf, i)
                name = buf[i + 16 : i + 16 + n].rstrip(b"\0").decode(errors="replace")
                i += 16 + n
                if wd in self.dirs:
                    out.append((self.dirs[wd], name, mask))

    def escapes(self) -> List[str]:
        """Events that mean a call reached outside the checkpoint and its destination."""
        bad = []
        for where, name, mask in self.events():
            kinds = "|".join(k for k, v in _IN.items() if mask & v)
            if where == "" and (mask & _CHANGES or name == "outside"):
                bad.append(f"{kinds} {name or '.'} beside work/")
            elif where.startswith("outside"):
                bad.append(f"{kinds} {where}/{name}")
            elif where == "work" and (
                name in CANARY_NAMES
                or (mask & (_IN["CREATE"] | _IN["MOVED_TO"]) and not _sibling(name, ("ckpt", "copy")))
            ):
                bad.append(f"{kinds} work/{name}")
            elif where == "dst" and mask & _CHANGES and not _sibling(name, ("out",)):
                bad.append(f"{kinds} dst/{name}")
        return bad


def _sibling(name: str, own: Sequence[str]) -> bool:
    return name in own or any(name.startswith(f".{o}.") for o in own)


def _snapshot(root: Path) -> Dict[str, Tuple[Any, ...]]:
    """Every entry outside the checkpoint folders with its type, inode, size and mtime (the
    inotify watches see reads; this sees what a missed event would hide)."""
    out = {}
    for sub in ("outside", "work", "dst", ""):
        base = root / sub
        for p in sorted(base.rglob("*") if sub == "outside" else base.iterdir()):
            rel = str(p.relative_to(root))
            if sub in ("work", "dst") and _sibling(p.name, ("ckpt", "copy", "out")):
                continue
            if sub == "" and p.name in ("outside", "work", "dst"):
                continue
            st = os.lstat(p)
            out[rel] = (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns)
    return out


# --------------------------------------------------------------------------- the worker


class _Timeout(BaseException):
    """Raised by the per-call alarm; a BaseException so that no ``except Exception`` swallows it."""


def _clone(src: Path, dst: Path) -> None:
    """Copy a (damaged) checkpoint keeping symlinks as links, FIFOs as FIFOs, and never reading
    through either."""
    os.mkdir(dst)
    for entry in os.scandir(src):
        target = dst / entry.name
        if entry.is_symlink():
            os.symlink(os.readlink(entry.path), target)
        elif entry.is_dir(follow_symlinks=False):
            _clone(Path(entry.path), target)
        elif entry.is_file(follow_symlinks=False):
            shutil.copyfile(entry.path, target, follow_symlinks=False)
        else:
            os.mkfifo(target)


LOADS = (
    "load",
    "load-reshard",
    "load-verify",
    "load-dcp",
    "load-dcp-verify",
    "load_common_state_dict",
    "load_plain_tensors",
)
ENTRY_POINTS = LOADS + (
    "load_tensors_metadata",
    "check_is_distributed_checkpoint",
    "remove_sharded_tensors",
    "cli-inspect",
    "cli-verify",
    "cli-verify-deep",
    "cli-diff",
    "cli-convert",
    "cli-rm-prefix",
    "cli-rename",
)
# What the torch_dcp reader (DCP's own engine) loads; it reads only torch_dist checkpoints.
DCP_READER = {"load-dcp": False, "load-dcp-verify": True}


class Worker:
    """Runs cases in this process; see the module docstring for the outcomes."""

    def __init__(self, scratch: Path, time_limit: float, plant: Optional[str] = None) -> None:
        import distckpt  # noqa: F401 - imported once, before the memory limit

        self.scratch = scratch
        self.time_limit = time_limit
        self.plant: Optional[str] = None
        self.bases = scratch / "bases"
        self.bases.mkdir(parents=True, exist_ok=True)
        self.files = build_bases(self.bases)
        self.case_root = scratch / "case"
        signal.signal(signal.SIGALRM, self._alarm)
        self._warm()
        self.plant = plant

    @staticmethod
    def _alarm(signum, frame) -> None:
        raise _Timeout()

    def _warm(self) -> None:
        """Run every entry point once on a pristine base, so that lazy imports happen before the
        memory limit and their first-call costs stay out of the time limit."""
        self.run(Case("torch_dist", "metadata.json", "none", 0), eps=ENTRY_POINTS)

    # -- layout

    def _fresh(self, case: Case) -> str:
        root = self.case_root
        if root.exists():
            for p in root.rglob("*"):  # a case may have left read-only or odd entries
                if p.is_dir() and not p.is_symlink():
                    os.chmod(p, 0o755)
            shutil.rmtree(root)
        for sub in ("outside", "work", "dst"):
            (root / sub).mkdir(parents=True)
        for folder in (root / "outside", root / "work"):
            for name in CANARY_NAMES:
                (folder / name).write_bytes(CANARY * 256)
        shutil.copytree(self.bases / case.base, root / "work" / "ckpt")
        return apply(case, root / "work" / "ckpt", root / "outside")

    # -- calls

    def run(
        self, case: Case, eps: Sequence[str], emit: Callable[[dict], None] = lambda m: None
    ) -> Dict[str, dict]:
        signal.setitimer(signal.ITIMER_REAL, 60)
        try:
            what = self._fresh(case)
        except _Timeout:
            raise RuntimeError("the mutation itself ran for over 60 s") from None
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        emit({"t": "mutated", "what": what})

        root = self.case_root
        watch = Watch(root)
        for p in (root / "outside").rglob("*"):
            if p.is_dir() and not p.is_symlink():
                watch.add(p, "outside/" + str(p.relative_to(root / "outside")))
        results: Dict[str, dict] = {}
        try:
            for ep in eps:
                emit({"t": "start", "ep": ep})
                results[ep] = self._one(case, ep, watch)
                emit({"t": "result", "ep": ep, **results[ep]})
                if results[ep]["outcome"] in ("hang", "oom"):
                    break
        finally:
            watch.close()
        self._cross_check(results)
        return results

    def _one(self, case: Case, ep: str, watch: Watch) -> dict:
        root = self.case_root
        for extra in ("work/copy", "dst/out"):
            if (root / extra).exists() or (root / extra).is_symlink():
                shutil.rmtree(root / extra, ignore_errors=True)
        if ep in ("remove_sharded_tensors", "cli-rm-prefix", "cli-rename"):
            _clone(root / "work" / "ckpt", root / "work" / "copy")
        before = _snapshot(root)
        watch.events()
        start = time.monotonic()
        signal.setitimer(signal.ITIMER_REAL, self.time_limit)
        self._text, self._code = "", None
        try:
            outcome, detail = self._call(case, ep)
        except _Timeout:
            outcome, detail = "hang", f"still running after {self.time_limit:g} s"
        except MemoryError as e:
            outcome, detail = "oom", f"MemoryError: {e}"[:300]
        except BaseException as e:  # noqa: BLE001 - classified, never let through
            outcome, detail = self._classify(e)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        seconds = time.monotonic() - start
        escapes = watch.escapes()
        after = _snapshot(root)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        if escapes or changed:
            outcome = "escaped"
            detail = "; ".join((escapes + [f"changed: {c}" for c in changed])[:6]) + f" [{detail}]"[:300]
        return {
            "outcome": outcome,
            "detail": detail[:600],
            "seconds": round(seconds, 3),
            "files": sorted(self._files_named(self._text or detail, case)),
            "exit": self._code,
        }

    def _files_named(self, text: str, case: Case) -> set:
        """The files of the case's checkpoint that ``text`` (an error, a command's output) names,
        by their paths inside it (full paths are cut to those)."""
        ckpt = str(self.case_root / "work" / "ckpt")
        text = text.replace(ckpt + "/", " ").replace(ckpt, " ")
        return {
            rel
            for rel in self.files[case.base]
            if re.search(r"(?<![\w./-])" + re.escape(rel) + r"(?![\w-]|\.\w)", text)
        }

    def _classify(self, e: BaseException) -> Tuple[str, str]:
        from distckpt.core import CheckpointingException

        text = f"{type(e).__name__}: {e}"
        self._text = text[:20_000]
        if isinstance(e, CheckpointingException):
            return ("refused" if self._names_a_file(str(e)) else "vague"), text[:400]
        if isinstance(e, RuntimeError) and re.search(r"alloc|out of memory", str(e), re.I):
            return "oom", text[:400]
        tb = traceback.extract_tb(e.__traceback__)
        where = next(
            (f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "distckpt" in f.filename), ""
        )
        return "crash", f"{text[:300]} @ {where}"

    def _names_a_file(self, message: str) -> bool:
        if str(self.case_root) in message:
            return True
        names = {Path(f).name for fs in self.files.values() for f in fs} | {".metadata", "metadata.json"}
        return any(n in message for n in names)

    def _cli(self, args: Sequence[str]) -> Tuple[int, str]:
        from distckpt.cli import main as cli_main

        buf = io.StringIO()
        code = 0
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            try:
                cli_main.main(args=list(args), prog_name="distckpt", standalone_mode=True)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        return code, buf.getvalue()

    def _cli_outcome(self, code: int, out: str) -> Optional[Tuple[str, str]]:
        """The outcome of a CLI run that did not succeed; None on exit 0."""
        tail = " | ".join(line.strip() for line in out.strip().splitlines()[-3:])[:400]
        if CANARY.decode() in out:
            return "escaped", "the canary's content is in the output: " + tail
        if "Traceback" in out or code not in (0, 1, 2):
            lines = out.splitlines()
            error = next(
                (line for line in reversed(lines) if re.match(r"\w+(Error|Exception|Interrupt)\b", line)),
                tail,
            )
            frame = next(
                (
                    f"{Path(m.group(1)).name}:{m.group(2)}"
                    for m in (
                        re.search(r'File "(.*?distckpt/.*?\.py)", line (\d+)', line)
                        for line in reversed(lines)
                    )
                    if m
                ),
                "",
            )
            return "crash", f"exit {code}: {error[:300]} @ {frame}"
        if code == 0:
            return None
        return ("refused" if self._names_a_file(out) else "vague"), f"exit {code}: {tail}"

    def _check_result(self, got: Any, want: Any, what: str) -> Tuple[str, str]:
        import torch

        if self.plant == "all":  # the planted bug: the originals the checker is given are wrong
            want = {
                k: (v + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                for k, v in want.items()
            }
        flat = {k: v for k, v in got.items()} if isinstance(got, dict) else got
        for v in flat.values() if isinstance(flat, dict) else []:
            if isinstance(v, torch.Tensor) and CANARY in v.contiguous().view(torch.uint8).numpy().tobytes():
                return "escaped", f"{what}: a loaded tensor holds the canary's bytes"
        if same(got, want):
            return "ok-exact", what
        return "SILENT-WRONG", f"{what}: {_first_difference(got, want)}"

    def _readback(self, path: Path, want: dict, what: str) -> Tuple[str, str]:
        """What a command that succeeded left at ``path``: the same content, or a refusal later
        (damage kept, and caught), or wrong values (silently wrong)."""
        import distckpt
        from distckpt.core import CheckpointingException

        try:
            got = distckpt.load_plain_tensors(path)
            common = distckpt.load_common_state_dict(path)
        except CheckpointingException as e:
            return "ok", f"{what}; reading the result refused: {str(e)[:200]}"
        outcome, detail = self._check_result(got, want, what)
        if outcome == "ok-exact" and not same(common, COMMON):
            return "SILENT-WRONG", f"{what}: common state {_first_difference(common, COMMON)}"
        return outcome, detail

    def _call(self, case: Case, ep: str) -> Tuple[str, str]:
        import distckpt

        root = self.case_root
        ckpt = root / "work" / "ckpt"
        copy = root / "work" / "copy"
        if self.plant == "all":
            self._planted(case, ep)
        if ep == "load":
            return self._check_result(distckpt.load(base_state(False), ckpt), expected_load(), "loaded")
        if ep == "load-reshard":
            return self._check_result(distckpt.load(reshard_request(), ckpt), expected_reshard(), "loaded")
        if ep == "load-verify":
            return self._check_result(
                distckpt.load(base_state(False), ckpt, verify=True), expected_load(), "loaded"
            )
        if ep in DCP_READER:
            if case.base != "torch_dist":
                return "skipped", "the torch_dcp reader reads torch_dist checkpoints only"
            from distckpt.strategies.torch_dcp import TorchDCPLoadShardedStrategy

            verify = True if DCP_READER[ep] else None  # (None: the default checks; False opts out)
            got = distckpt.load(
                base_state(False), ckpt, sharded_strategy=TorchDCPLoadShardedStrategy(), verify=verify
            )
            return self._check_result(got, expected_load(), "loaded")
        if ep == "load_common_state_dict":
            return self._check_result(distckpt.load_common_state_dict(ckpt), COMMON, "loaded")
        if ep == "load_plain_tensors":
            return self._check_result(distckpt.load_plain_tensors(ckpt), expected_plain(), "loaded")
        if ep == "load_tensors_metadata":
            got = {
                k: (tuple(v.global_shape), str(v.dtype))
                for k, v in distckpt.load_tensors_metadata(ckpt).items()
            }
            want = {k: (tuple(v.shape), str(v.dtype)) for k, v in expected_plain().items()}
            return ("ok-exact", "") if got == want else ("meta-differs", f"{got} vs {want}"[:300])
        if ep == "check_is_distributed_checkpoint":
            return "ok", f"returned {distckpt.check_is_distributed_checkpoint(ckpt)!r}"
        if ep == "remove_sharded_tensors":
            distckpt.remove_sharded_tensors(copy, "opt.")
            return self._readback(copy, expected_plain(prefix_removed=True), "removed")
        other = next(b for b in BACKENDS if b != case.base)
        args = {
            "cli-inspect": ["inspect", str(ckpt)],
            "cli-verify": ["verify", str(ckpt)],
            "cli-verify-deep": ["verify", "--deep", str(ckpt)],
            "cli-diff": ["diff", str(ckpt), str(self.bases / case.base)],
            "cli-convert": ["convert", str(ckpt), str(root / "dst" / "out"), "--to", other],
            "cli-rm-prefix": ["rm-prefix", str(copy), "opt."],
            "cli-rename": ["rename", str(copy), "--map", "w=w2"],
        }[ep]
        code, out = self._cli(args)
        self._text, self._code = out[:20_000], code
        failed = self._cli_outcome(code, out)
        if failed is not None:
            return failed
        if ep == "cli-convert":
            return self._readback(root / "dst" / "out", expected_plain(), "converted")
        if ep == "cli-rm-prefix":
            return self._readback(copy, expected_plain(prefix_removed=True), "removed")
        if ep == "cli-rename":
            return self._readback(copy, expected_plain(renamed=True), "renamed")
        if ep == "cli-diff":
            return "ok-exact", "no differences"
        return "ok", "exit 0"

    def _planted(self, case: Case, ep: str) -> None:
        """The planted failures of tests/untrusted/test_fuzz_hostile.py, one per entry point (on
        the zarr base, only a load's refusal that ``verify`` does not share)."""
        if case.base == "zarr":
            if ep == "load":
                from distckpt.core import CheckpointingException

                raise CheckpointingException(f"{self.case_root / 'work' / 'ckpt' / 'common.pt'}: planted")
            return
        if ep == "check_is_distributed_checkpoint":
            (self.case_root / "outside" / "secret.bin").read_bytes()
        elif ep == "load_common_state_dict":
            raise KeyError("planted")
        elif ep == "load_tensors_metadata":
            bytearray(8 << 30)
        elif ep == "cli-inspect":
            time.sleep(self.time_limit * 5)

    @staticmethod
    def _cross_check(results: Dict[str, dict]) -> None:
        """The agreement of ``verify`` and the loads (docs/reliability.md): ``verify`` saying
        intact is wrong when a load of the same case returned wrong values (SILENT-WRONG) or
        refused (DISAGREE), and a refusal of ``verify`` must name one of the files that a
        refusing load names (DISAGREE otherwise: the two blame different files)."""
        wrong = [ep for ep in LOADS if results.get(ep, {}).get("outcome") == "SILENT-WRONG"]
        refused = [ep for ep in LOADS if results.get(ep, {}).get("outcome") == "refused"]
        for ep in ("cli-verify", "cli-verify-deep"):
            r = results.get(ep)
            if r is None:
                continue
            if r["outcome"] == "ok" and wrong:
                r["outcome"], r["detail"] = "SILENT-WRONG", f"said intact; {wrong[0]} loaded wrong values"
            elif r["outcome"] == "ok" and refused:
                load = results[refused[0]]
                r["outcome"], r["detail"] = "DISAGREE", f"said intact; {refused[0]} {load['detail']}"[:600]
            elif r["outcome"] == "refused" and refused and r.get("exit") != 1:
                r["outcome"], r["detail"] = (
                    "DISAGREE",
                    f"exit {r.get('exit')} (an error, not a verdict); {refused[0]} refused"[:600],
                )
            elif r["outcome"] == "refused":
                named = set(r.get("files", ()))
                for load_ep in refused:
                    blamed = set(results[load_ep].get("files", ()))
                    if blamed and not blamed & named:
                        r["outcome"], r["detail"] = (
                            "DISAGREE",
                            f"names {sorted(named)}, {load_ep} names {sorted(blamed)}: "
                            f"{results[load_ep]['detail']}"[:600],
                        )
                        break


def _limit_memory(extra: int) -> None:
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, size + extra))


def worker_main(args: argparse.Namespace) -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    log = (
        os.open(args.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if args.log
        else os.open(os.devnull, os.O_WRONLY)
    )
    os.dup2(log, 1)
    os.dup2(log, 2)
    sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)

    def emit(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")

    try:
        worker = Worker(Path(args.scratch), args.time_limit, args.plant)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        emit({"t": "fatal", "error": "".join(traceback.format_exception(e))[-2000:]})
        return
    _limit_memory(args.mem_limit)
    emit({"t": "ready", "files": worker.files})
    for line in sys.stdin:
        msg = json.loads(line)
        case = Case(**msg["case"])
        try:
            results = worker.run(case, msg["eps"], emit=emit)
        except Exception as e:  # noqa: BLE001 - a bug of the fuzzer itself (a mutator), reported as such
            emit({"t": "done", "results": {}, "error": "".join(traceback.format_exception(e))[-1500:]})
            continue
        emit({"t": "done", "results": results})
        if any(r["outcome"] in ("hang", "oom") for r in results.values()):
            proto.flush()
            os._exit(0)  # a fresh process for the next case; never wait for a stuck thread


# --------------------------------------------------------------------------- the parent


class _Proc:
    """One worker process and its line protocol."""

    def __init__(
        self, scratch: Path, time_limit: float, mem_limit: int, plant: Optional[str], log: Path
    ) -> None:
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            DISTCKPT_HOST_MEMORY_BUDGET="256MiB",
            OMP_NUM_THREADS="1",
            PYTHONHASHSEED="0",
        )
        cmd = [
            sys.executable,
            "-m",
            "tests.support.hostile_fuzz",
            "worker",
            "--scratch",
            str(scratch),
            "--time-limit",
            str(time_limit),
            "--mem-limit",
            str(mem_limit),
            "--log",
            str(log),
        ]
        if plant:
            cmd += ["--plant", plant]
        self.p = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self.buf = ""

    def send(self, msg: dict) -> None:
        self.p.stdin.write(json.dumps(msg) + "\n")
        self.p.stdin.flush()

    def read(self, timeout: float) -> Optional[dict]:
        """The next message; None on timeout or EOF (the process died)."""
        deadline = time.monotonic() + timeout
        while "\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.p.stdout], [], [], left)
            if not ready:
                return None
            chunk = os.read(self.p.stdout.fileno(), 1 << 16).decode()
            if not chunk:
                return None
            self.buf += chunk
        line, self.buf = self.buf.split("\n", 1)
        return json.loads(line)

    def kill(self) -> Optional[int]:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        return self.p.returncode

    def alive(self) -> bool:
        return self.p.poll() is None


def _fast_tmp() -> Optional[str]:
    """tmpfs where there is one: cases create and delete hundreds of small files each."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None


def run_cases(
    count: int,
    *,
    seed: int = 0,
    time_limit: float = 5.0,
    mem_limit: int = 2 << 30,
    eps: Sequence[str] = ENTRY_POINTS,
    mutators: Optional[Sequence[str]] = None,
    plant: Optional[str] = None,
    scratch: Optional[Path] = None,
    cases: Optional[Sequence[Case]] = None,
    progress: Optional[Callable[[str], None]] = None,
) -> List[dict]:
    """Run ``count`` generated cases (or ``cases``) against ``eps``; one row per (case, entry point)."""
    own = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix="distckpt-fuzz-", dir=_fast_tmp())) if own else scratch
    scratch.mkdir(parents=True, exist_ok=True)
    log = scratch / "worker.log"
    rows: List[dict] = []
    proc: Optional[_Proc] = None
    files: Dict[str, List[str]] = {}

    def start() -> _Proc:
        nonlocal files
        p = _Proc(scratch, time_limit, mem_limit, plant, log)
        msg = p.read(300)
        if not msg or msg.get("t") != "ready":
            p.kill()
            raise RuntimeError(f"the fuzz worker did not start: {msg}; see {log}")
        files = msg["files"]
        return p

    try:
        proc = start()
        todo = list(cases) if cases is not None else generate(files, count, seed, mutators)
        for n, case in enumerate(todo):
            left = list(eps)
            what = ""
            while left:
                proc = proc or start()
                proc.send({"case": dataclasses.asdict(case), "eps": left})
                current = None
                while True:
                    msg = proc.read(time_limit + 30 if current else 300)
                    if msg is None:
                        alive = proc.alive()
                        code = proc.kill()
                        ep = current or left[0]
                        if alive:
                            outcome, detail = "hang", f"no answer within {time_limit + 30:g} s; worker killed"
                        elif code == -signal.SIGKILL:
                            outcome, detail = "oom", "worker killed by the system (out of memory)"
                        else:
                            outcome, detail = "crash", f"worker died (exit {code})"
                        rows.append(_row(case, ep, outcome, detail, what))
                        left = left[left.index(ep) + 1 :]
                        proc = None
                        break
                    if msg["t"] == "mutated":
                        what = msg["what"]
                    elif msg["t"] == "start":
                        current = msg["ep"]
                    elif msg["t"] == "result":
                        rows.append(
                            _row(case, msg["ep"], msg["outcome"], msg["detail"], what, msg["seconds"])
                        )
                        left.remove(msg["ep"])
                        current = None
                    elif msg["t"] == "done":
                        if "error" in msg:
                            rows.append(_row(case, "(mutation)", "fuzzer-error", msg["error"], what))
                            left = []
                        _apply_cross_check(rows, case, msg["results"])
                        if any(r["outcome"] in ("hang", "oom") for r in msg["results"].values()):
                            proc.kill()  # the worker leaves after a hang or an oom
                            proc = None
                        break
                    elif msg["t"] == "fatal":
                        raise RuntimeError(msg["error"])
            if progress and (n + 1) % 25 == 0:
                progress(f"{n + 1}/{len(todo)} cases")
    finally:
        if proc is not None:
            with contextlib.suppress(Exception):
                proc.p.stdin.close()
            proc.kill()
        if own:
            shutil.rmtree(scratch, ignore_errors=True)
    return rows


def _row(case: Case, ep: str, outcome: str, detail: str, what: str, seconds: float = 0.0) -> dict:
    return {
        "base": case.base,
        "file": case.file,
        "kind": case.kind,
        "mutator": case.label,
        "mutator_class": MUTATORS[case.mutator].klass,
        "seed": case.seed,
        "ep": ep,
        "outcome": outcome,
        "detail": detail,
        "mutation": what,
        "seconds": seconds,
        "command": case.command(),
    }


def _apply_cross_check(rows: List[dict], case: Case, results: Dict[str, dict]) -> None:
    """The worker revises verify's outcome once a case's loads are known."""
    for row in rows:
        if row["seed"] == case.seed and row["base"] == case.base and row["ep"] in results:
            row["outcome"] = results[row["ep"]]["outcome"]
            row["detail"] = results[row["ep"]]["detail"]


# --------------------------------------------------------------------------- reports


def signature(row: dict) -> str:
    """An outcome's kind for de-duplication: the entry point, outcome and error with numbers and
    paths blanked."""
    text = re.sub(r"/[^\s'\":]*", "<path>", row["detail"])
    text = re.sub(r"\d+", "N", text)
    return f"{row['ep']} | {row['outcome']} | {text[:110]}"


def summarize(rows: List[dict], failures: Sequence[str] = FAILURES, limit: int = 40) -> str:
    lines = []
    total = Counter(r["outcome"] for r in rows)
    cases = len({(r["base"], r["seed"]) for r in rows})
    lines.append(
        f"{cases} cases x entry points = {len(rows)} runs: "
        + ", ".join(f"{k} {v}" for k, v in total.most_common())
    )
    outcomes = [o for o in ("ok-exact", "ok", "skipped", "refused") + SOFT + FAILURES if total[o]]
    lines.append("")
    lines.append("| entry point | " + " | ".join(outcomes) + " |")
    lines.append("|---|" + "---|" * len(outcomes))
    for ep in dict.fromkeys(r["ep"] for r in rows):
        c = Counter(r["outcome"] for r in rows if r["ep"] == ep)
        lines.append(f"| {ep} | " + " | ".join(str(c[o] or "") for o in outcomes) + " |")
    bad = [r for r in rows if r["outcome"] in failures]
    if bad:
        lines.append("")
        lines.append("Failures by (backend, file, mutator, entry point):")
        lines.append("")
        lines.append("| backend | file | mutator | entry point | outcomes |")
        lines.append("|---|---|---|---|---|")
        groups = Counter((r["base"], r["file"], r["mutator"], r["ep"], r["outcome"]) for r in bad)
        merged: Dict[Tuple[str, str, str, str], List[str]] = {}
        for (b, f, m, ep, o), n in sorted(groups.items()):
            merged.setdefault((b, f, m, ep), []).append(f"{o} {n}")
        for (b, f, m, ep), outs in list(merged.items())[: limit * 3]:
            lines.append(f"| {b} | {f} | {m} | {ep} | {', '.join(outs)} |")
        lines.append("")
        lines.append("First reproducer of each distinct failure:")
        lines.append("")
        seen = {}
        for r in bad:
            seen.setdefault(signature(r), r)
        for r in list(seen.values())[:limit]:
            lines.append(
                f"- **{r['ep']} {r['outcome']}** ({r['base']} {r['file']}, {r['mutator']}: {r['mutation']})"
            )
            lines.append(f"  `{r['command']}`")
            lines.append(f"  -> {r['detail'][:300]}")
        if len(seen) > limit:
            lines.append(f"- ... and {len(seen) - limit} more distinct failures")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def _case_main(args: argparse.Namespace) -> None:
    """Rebuild one case, run it in this process, print the outcomes; keep the damaged checkpoint."""
    scratch = Path(args.keep or tempfile.mkdtemp(prefix="distckpt-case-", dir=_fast_tmp()))
    worker = Worker(scratch, args.time_limit)
    case = Case(args.base, args.file, args.mutator, args.seed)
    eps = args.eps.split(",") if args.eps else ENTRY_POINTS
    results = worker.run(
        case, eps, emit=lambda m: print("mutation:", m["what"]) if m["t"] == "mutated" else None
    )
    for ep, r in results.items():
        print(f"{ep:34} {r['outcome']:13} {r['detail'][:200]}")
    print(f"the damaged checkpoint: {worker.case_root / 'work' / 'ckpt'}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.support.hostile_fuzz", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run generated cases in worker processes and print the tables")
    run.add_argument("--cases", type=int, default=2000)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--time-limit", type=float, default=5.0)
    run.add_argument("--mem-limit", type=int, default=2 << 30)
    run.add_argument("--eps", help="comma-separated entry points (default: all)")
    run.add_argument("--mutators", help="comma-separated mutators (default: all)")
    run.add_argument("--json", help="also write every row to this file")
    run.add_argument("--report", help="write the tables (markdown) to this file")
    case = sub.add_parser("case", help="rebuild one case and run it in this process")
    case.add_argument("--base", required=True, choices=BACKENDS)
    case.add_argument("--file", required=True)
    case.add_argument("--mutator", required=True, choices=sorted(MUTATORS))
    case.add_argument("--seed", type=int, required=True)
    case.add_argument("--eps")
    case.add_argument("--time-limit", type=float, default=5.0)
    case.add_argument("--keep", help="scratch folder to keep (default: a new temporary one)")
    worker = sub.add_parser("worker", help="(internal) the case-running process")
    worker.add_argument("--scratch", required=True)
    worker.add_argument("--time-limit", type=float, required=True)
    worker.add_argument("--mem-limit", type=int, required=True)
    worker.add_argument("--plant")
    worker.add_argument("--log")
    args = parser.parse_args(argv)
    if args.command == "worker":
        worker_main(args)
    elif args.command == "case":
        _case_main(args)
    else:
        t0 = time.monotonic()
        rows = run_cases(
            args.cases,
            seed=args.seed,
            time_limit=args.time_limit,
            mem_limit=args.mem_limit,
            eps=args.eps.split(",") if args.eps else ENTRY_POINTS,
            mutators=args.mutators.split(",") if args.mutators else None,
            progress=lambda s: print(s, file=sys.stderr, flush=True),
        )
        text = summarize(rows) + f"\n\n({time.monotonic() - t0:.0f} s)"
        print(text)
        if args.report:
            Path(args.report).write_text(text + "\n")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
