"""Checkpoint surgery that never leaves a half-edited checkpoint: drop keys, rename keys.

Removing (:func:`remove_prefix`) is the library's :func:`distckpt.remove_sharded_tensors`
(crash-safe in place), or the same on a copy written under a temporary name and renamed into
place (``out=``).

Renaming (:func:`rename_keys`) changes only indexes, never tensor bytes:

- ``torch_dist``: ``.metadata`` (``state_dict_metadata`` keys, ``MetadataIndex.fqn`` of every
  storage record, ``mcore_data`` keys, and Megatron's ``all_local_plans``/``planner_data``
  where present) and the manifest (range keys, and the checksum of the new ``.metadata``);
- ``zarr``: the array folders (and ShardedObject files) move to their new names; the renamed
  arrays' ``zarr.json``, the root group's key list and the manifest's paths follow.

In place, the renamed checkpoint is assembled beside the original as a tree of hard links
(new files only for the rewritten indexes) and the two directories are exchanged in one
``renameat2(RENAME_EXCHANGE)``: a reader sees the old checkpoint or the new one, never a mix.
Where hard links or the exchange are unavailable, ``torch_dist`` falls back to replacing the
manifest and then ``.metadata``, each atomically (a crash between the two leaves the old
``.metadata`` with a manifest already describing the new one: a load and ``verify`` report the
mismatch, naming both files, and running the same rename again finishes it); ``zarr`` falls
back to a full copy beside, then two renames. With ``out=`` the
renamed checkpoint is written as a copy under a temporary name and renamed into place.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from distckpt import bounds, commit, containment, storage
from distckpt.commit import exchange_directories
from distckpt.commit_store import flatten
from distckpt.core import (
    CONFIG_FNAME,
    CheckpointingException,
    PathLike,
    atomic_write_bytes,
    fsync_dir,
    maybe_load_config,
    parse_config,
    write_file_durably,
)
from distckpt.dcp_native import is_dcp_native
from distckpt.formats.index_format import INDEX_FNAME
from distckpt.formats.index_write import index_from_metadata
from distckpt.formats.manifest import MANIFEST_FNAME, Manifest, RangeChecksum, check_whole_file, read_manifest
from distckpt.serialization import load_sharded_metadata, remove_sharded_tensors
from distckpt.strategies.torch_dist.metadata import METADATA_FNAME, read_metadata
from distckpt.strategies.torch_dist.stored import checked_metadata
from distckpt.strategies.zarr import layout as zarr_layout
from distckpt.strategies.zarr.meta import ARRAY_META, manifest_disagreement
from distckpt.tools.sources.base import NoProgress, Progress, did_you_mean
from distckpt.tools.sources.checkpoint import CheckpointSource

_SHARD_SEP = "/shard_"


# --------------------------------------------------------------------------- remove


def remove_prefix(
    checkpoint: storage.Location,
    prefix: str,
    out: Optional[PathLike] = None,
    progress: Optional[Progress] = None,
) -> List[str]:
    """Remove every tensor (and, where the backend stores them with the tensors, every object)
    whose key starts with ``prefix``; in place, or into a new checkpoint ``out``.

    Returns the removed keys.

    Raises:
        CheckpointingException: no key starts with ``prefix``, the backend cannot remove keys,
            or ``out`` exists.
    """
    root = _committed(checkpoint)
    before = set(load_sharded_metadata(root))
    if not any(k.startswith(prefix) for k in before):
        raise CheckpointingException(f"{root}: no key starts with {prefix!r}{did_you_mean(prefix, before)}")
    _local_output_only(root, out)
    if out is None:
        _edit_in_place(root)
        remove_sharded_tensors(root, prefix)
        target = root
    else:
        target = Path(out)
        _check_new_output(target)
        tmp = _temp_beside(target, "partial")
        try:
            _materialize(root, tmp, lambda rel: rel, {}, link=False, progress=progress)
            remove_sharded_tensors(tmp, prefix)
            _install(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    after = set(load_sharded_metadata(target))
    return sorted(before - after)


# --------------------------------------------------------------------------- rename: planning


@dataclass
class RenamePlan:
    """Old -> new names of the tensors and objects a rename changes (unchanged keys left out)."""

    tensors: Dict[str, str] = field(default_factory=dict)
    objects: Dict[str, str] = field(default_factory=dict)  # unique keys

    def __bool__(self) -> bool:
        return bool(self.tensors or self.objects)

    def name(self, key: str) -> str:
        return self.tensors.get(key) or self.objects.get(key) or key


def parse_pairs(pairs: Sequence[str], what: str, split_last: bool = False) -> List[Tuple[str, str]]:
    """``["OLD=NEW", ...]`` -> pairs; ``--map`` splits at the first ``=``, ``--regex`` at the last
    (a pattern may hold ``(?=...)``)."""
    out = []
    for p in pairs:
        if "=" not in p:
            raise CheckpointingException(f"{what} {p!r}: expected OLD=NEW")
        old, _, new = p.rpartition("=") if split_last else p.partition("=")
        if not old:
            raise CheckpointingException(f"{what} {p!r}: the left side is empty")
        out.append((old, new))
    return out


def plan_renames(
    tensor_keys: Sequence[str],
    object_keys: Sequence[str],
    mapping: Sequence[Tuple[str, str]] = (),
    regexes: Sequence[Tuple[str, str]] = (),
) -> RenamePlan:
    """Apply ``mapping`` (exact key -> new key) and then ``regexes`` (``re.sub`` in order) to every
    tensor key and to the key part of every object's unique key (``rng_state`` of
    ``rng_state/shard_0_2``).

    Raises:
        CheckpointingException: a ``mapping`` key does not exist, a regex is invalid, nothing
            changes, a new name is empty, or two keys would end up with the same name.
    """
    bases = {uk: uk.rpartition(_SHARD_SEP)[0] or uk for uk in object_keys}
    known = set(tensor_keys) | set(bases.values())
    exact = dict(mapping)
    for old in exact:
        if old not in known:
            raise CheckpointingException(f"--map: no key {old!r} in the checkpoint{did_you_mean(old, known)}")
    try:
        compiled = [(re.compile(p), r) for p, r in regexes]
    except re.error as e:
        raise CheckpointingException(f"--regex: invalid pattern: {e}") from None

    def rename(key: str) -> str:
        key = exact.get(key, key)
        for pattern, repl in compiled:
            try:
                key = pattern.sub(repl, key)
            except (re.error, IndexError) as e:
                raise CheckpointingException(f"--regex {pattern.pattern!r}={repl!r}: {e}") from None
        return key

    plan = RenamePlan()
    for key, new in [(k, rename(k)) for k in tensor_keys] + [(b, rename(b)) for b in bases.values()]:
        if not new:
            raise CheckpointingException(f"key {key!r} would be renamed to an empty name")
    for key in tensor_keys:
        new = rename(key)
        if new != key:
            plan.tensors[key] = new
    for uk, base in bases.items():
        new = rename(base)
        if new != base:
            plan.objects[uk] = new + uk[len(base) :]
    if not plan:
        raise CheckpointingException(
            "the rename changes no key (check --map/--regex against `distckpt inspect`)"
        )
    names: Dict[str, str] = {}
    for old in list(tensor_keys) + list(object_keys):
        new = plan.name(old)
        if new in names:
            raise CheckpointingException(f"keys {names[new]!r} and {old!r} would both be named {new!r}")
        names[new] = old
    return plan


# --------------------------------------------------------------------------- rename: execution


def rename_keys(
    checkpoint: storage.Location,
    mapping: Sequence[Tuple[str, str]] = (),
    regexes: Sequence[Tuple[str, str]] = (),
    out: Optional[PathLike] = None,
    *,
    trusted: bool = False,
    dry_run: bool = False,
    progress: Optional[Progress] = None,
) -> RenamePlan:
    """Rename tensor and object keys of a ``torch_dist`` or ``zarr`` checkpoint (see the module
    docstring); in place or into a new checkpoint ``out``. Returns the plan (applied unless
    ``dry_run``).

    Raises:
        CheckpointingException: see :func:`plan_renames`; an unsupported backend; ``out`` exists.
    """
    root = _committed(checkpoint)
    src = CheckpointSource(root, trusted)
    md, refusal = None, None
    if src.format == "torch_dist":
        # Checked before planning: the keys a damaged .metadata claims are not planned with.
        try:
            md = checked_metadata(root, trusted)
        except CheckpointingException as e:
            # Damage, or a rename interrupted after its manifest was written, whose .metadata
            # this run turns into the one that manifest describes: the result decides.
            md, refusal = read_metadata(root, trusted), e
    try:
        plan = plan_renames(list(src.tensors()), list(src.objects()), mapping, regexes)
    except CheckpointingException:
        if refusal is not None:
            raise refusal from None
        raise
    if dry_run:
        return plan
    _local_output_only(root, out)
    if out is not None:
        _check_new_output(Path(out))
    else:
        _edit_in_place(root)
    if md is not None:
        _rename_torch_dist(root, md, plan, out, progress, refusal)
    elif src.format == "zarr":
        _rename_zarr(root, plan, out, progress)
    else:
        raise CheckpointingException(f"{root}: renaming keys of a {src.format!r} checkpoint is not supported")
    return plan


def _rename_torch_dist(
    root: Union[Path, storage.Store],
    md: Any,
    plan: RenamePlan,
    out: Optional[PathLike],
    progress: Optional[Progress],
    refusal: Optional[CheckpointingException] = None,
) -> None:
    """Rename in ``md``, the checkpoint's ``.metadata`` as :func:`checked_metadata` returned it,
    or, with the ``refusal`` that function raised, as read: then the rename goes on only if it
    finishes an interrupted one (its result is the ``.metadata`` the manifest already lists)."""
    name = plan.name
    md.state_dict_metadata = {name(k): v for k, v in md.state_dict_metadata.items()}
    md.storage_data = {replace(i, fqn=name(i.fqn)): info for i, info in md.storage_data.items()}
    mcore = getattr(md, "mcore_data", None)
    if isinstance(mcore, dict):
        md.mcore_data = {name(k): v for k, v in mcore.items()}
    if isinstance(md.planner_data, dict):
        md.planner_data = {name(k): _renamed_path(v, k, name(k)) for k, v in md.planner_data.items()}
    plans = getattr(md, "all_local_plans", None)
    if isinstance(plans, list):
        md.all_local_plans = [_renamed_save_plan(p, name) for p in plans]
    md_bytes = pickle.dumps(md)
    manifest = read_manifest(root)
    if refusal is not None:
        try:
            if manifest is None:
                raise refusal
            check_whole_file(root, METADATA_FNAME, md_bytes)
        except CheckpointingException:
            raise refusal from None
    contents = {METADATA_FNAME: md_bytes}
    if manifest is not None and INDEX_FNAME in manifest.files:
        # The sidecar index names keys too: rebuilt from the renamed metadata.
        contents[INDEX_FNAME] = index_from_metadata(md, manifest.range_index(), len(md_bytes))
    if manifest is not None:
        contents[MANIFEST_FNAME] = _renamed_manifest(manifest, {}, contents, name).to_json()
    if out is not None:
        _write_copy(root, Path(out), lambda rel: rel, contents, progress)
        return
    if storage.local_root(root) is None:
        # An object store: one atomic put per object, manifest first (as below); a stale
        # sidecar index is removed before .metadata changes.
        for rel in (MANIFEST_FNAME, METADATA_FNAME, INDEX_FNAME):
            if rel == METADATA_FNAME:
                root.delete(INDEX_FNAME)
            if rel in contents:
                root.put(rel, contents[rel])
        return
    try:
        _swap_in_place(root, lambda rel: rel, contents)
    except _NoLinks:
        # Manifest first: after a crash between the two, the old .metadata (old names) is still
        # in place, so running the same rename again finishes the job.
        for rel in (MANIFEST_FNAME, METADATA_FNAME, INDEX_FNAME):
            if rel == METADATA_FNAME:
                (root / INDEX_FNAME).unlink(missing_ok=True)
            if rel in contents:
                atomic_write_bytes(root / rel, contents[rel])


def _renamed_path(value: Any, old: str, new: str) -> Any:
    """DCP's ``planner_data`` maps a key to its path in the nested state dict."""
    if isinstance(value, (tuple, list)) and ".".join(map(str, value)) == old:
        return type(value)(new.split("."))
    return value


