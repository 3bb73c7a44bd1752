"""Both tiers of a tiered checkpoint (:mod:`distckpt.tiered`) from the command line.

``distckpt inspect CKPT --local-copy DIR`` adds where a load would read each file of CKPT's
manifest from (:func:`read_plan`, through :func:`distckpt.tiered.read_tier`, the store a tiered
load reads through); ``distckpt verify CKPT --local-copy DIR`` adds the check of the local copy
against CKPT's manifest (:func:`check_local_copy`); ``distckpt tiers REMOTE --local ROOT`` lists
the iterations each tier holds. All three only read.

A local copy is what a tiered save leaves in ``<local root>/iter_NNNNNNN``: the files its ranks
wrote and one marker per owner rank carrying the save's token. A load uses it (file by file) only
when a marker carries the token the remote checkpoint was uploaded with and the file matches the
remote manifest, size and CRC32C of every range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import click
from rich.markup import escape
from rich.table import Table

from distckpt import storage
from distckpt.cli.app import (
    PATH,
    count_text,
    json_option,
    json_out,
    open_locations,
    out_console,
    size_text,
    storage_options_option,
)
from distckpt.core import CheckpointingException
from distckpt.formats.manifest import MANIFEST_FNAME, Manifest, read_manifest, verify_files
from distckpt.storage.base import Store
from distckpt.storage.local import LocalStore
from distckpt.tiered import markers, retention
from distckpt.tiered.manager import TOKEN_NAME, read_tier, remote_token

# Which save a local copy belongs to, compared with the remote checkpoint.
SAME = "same save"
OTHER = "another save"
NO_MARKERS = "no markers"
NO_TOKEN = "remote has no save token"

local_copy_option = click.option(
    "--local-copy",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="DIR",
    help="A node-local copy of CKPT left by a tiered save (<local root>/iter_NNNNNNN); see docs/tiered.md.",
)


# --------------------------------------------------------------------------- which save


@dataclass
class CopyOwner:
    """Which save the local copy ``directory`` belongs to: its markers against the remote."""

    directory: Path
    remote_token: Optional[str]
    tokens: Dict[int, str] = field(default_factory=dict)  # owner -> token of its readable marker
    damaged: List[str] = field(default_factory=list)  # markers that could not be read, with why
    files: Dict[int, Dict[str, int]] = field(default_factory=dict)  # owner -> files its marker lists

    @property
    def verdict(self) -> str:
        if self.remote_token is None:
            return NO_TOKEN
        if not self.tokens:
            return NO_MARKERS
        return SAME if self.remote_token in self.tokens.values() else OTHER

    def describe(self) -> str:
        """One line on which save the copy belongs to (what a load makes of it)."""
        verdict = self.verdict
        if verdict == SAME:
            mine = [o for o, t in sorted(self.tokens.items()) if t == self.remote_token]
            foreign = [o for o, t in sorted(self.tokens.items()) if t != self.remote_token]
            text = f"the markers of {_owners(mine)} carry the remote's save token"
            if foreign:
                text += f" ({_owners(foreign)}: another save's)"
            return text
        if verdict == OTHER:
            return (
                f"a copy of another save: the markers ({_owners(sorted(self.tokens))}) do not carry the "
                f"remote's save token"
            )
        if verdict == NO_MARKERS:
            return "no readable tier marker: not a finished tiered save, a load does not use it"
        return f"the remote has no {TOKEN_NAME}: not a tiered save, a load does not use a local copy"

    def to_json(self) -> dict:
        return {
            "directory": str(self.directory),
            "save": self.verdict,
            "remote_token": self.remote_token,
            "marker_tokens": {str(o): t for o, t in sorted(self.tokens.items())},
            "damaged_markers": self.damaged,
        }


def _owners(owners: List[int]) -> str:
    return ("owner " if len(owners) == 1 else "owners ") + ", ".join(map(str, owners))


def copy_owner(remote: Store, directory: Path) -> CopyOwner:
    """Read the markers of ``directory`` and the remote's save token (nothing is written)."""
    found = CopyOwner(directory, remote_token(remote))
    read, found.damaged = markers.read_all(directory)
    for owner, marker in read.items():
        found.tokens[owner] = marker.token
        found.files[owner] = marker.files
    return found


# --------------------------------------------------------------------------- inspect --local-copy


@dataclass
class ReadPlan:
    """Where a load of the remote checkpoint would read each file of its manifest from."""

    owner: CopyOwner
    manifest: bool
    rows: List[dict] = field(default_factory=list)  # name, size, source, reason

    def totals(self) -> Dict[str, int]:
        out = {"local files": 0, "local bytes": 0, "remote files": 0, "remote bytes": 0}
        for row in self.rows:
            out[f"{row['source']} files"] += 1
            out[f"{row['source']} bytes"] += row["size"]
        return out

    def to_json(self) -> dict:
        return {**self.owner.to_json(), "manifest": self.manifest, "files": self.rows, **self.totals()}


