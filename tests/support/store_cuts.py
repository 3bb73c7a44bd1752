"""Overwrites of an object-store checkpoint cut at one request, and what must hold afterwards.

One process (world 1) saves the *generation* state of tests/support/faults.py — every value
depends on the generation, so a mix of two saves cannot pass for either — first fresh
(generation 1), then over it (generation 2) through a :class:`~tests.support.s3_faults.CountingStore`
that cuts the store at request ``n`` (an outage from there on, or that one request alone). After
the cut the store heals and the checks below say what a user would find: the checkpoint loads as
generation 1 or 2, whole; the next overwrite (generation 3) succeeds and leaves no object of an
earlier save behind; the plain names (what other readers read) follow the committed save.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import distckpt
from distckpt.storage import open_store
from distckpt.storage.record import PLAIN, RECORD_NAME, placed, token_in
from tests.support.faults import generation_mismatches, generation_state
from tests.support.s3_faults import CountingStore

BACKENDS = ("torch_dist", "zarr")


def save(location, generation: int, backend: str, overwrite: bool = True) -> None:
    distckpt.save(
        generation_state(0, 1, generation), location, sharded_strategy=(backend, 1), overwrite=overwrite
    )


def loaded_generation(url: str, candidates: Sequence[int] = (1, 2, 3)) -> Optional[int]:
    """The generation the checkpoint at ``url`` loads as, whole; None for a mix (a load error
    propagates)."""
    loaded = distckpt.load(generation_state(0, 1, 0, with_data=False), url)
    for generation in candidates:
        if not generation_mismatches(loaded, 0, 1, generation):
            return generation
    return None


def overwrite_log(url: str, backend: str) -> List[Tuple[str, str]]:
    """The requests of an overwrite of generation 1 by 2 at a fresh ``url``, in order."""
    save(url, 1, backend, overwrite=False)
    store = CountingStore(open_store(url))
    save(store, 2, backend)
    return store.log


def commit_request(log: Sequence[Tuple[str, str]]) -> int:
    """The 1-based number of the request that commits: the commit record's versioned put."""
    return 1 + next(i for i, (op, name) in enumerate(log) if op == "put_versioned" and name == RECORD_NAME)


def sample(count: int, commit: int) -> List[int]:
    """The cut points that matter most: one among the data writes, the commit, the first request
    after it (publication)."""
    return sorted({max(1, commit // 2), commit, commit + 1} & set(range(1, count + 1)))


def cut_overwrite(
    url: str, backend: str, cut_at: int, only_one: bool = False, lose_answer: bool = False
) -> Optional[str]:
    """Save generation 1 fresh at ``url``, then overwrite it with 2 through a store cut at request
    ``cut_at`` (see CountingStore); returns the save's error (None when it returned). The store is
    healed after."""
    save(url, 1, backend, overwrite=False)
    store = CountingStore(open_store(url), cut_at=cut_at, only_one=only_one, lose_answer=lose_answer)
    try:
        save(store, 2, backend)
    except Exception as e:  # noqa: BLE001 - the caller checks what the save said
        return f"{type(e).__name__}: {e}"
    finally:
        store.heal()
    return None


def leftovers(url: str) -> List[str]:
    """Objects of saves that are not the committed one (by the token in their names), and the
    staged tree of a checkpoint whose plain names are its objects."""
    store = open_store(url)
    record = store.committed_version(refresh=True)
    out = []
    for name in store.list_objects():
        found = token_in(name)
        if found is None:
            continue
        ours = record is not None and found[0] == record.token
        if not ours or (record.state == PLAIN and "/" in name):
            out.append(name)
    return out


def unpublished(url: str) -> List[str]:
    """Plain names whose bytes are not the committed save's (what a reader of the plain layout,
    Megatron-Core after a download, DCP, a Zarr reader, would read wrong)."""
    store = open_store(url)
    record = store.committed_version(refresh=True)
    if record is None or record.state == PLAIN:
        return []
    wrong = []
    for name in store.list():
        staged = placed(record, name)
        if staged == name:
            continue
        try:
            plain = store.get_versioned(name)[0]
        except FileNotFoundError:
            wrong.append(f"{name} (missing)")
            continue
        if plain != store.get_versioned(staged)[0]:
            wrong.append(name)
    return wrong