def _renamed_save_plan(plan: Any, name: Callable[[str], str]) -> Any:
    items = getattr(plan, "items", None)
    if not isinstance(items, list):
        return plan
    renamed = [
        replace(it, index=replace(it.index, fqn=name(it.index.fqn)))
        if hasattr(it, "index") and hasattr(it.index, "fqn")
        else it
        for it in items
    ]
    out = replace(plan, items=renamed)
    if isinstance(getattr(out, "planner_data", None), dict):
        out = replace(
            out, planner_data={name(k) if isinstance(k, str) else k: v for k, v in out.planner_data.items()}
        )
    return out


def _rename_zarr(root: Path, plan: RenamePlan, out: Optional[PathLike], progress: Optional[Progress]) -> None:
    keys = zarr_layout.list_array_keys(root)
    # What is carried over is checked first, as a load checks it: a rename writes a fresh manifest
    # that would otherwise launder a damaged array description into one that verifies.
    manifest = read_manifest(root)
    for key in keys:
        meta = zarr_layout.read_array_meta(root, key, manifest)
        problem = None if meta is None else manifest_disagreement(meta, manifest)
        if problem:
            raise CheckpointingException(f"{problem} (nothing was changed)")
    new_keys = [plan.name(k) for k in keys]
    zarr_layout.check_key_paths(new_keys)
    dirs = {k: plan.tensors[k] for k in keys if k in plan.tensors}
    files = {f"{uk}.pt": f"{new}.pt" for uk, new in plan.objects.items()}
    array_dirs = set(keys)
    has_root_list = zarr_layout.root_keys(root) is not None

    def path_map(rel: str) -> Optional[str]:
        if rel in files:
            return files[rel]
        if rel == ARRAY_META and has_root_list:
            return None  # regenerated below
        parent = rel.rpartition("/")[0]
        if rel.endswith("/" + ARRAY_META) and parent not in array_dirs and _is_group_node(root / rel):
            return None  # intermediate group nodes are regenerated for the new key paths
        for old, new in dirs.items():
            if rel.startswith(old + "/"):
                return new + rel[len(old) :]
        return rel

    contents: Dict[str, bytes] = {}
    for old, new in dirs.items():
        meta_path = root / old / ARRAY_META
        if meta_path.is_file():
            md = bounds.parse_json(
                containment.read_beneath(root, f"{old}/{ARRAY_META}", root),
                meta_path,
                "array metadata",
            )
            attrs = md.get("attributes") if isinstance(md, dict) else None
            if attrs is not None and not isinstance(attrs, dict):
                raise CheckpointingException(
                    f"{meta_path}: 'attributes' is {type(attrs).__name__}, not an object "
                    f"(nothing was changed)"
                )
            attrs = md.setdefault("attributes", {}).setdefault("distckpt", {})
            if isinstance(attrs, dict) and "key" in attrs:
                attrs["key"] = new
            contents[f"{new}/{ARRAY_META}"] = json.dumps(md).encode()
    if has_root_list:
        root_md = json.loads(containment.read_beneath(root, ARRAY_META, root))
        root_md.setdefault("attributes", {}).setdefault("distckpt", {})["keys"] = sorted(new_keys)
        contents[ARRAY_META] = json.dumps(root_md).encode()
        group = json.dumps({"zarr_format": 3, "node_type": "group"}).encode()
        for key in new_keys:
            parts = key.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                contents.setdefault("/".join(parts[:i]) + "/" + ARRAY_META, group)
    moved = {old: new for old, new in files.items()}
    for old, new in dirs.items():
        for p in (root / old).rglob("*"):
            if p.is_file():
                rel = p.relative_to(root).as_posix()
                moved[rel] = new + rel[len(old) :]
    manifest = read_manifest(root)
    if manifest is not None:
        dropped = frozenset(rel for rel in _files(root) if path_map(rel) is None and rel not in contents)
        contents[MANIFEST_FNAME] = _renamed_manifest(manifest, moved, contents, plan.name, dropped).to_json()
    if out is not None:
        _write_copy(root, Path(out), path_map, contents, progress)
        return
    try:
        _swap_in_place(root, path_map, contents)
    except _NoLinks:
        tmp = _temp_beside(root, "renaming")
        try:
            _materialize(root, tmp, path_map, contents, link=False, progress=progress)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _exchange(tmp, root)
        shutil.rmtree(tmp, ignore_errors=True)