def read_plan(remote: Store, directory: Path) -> ReadPlan:
    """Decide, as a tiered load does (:func:`distckpt.tiered.read_tier`), where each file of the
    remote manifest would be read from, and why a local file would not be used. The local files
    are read and checksummed; nothing is written."""
    owner = copy_owner(remote, directory)
    tier = read_tier(remote, directory)
    plan = ReadPlan(owner, tier.manifest is not None)
    if tier.manifest is None:
        return plan
    local = LocalStore(directory)
    for name, size in sorted(tier.manifest.files.items()):
        if name == MANIFEST_FNAME:
            continue
        source = tier.source(name)
        reason = ""
        if source != "local":
            reason = tier.rejected.get(name, "")
            if not reason:
                reason = _why_not_local(local, name, owner)
        plan.rows.append({"name": name, "size": size, "source": source, "reason": reason})
    return plan


def _why_not_local(local: LocalStore, name: str, owner: CopyOwner) -> str:
    try:
        present = local.exists(name)
    except (OSError, CheckpointingException) as e:
        return str(e)
    if not present:
        return "not in the local copy"
    if owner.verdict == OTHER:
        return "the local copy is of another save"
    if owner.verdict == NO_MARKERS:
        return "the local copy has no marker"
    return "the remote has no save token" if owner.verdict == NO_TOKEN else "not used"


