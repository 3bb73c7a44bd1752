"""An overwrite on an object store never loses the checkpoint it replaces (distckpt.commit_store).

Cut at any request — an outage from there on, or that one request failing — the prefix holds the
old checkpoint or the new one, whole; a reader at any moment of an overwrite loads one of them,
whole; the next save succeeds and leaves no object of an earlier save behind; the plain names
(what other readers read) follow the committed save. One process saves the generation state of
tests/support/faults.py (a mix of two saves cannot pass for either) through a store that counts
requests (tests/support/store_cuts.py). The default run cuts at a few chosen points of each
store and backend; ``-m slow`` cuts at every request.
"""

from __future__ import annotations

import uuid

import pytest

import distckpt
from distckpt import CheckpointingException
from distckpt.cli import main
from distckpt.storage import open_store
from distckpt.storage.record import PUBLISHED, RECORD_NAME, STAGED
from tests.support import store_cuts
from tests.support.s3_faults import CountingStore

BACKENDS = store_cuts.BACKENDS


def _fresh(url: str) -> str:
    return f"{url}/{uuid.uuid4().hex[:8]}"


# The requests of an overwrite, per store scheme and backend (the same state makes the same ones).
_LOGS = {}


def _points(url: str, backend: str, every: bool):
    key = (url.split("://", 1)[0], backend)
    if key not in _LOGS:
        _LOGS[key] = store_cuts.overwrite_log(_fresh(url), backend)
    log = _LOGS[key]
    commit = store_cuts.commit_request(log)
    return (range(1, len(log) + 1) if every else store_cuts.sample(len(log), commit)), commit


def _check_cuts(url: str, backend: str, every: bool, only_one: bool, keep=None) -> None:
    points, commit = _points(url, backend, every)
    if keep is not None and not every:
        points = [p for p in points if keep(p, commit)]
    for cut in points:
        where = _fresh(url)
        error = store_cuts.cut_overwrite(where, backend, cut, only_one)
        expected = 1 if error is not None else 2
        # Cut before the record's put, the save fails and the old checkpoint is whole; at or
        # after it, the save is committed (what follows it is best effort) and the new one is.
        assert (error is None) == (cut > commit), (cut, commit, error)
        assert store_cuts.loaded_generation(where) == expected, (cut, error)
        store_cuts.save(where, 3, backend)
        assert store_cuts.loaded_generation(where) == 3, cut
        assert store_cuts.leftovers(where) == [], cut
    assert store_cuts.unpublished(where) == []


def test_a_torch_dist_overwrite_cut_by_an_outage_leaves_the_old_or_the_new_checkpoint_whole(store_url):
    _check_cuts(store_url, "torch_dist", every=False, only_one=False)


def test_a_zarr_overwrite_cut_just_before_its_commit_leaves_the_old_checkpoint_whole(store_url):
    _check_cuts(store_url, "zarr", every=False, only_one=False, keep=lambda cut, commit: cut == commit)


def test_an_overwrite_with_one_failed_request_fails_whole_or_commits_whole(store_url):
    _check_cuts(store_url, "torch_dist", every=False, only_one=True, keep=lambda cut, commit: cut <= commit)