def _is_group_node(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("node_type") == "group"
    except (OSError, ValueError, AttributeError):
        return False


def _renamed_manifest(
    manifest: Manifest,
    moved: Dict[str, str],
    contents: Dict[str, bytes],
    name: Callable[[str], str],
    dropped: frozenset = frozenset(),
) -> Manifest:
    """The manifest after a rename: files moved per ``moved``, ``dropped`` ones left out, files in
    ``contents`` re-described (size and whole-file CRC32C), range keys renamed."""
    out = Manifest(
        manifest.save_id,
        manifest.backend,
        keys={name(k): v for k, v in manifest.keys.items()},
        arrays={name(k): v for k, v in manifest.arrays.items()},
    )
    for old_rel, size in manifest.files.items():
        if old_rel in dropped:
            continue
        rel = moved.get(old_rel, old_rel)
        if rel in contents:
            data = contents[rel]
            out.set_bytes(rel, data)
            continue
        out.files[rel] = size
        out.ranges[rel] = [
            RangeChecksum(r.offset, r.length, r.crc32c, rel if r.key == old_rel else name(r.key), r.chunk)
            for r in manifest.ranges.get(old_rel, [])
        ]
        if old_rel in manifest.blocks:  # same bytes, same block CRC32Cs
            out.blocks[rel] = manifest.blocks[old_rel]
    return out


# --------------------------------------------------------------------------- file trees


class _NoLinks(Exception):
    """Hard links or the directory exchange are not available here."""


def _committed(checkpoint: storage.Location) -> Union[Path, storage.Store]:
    if storage.is_remote(checkpoint):
        store = storage.open_store(checkpoint)
        try:
            parse_config(bytes(store.get(CONFIG_FNAME)), store.where(CONFIG_FNAME))
        except FileNotFoundError:
            raise CheckpointingException(
                f"{store}: not a committed checkpoint ({CONFIG_FNAME} is missing)"
            ) from None
        return store
    root = Path(checkpoint)
    if not root.is_dir():
        raise CheckpointingException(f"{root}: no such checkpoint directory")
    if maybe_load_config(root) is None and is_dcp_native(root):
        raise CheckpointingException(
            f"{root}: a plain PyTorch DCP checkpoint (no {CONFIG_FNAME}) is read-only to distckpt; "
            f"`distckpt convert` it to torch_dist first"
        )
    if maybe_load_config(root) is None:
        raise CheckpointingException(f"{root}: not a committed checkpoint ({CONFIG_FNAME} is missing)")
    return root.resolve()


def _edit_in_place(root: Union[Path, storage.Store]) -> None:
    """Before an edit in place of an object-store checkpoint: make its plain names the checkpoint
    (an overwritten one is read through its commit record; see distckpt.commit_store.flatten),
    so that what the edit reads and what it writes are the same objects."""
    if storage.local_root(root) is None:
        flatten(root)


def _local_output_only(root: Union[Path, storage.Store], out: Optional[PathLike]) -> None:
    """``--out`` copies are made on local disk; on an object store surgery works in place."""
    if out is not None and (storage.is_remote(out) or storage.local_root(root) is None):
        raise CheckpointingException(
            f"{out}: --out is for local checkpoints; on an object store the change is made in place "
            f"(or convert to a new location first: distckpt convert SRC DST --to torch_dist)"
        )


def _check_new_output(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise CheckpointingException(f"{out}: already exists (choose a new output directory)")
    if not out.resolve().parent.is_dir():
        raise CheckpointingException(f"{out.parent}: output's parent folder does not exist")


def _temp_beside(path: Path, what: str) -> Path:
    """A staging directory beside ``path``, named as distckpt.commit names them (``what`` says
    why to the reader), so that an interrupted edit's leftover is recognised and cleaned by
    the next save."""
    tmp = commit.leftover_name(commit.resolve_target(path), commit.STAGING_MARK, commit.new_save_id())
    return tmp


def _files(root: Path) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for n in sorted(filenames):
            out.append(Path(dirpath, n).relative_to(root).as_posix())
    return out


def _materialize(
    root: Path,
    dst: Path,
    path_map: Callable[[str], Optional[str]],
    contents: Dict[str, bytes],
    link: bool,
    progress: Optional[Progress] = None,
) -> None:
    """Build at ``dst`` the tree of ``root`` with paths mapped (None drops a file), files of
    ``contents`` written fresh and everything else hard-linked (``link``) or copied."""
    progress = progress or NoProgress()
    rels = [(rel, path_map(rel)) for rel in _files(root)]
    todo = [(rel, new) for rel, new in rels if new is not None and new not in contents]
    # The containment rule, before anything is linked or copied: no file of the source is a
    # symlink that leads out of it (a link or copy would carry the outside file in), and every
    # new name lies beneath the new tree.
    for rel, new in todo:
        containment.path_beneath(root, rel, root)
        containment.check_name(new, dst, "new file name")
    for rel in contents:
        containment.check_name(rel, dst, "new file name")
    if not link:
        progress.start(sum((root / rel).stat().st_size for rel, _ in todo), "copying")
    dst.mkdir()
    made = {dst}
    for rel, new in todo:
        target = dst / new
        if target.parent not in made:
            target.parent.mkdir(parents=True, exist_ok=True)
            made.add(target.parent)
        if link:
            try:
                os.link(root / rel, target)
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise _NoLinks(str(e)) from None
                raise
        else:
            _copy_file(root / rel, target, progress)
    for rel, data in contents.items():
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        made.add(target.parent)
        write_file_durably(target, data)
    for d in made:
        fsync_dir(d)


def _copy_file(src: Path, dst: Path, progress: Progress) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        while True:
            chunk = fi.read(16 << 20)
            if not chunk:
                break
            fo.write(chunk)
            progress.advance(len(chunk))
        fo.flush()
        os.fsync(fo.fileno())
    shutil.copymode(src, dst)


def _write_copy(
    root: Path, out: Path, path_map, contents: Dict[str, bytes], progress: Optional[Progress]
) -> None:
    tmp = _temp_beside(out, "partial")
    try:
        _materialize(root, tmp, path_map, contents, link=False, progress=progress)
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _install(tmp: Path, out: Path) -> None:
    if out.is_dir():
        out.rmdir()  # an empty directory, checked by _check_new_output
    os.replace(tmp, out)
    fsync_dir(out.resolve().parent)


def _swap_in_place(root: Path, path_map, contents: Dict[str, bytes]) -> None:
    """Build the edited tree beside ``root`` with hard links, exchange the two, drop the old."""
    tmp = _temp_beside(root, "renaming")
    try:
        _materialize(root, tmp, path_map, contents, link=True)
        if not _exchange_atomic(tmp, root):
            raise _NoLinks("renameat2(RENAME_EXCHANGE) is not available")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(tmp, ignore_errors=True)  # now the old tree; its data lives on through the links


def _exchange_atomic(a: Path, b: Path) -> bool:
    """Swap two directories in one step (Linux ``renameat2``); False where unsupported."""
    if exchange_directories(a, b):
        fsync_dir(b.parent)
        return True
    return False


def _exchange(tmp: Path, root: Path) -> None:
    """Put ``tmp`` in place of ``root``, leaving the old tree at ``tmp``; atomic where possible."""
    if _exchange_atomic(tmp, root):
        return
    old = _temp_beside(root, "old")
    os.rename(root, old)
    os.rename(tmp, root)
    os.rename(old, tmp)
    fsync_dir(root.parent)