def print_read_plan(plan: ReadPlan) -> None:
    out = out_console()
    out.print()
    out.print(f"[bold]Local copy[/] {escape(str(plan.owner.directory))}")
    out.print(f"  {escape(plan.owner.describe())}")
    for line in plan.owner.damaged:
        out.print(f"  [yellow]ignored marker[/] {escape(line)}")
    if not plan.manifest:
        out.print(
            "  [yellow]the remote has no integrity manifest[/]: a load reads every file from the remote"
        )
        return
    table = Table(title="Files", title_justify="left", title_style="bold", box=None, pad_edge=False)
    table.add_column("file", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("read from", no_wrap=True)
    table.add_column("why not local", overflow="fold")
    for row in plan.rows:
        source = "[green]local[/]" if row["source"] == "local" else "[cyan]remote[/]"
        table.add_row(escape(row["name"]), size_text(row["size"]), source, escape(row["reason"]))
    out.print(table)
    t = plan.totals()
    out.print(
        f"  a load reads {count_text(t['local files'], 'file')} ({size_text(t['local bytes'])}) from the "
        f"local copy, {count_text(t['remote files'], 'file')} ({size_text(t['remote bytes'])}) and the "
        f"commit files (metadata.json, the manifest) from the remote"
    )


# --------------------------------------------------------------------------- verify --local-copy


@dataclass
class LocalCopyReport:
    """The local copy checked against the remote manifest: per file ok / damaged / absent."""

    owner: CopyOwner
    manifest: bool
    files: List[dict] = field(default_factory=list)  # name, size, status, reason
    problems: List[str] = field(default_factory=list)
    bytes_checksummed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {
            **self.owner.to_json(),
            "ok": self.ok,
            "manifest": self.manifest,
            "files": self.files,
            "problems": self.problems,
            "bytes_checksummed": self.bytes_checksummed,
        }


def check_local_copy(
    remote: Store, directory: Path, *, checksums: bool = True, progress=None
) -> LocalCopyReport:
    """Check every file of the remote manifest that ``directory`` holds (size and, with
    ``checksums``, the CRC32C of every range). Problems: a damaged file, a damaged marker, a
    file a marker of this save lists but the copy lacks, and a copy a load would not use (no
    marker carries the remote's save token, or the remote has no manifest). Files the copy does
    not hold and no marker of this save claims are ``absent``: a node holds its own ranks' files."""
    owner = copy_owner(remote, directory)
    manifest = read_manifest(remote)
    report = LocalCopyReport(owner, manifest is not None)
    report.problems += [f"tier marker: {line}" for line in owner.damaged]
    if owner.verdict != SAME:
        report.problems.append(owner.describe())
    if manifest is None:
        report.problems.append("the remote has no integrity manifest: the local copy cannot be checked")
        return report
    local = LocalStore(directory)
    present: Dict[str, int] = {}
    for name, size in sorted(manifest.files.items()):
        try:
            if local.exists(name):
                present[name] = size
            else:
                report.files.append({"name": name, "size": size, "status": "absent", "reason": ""})
        except (OSError, CheckpointingException) as e:
            report.files.append({"name": name, "size": size, "status": "damaged", "reason": str(e)})
    if progress is not None:
        progress.start(sum(present.values()), "local copy")
    for name, size in present.items():
        single = Manifest(
            manifest.save_id, manifest.backend, {name: size}, {name: manifest.ranges.get(name, [])}
        )
        if name in manifest.blocks:
            single.blocks[name] = manifest.blocks[name]
        try:
            found = verify_files(
                local, single, checksums=checksums, progress=progress.advance if progress else None
            )
        except (OSError, CheckpointingException) as e:
            found = [f"{name}: {e}"]
        if not found and checksums:
            report.bytes_checksummed += size
        status = "damaged" if found else "ok"
        report.files.append({"name": name, "size": size, "status": status, "reason": "; ".join(found)})
    report.files.sort(key=lambda f: f["name"])
    report.problems += [f["reason"] for f in report.files if f["status"] == "damaged"]
    if owner.verdict == SAME:
        for who, listed in sorted(owner.files.items()):
            if owner.tokens[who] != owner.remote_token:
                continue
            for name in sorted(set(listed) - set(present)):
                try:
                    held = local.exists(name)
                except (OSError, CheckpointingException) as e:
                    report.problems.append(f"{name} (listed by the marker of owner {who}): {e}")
                    continue
                if not held:
                    report.problems.append(
                        f"{name}: listed by the marker of owner {who} but not in the local copy"
                    )
    return report


def print_local_report(report: LocalCopyReport) -> None:
    out = out_console()
    out.print()
    out.print(f"[bold]Local copy[/] {escape(str(report.owner.directory))}")
    colour = "green" if report.owner.verdict == SAME else "red"
    out.print(f"  [{colour}]save[/]     {escape(report.owner.describe())}")
    if report.files:
        table = Table(box=None, pad_edge=False)
        table.add_column("file", overflow="fold")
        table.add_column("size", justify="right", no_wrap=True)
        table.add_column("local copy", no_wrap=True)
        table.add_column("why", overflow="fold")
        style = {"ok": "[green]ok[/]", "damaged": "[red]DAMAGED[/]", "absent": "[dim]absent[/]"}
        for f in report.files:
            table.add_row(escape(f["name"]), size_text(f["size"]), style[f["status"]], escape(f["reason"]))
        out.print(table)
    counts = {s: sum(1 for f in report.files if f["status"] == s) for s in ("ok", "damaged", "absent")}
    if report.files:
        out.print(f"  {counts['ok']} ok, {counts['damaged']} damaged, {counts['absent']} absent")
    for line in report.problems:
        out.print(f"  [red]PROBLEM[/]  {escape(line)}")
    if report.ok:
        done = f" ({size_text(report.bytes_checksummed)} checksummed)" if report.bytes_checksummed else ""
        out.print(f"[bold green]local copy OK[/]{done}")
    else:
        out.print(f"[bold red]local copy: {len(report.problems)} problem(s)[/]")


# --------------------------------------------------------------------------- tiers


@click.command()
@click.argument("remote", type=PATH)
@click.option(
    "--local",
    "local_root",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    metavar="ROOT",
    help="This node's local root of the tiered checkpoints (the manager's LOCAL).",
)
@json_option
@storage_options_option
def tiers(remote, local_root: Optional[Path], as_json: bool, storage_options) -> None:
    """List the iterations of a tiered checkpoint series in each tier. Reads only.

    REMOTE is the manager's remote root (its iter_NNNNNNN checkpoints); ROOT its local root on
    this node. Remote: committed (metadata.json present) or uncommitted (an upload in flight,
    failed or cut off). Local: the owner ranks whose markers this node holds, and whether they
    carry the remote's save token of the same iteration.

    \b
    Examples:
      distckpt tiers s3://bucket/run7 --local /local_nvme/run7
      distckpt tiers /shared/run7 --local /local_nvme/run7 --json
    """
    store = storage.open_store(open_locations("--storage-option", storage_options, remote))
    remote_its = retention.iterations(store)
    local_its = dict(markers.iteration_dirs(local_root)) if local_root is not None else {}
    rows = []
    for it in sorted(set(remote_its) | set(local_its), reverse=True):
        name = markers.iteration_name(it)
        row: dict = {"iteration": it, "name": name, "remote": None, "local_owners": None, "save": None}
        if it in remote_its:
            row["remote"] = "committed" if remote_its[it] else "uncommitted"
        if it in local_its:
            owner = copy_owner(store.child(name), local_its[it])
            row["local_owners"] = sorted(owner.tokens)
            row["damaged_markers"] = owner.damaged
            row["save"] = owner.verdict if it in remote_its else None
        rows.append(row)
    if as_json:
        json_out(
            {
                "remote": store.url,
                "local": None if local_root is None else str(local_root),
                "iterations": rows,
            }
        )
        return
    out = out_console()
    out.print(f"[bold]remote[/] {escape(store.url)}")
    if local_root is not None:
        out.print(f"[bold]local[/]  {escape(str(local_root))}")
    table = Table(box=None, pad_edge=False)
    for title in ("iteration", "remote", "local markers", "local copy"):
        table.add_column(title, no_wrap=title != "local copy", overflow="fold")
    for row in rows:
        remote_cell = {"committed": "[green]committed[/]", "uncommitted": "[yellow]uncommitted[/]"}.get(
            row["remote"], "[dim]-[/]"
        )
        owners = row["local_owners"]
        if owners is None:
            local_cell = "[dim]-[/]"
        else:
            local_cell = _owners(owners) if owners else "[yellow]none[/]"
            if row.get("damaged_markers"):
                local_cell += f" [red]({len(row['damaged_markers'])} damaged)[/]"
        save = row["save"] or ""
        colour = {SAME: "green", OTHER: "red"}.get(save, "yellow")
        table.add_row(row["name"], remote_cell, local_cell, f"[{colour}]{escape(save)}[/]" if save else "")
    if rows:
        out.print(table)
    else:
        out.print("no iterations in either tier")
