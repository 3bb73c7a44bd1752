"""The ``zarr`` strategy: one Zarr v3 array per ShardedTensor key, written by its owners without locks.

On disk (docs/formats-zarr.md has the full description and the trade-offs)::

    ckpt/zarr.json               root group; attributes.distckpt lists the tensor keys
    ckpt/<key>/zarr.json         the array of global tensor <key>: shape, data type, chunk grid
    ckpt/<key>/c/<i>/<j>...      one chunk: raw little-endian C-order bytes (no compression)
    ckpt/<unique_key>.pt         ShardedObjects, written by the common strategy
    ckpt/common.pt, metadata.json

Format versions: 2 is the layout above; 1 is Megatron-Core's legacy Zarr v2 layout
(``<key>/.zarray``, chunk files ``<key>/0.1``). The load strategy reads both, key by key; the
save strategy always writes version 2 (a request for ``("zarr", 1)`` gets it too).

Chunk grid: the gcd, per axis, of every cut point of every main replica's piece. Each chunk then
lies inside exactly one piece, so every chunk file has exactly one writer and needs no lock.
Flattened ranges are stored in the tensor's original shape: a flat range is cut into row-major
boxes (:func:`flat_range_boxes`) and the boxes' edges are cut points too. Where that makes chunks
smaller than ``min_flat_chunk_bytes`` the grid is coarsened inside each shard (never across
one); a chunk that then spans several writers' ranges is assembled and written by one rank
(rank 0, from the pieces gathered in the final collective), so still no two writers meet.

Save (every rank): describe local pieces -> one all-gather of per-key cut-point gcds -> each
array's ``zarr.json`` written by one rank (keys round-robin) -> every rank writes its whole
chunks (CRC32C of each file, and of each 256 KiB block of a large one, computed on the way)
-> gather the shared-chunk pieces and the
checksums to rank 0, which writes those chunks and the integrity manifest; any failure raises on
every rank. ``metadata.json`` is left to the caller (serialization commits). ``async_save``
stages the bytes and runs the chunk writes in the background, the gather at finalization.

Load (every rank, no collective): each requested piece is cut into boxes and intersected with the
chunk grid; only overlapping chunks are read, and of those only the overlapping byte ranges
(by default every byte copied is checked: whole chunks against the manifest's CRC32C, parts of
large chunks against the block CRC32Cs the manifest keeps for them; with ``verify``: whole
chunks).

I/O: the raw engine writes and reads chunk files with ``os.write``/``os.preadv`` straight from and
into tensor memory (no copies) on a thread pool. Arrays it cannot handle (compressed, sharded,
big-endian, F-order, other writers' codecs) go through tensorstore (``tensorstore_io``),
which can also be chosen for everything with ``io_engine="tensorstore"``.

Modules, each importing only those above it: ``meta`` (data types, ``zarr.json`` parsed, checked
and built), ``layout`` (the checkpoint's tree: reading and writing array metadata and the root
group), ``jobs`` (what the engines are given), ``plan`` (chunk grid, save and load planning),
``rawio`` and ``tensorstore_io`` (the engines), ``engines`` (which one runs where), ``save``,
``load``, ``writer`` (whole tensors, for tools) and ``zarr_python`` (zarr-python interop). This
``__init__`` re-exports the names that used to live in the single ``zarr.py``; the strategies are
registered by :mod:`distckpt.strategies.builtin`.
"""

from __future__ import annotations

from distckpt.strategies.zarr.engines import IO_ENGINES, Engines
from distckpt.strategies.zarr.jobs import BlockLookup, ChunkRead, ChunkWrite
from distckpt.strategies.zarr.layout import (
    FileRecord,
    Root,
    array_meta_at,
    block_entries,
    check_key_path,
    check_key_paths,
    chunk_checksums,
    create_array,
    list_array_keys,
    open_root,
    read_array_meta,
    root_keys,
    scan_keys,
    write_root_group,
)
from distckpt.strategies.zarr.load import ZarrLoadShardedStrategy
from distckpt.strategies.zarr.meta import (
    ARRAY_META,
    BACKEND,
    FORMAT_VERSION,
    LEGACY_ARRAY_META,
    LEGACY_VERSION,
    ArrayMeta,
    Shape,
    array_metadata_json,
    manifest_disagreement,
    meta_file,
    zarr_data_type,
)
from distckpt.strategies.zarr.plan import DEFAULT_MIN_FLAT_CHUNK_BYTES, choose_chunk_shape, plan_reads
from distckpt.strategies.zarr.rawio import OBJECT_STORE_REQUESTS, RawIO
from distckpt.strategies.zarr.save import ZarrSaveShardedStrategy
from distckpt.strategies.zarr.writer import ZarrTensorWriter
from distckpt.strategies.zarr.zarr_python import register_zarr_python_dtypes

# Old private names of the single-module ``zarr.py``, kept for callers outside the package (public
# now: ``layout.check_key_paths``, ``layout.root_keys``).
_check_key_paths = check_key_paths
_root_keys = root_keys

__all__ = [
    "ARRAY_META",
    "ArrayMeta",
    "BACKEND",
    "BlockLookup",
    "ChunkRead",
    "ChunkWrite",
    "DEFAULT_MIN_FLAT_CHUNK_BYTES",
    "Engines",
    "FORMAT_VERSION",
    "FileRecord",
    "IO_ENGINES",
    "LEGACY_ARRAY_META",
    "LEGACY_VERSION",
    "OBJECT_STORE_REQUESTS",
    "RawIO",
    "Root",
    "Shape",
    "ZarrLoadShardedStrategy",
    "ZarrSaveShardedStrategy",
    "ZarrTensorWriter",
    "array_meta_at",
    "array_metadata_json",
    "block_entries",
    "check_key_path",
    "check_key_paths",
    "choose_chunk_shape",
    "chunk_checksums",
    "create_array",
    "list_array_keys",
    "manifest_disagreement",
    "meta_file",
    "open_root",
    "plan_reads",
    "read_array_meta",
    "register_zarr_python_dtypes",
    "root_keys",
    "scan_keys",
    "write_root_group",
    "zarr_data_type",
]