@pytest.mark.slow
@pytest.mark.parametrize("only_one", [False, True], ids=["outage", "one-request"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_overwrite_cut_at_every_request_leaves_the_old_or_the_new_checkpoint_whole(
    store_url, backend, only_one
):
    _check_cuts(store_url, backend, every=True, only_one=only_one)


def _check_readers(url: str, backend: str, every: bool) -> None:
    points, commit = _points(url, backend, every)
    points = set(points) | {1}
    url = _fresh(url)
    store_cuts.save(url, 1, backend, overwrite=False)
    seen = {}

    def load_now(n):
        if n in points:
            seen[n] = store_cuts.loaded_generation(url)

    store_cuts.save(CountingStore(open_store(url), on_request=load_now), 2, backend)
    assert set(seen) == points
    assert {n: g for n, g in seen.items() if g != (2 if n > commit else 1)} == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_during_an_overwrite_loads_the_old_or_the_new_checkpoint_whole(store_url, backend):
    _check_readers(store_url, backend, every=False)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_at_every_request_of_an_overwrite_loads_the_old_or_the_new_checkpoint_whole(
    store_url, backend
):
    _check_readers(store_url, backend, every=True)


def test_a_load_straddling_an_overwrite_returns_the_old_checkpoint_whole_or_says_it_was_replaced(store_url):
    outcomes = set()
    for at in (2, 4, 6):
        url = _fresh(store_url)
        store_cuts.save(url, 1, "torch_dist", overwrite=False)
        done = []

        def overwrite_once(n, url=url, at=at, done=done):
            if n == at and not done:
                done.append(n)
                store_cuts.save(url, 2, "torch_dist")

        try:
            generation = store_cuts.loaded_generation(
                CountingStore(open_store(url), on_request=overwrite_once)
            )
            assert generation == 1, at
            outcomes.add("old")
        except CheckpointingException as e:
            assert "replaced" in str(e) and "load again" in str(e), e
            outcomes.add("replaced")
        assert done, f"the load made fewer than {at} requests"
        assert store_cuts.loaded_generation(url) == 2
    assert "replaced" in outcomes


def test_a_commit_whose_answer_was_lost_is_taken_as_done_and_nothing_is_aborted(store_url):
    _, commit = _points(store_url, "torch_dist", every=False)
    url = _fresh(store_url)
    assert store_cuts.cut_overwrite(url, "torch_dist", commit, lose_answer=True) is None
    assert store_cuts.loaded_generation(url) == 2
    assert store_cuts.leftovers(url) == [] and store_cuts.unpublished(url) == []


def test_an_overwrite_writes_no_object_of_the_checkpoint_it_replaces(store_url):
    url = _fresh(store_url)
    store_cuts.save(url, 1, "torch_dist", overwrite=False)
    before = dict(open_store(url).list_objects())
    _, commit = _points(store_url, "torch_dist", every=False)
    store = CountingStore(open_store(url), cut_at=commit)  # everything before the commit is there
    with pytest.raises(CheckpointingException):
        store_cuts.save(store, 2, "torch_dist")
    store.heal()
    written = [op_name for op_name in store.log[: commit - 1] if op_name[0] in ("put", "open upload")]
    assert written and not [name for _, name in written if name in before]
    data = [name for _, name in written if name.endswith(".distcp")]
    record = distckpt.storage.record
    assert data and all(record.token_in(name) for name in data)  # <token>__R_B.distcp


def test_a_committed_overwrite_whose_publication_was_cut_is_published_by_gc(store_url, capsys):
    _, commit = _points(store_url, "torch_dist", every=False)
    url = _fresh(store_url)
    assert store_cuts.cut_overwrite(url, "torch_dist", commit + 1) is None  # committed
    store = open_store(url)
    assert store.committed_version().state == STAGED
    assert store_cuts.loaded_generation(url) == 2
    assert store_cuts.unpublished(url)  # the plain names still hold generation 1
    assert main(["gc", url, "--json"], standalone_mode=False) is None
    out = capsys.readouterr().out
    assert '"published": "g' in out
    assert store.committed_version(refresh=True).state == PUBLISHED
    assert store_cuts.unpublished(url) == [] and store_cuts.leftovers(url) == []
    assert store_cuts.loaded_generation(url) == 2


def test_of_two_overwrites_racing_the_later_commit_fails_and_the_winner_is_whole(store_url):
    url = _fresh(store_url)
    store_cuts.save(url, 1, "torch_dist", overwrite=False)
    raced = []

    def race(n):
        if n == 5 and not raced:  # this save began; another one runs to its end now
            raced.append(n)
            store_cuts.save(url, 3, "torch_dist")

    # It fails at its commit: the record changed, or the winner's clean-up took its objects.
    with pytest.raises(CheckpointingException, match="another save committed|another job's clean-up"):
        store_cuts.save(CountingStore(open_store(url), on_request=race), 2, "torch_dist")
    assert store_cuts.loaded_generation(url) == 3
    assert store_cuts.leftovers(url) == [] and store_cuts.unpublished(url) == []


def test_rm_prefix_in_place_edits_an_overwritten_checkpoint_and_what_loads_follows(store_url):
    from distckpt.tools.surgery import remove_prefix

    url = _fresh(store_url)
    store_cuts.save(url, 1, "torch_dist", overwrite=False)
    store_cuts.save(url, 2, "torch_dist")
    assert remove_prefix(url, "mask") == ["mask"]
    assert "mask" not in distckpt.load_sharded_metadata(url)
    assert store_cuts.leftovers(url) == []  # the staged tree went with the edit
    store_cuts.save(url, 3, "torch_dist")  # and the next overwrite works from there
    assert store_cuts.loaded_generation(url) == 3 and store_cuts.leftovers(url) == []


def test_a_damaged_commit_record_is_an_error_naming_it(store_url):
    url = _fresh(store_url)
    store_cuts.save(url, 1, "torch_dist", overwrite=False)
    store_cuts.save(url, 2, "torch_dist")
    open_store(url).put(RECORD_NAME, b'{"format": "distckpt-commit", "version": 1, "token": "../x"}')
    with pytest.raises(CheckpointingException, match=r"\.distckpt_commit\.json: field 'token'"):
        distckpt.load_common_state_dict(url)


def test_a_downloaded_commit_record_and_staged_tree_are_not_carried_into_a_local_overwrite(tmp_path):
    ckpt = tmp_path / "ckpt"
    store_cuts.save(ckpt, 1, "torch_dist", overwrite=False)
    (ckpt / RECORD_NAME).write_text("{}")
    (ckpt / ".distckpt-g1-0123abcd").mkdir()
    (ckpt / ".distckpt-g1-0123abcd" / "common.pt").write_bytes(b"x")
    (ckpt / "README").write_text("kept")
    store_cuts.save(ckpt, 2, "torch_dist")
    names = {p.name for p in ckpt.iterdir()}
    assert "README" in names and RECORD_NAME not in names and ".distckpt-g1-0123abcd" not in names


def test_gc_on_a_local_directory_removes_the_leftovers_of_interrupted_saves(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    store_cuts.save(ckpt, 1, "torch_dist", overwrite=False)
    leftover = tmp_path / ".ckpt.distckpt-staging-0123abcd"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"partial")
    assert main(["gc", str(ckpt), "--dry-run"], standalone_mode=False) is None
    assert (
        leftover.exists()
        and "1 leftover of earlier or failed saves would be removed" in capsys.readouterr().out
    )
    assert main(["gc", str(ckpt)], standalone_mode=False) is None
    assert not leftover.exists() and store_cuts.loaded_generation(ckpt) == 1
