"""The Store protocol: one set of behaviours every store must show (local, memory, and real servers
on 127.0.0.1: S3 on moto, GCS on fake-gcs-server, Azure Blob on Azurite; tests/conftest.py)."""

from __future__ import annotations

import uuid

import pytest

from distckpt import CheckpointingException
from distckpt.storage import LocalStore, is_remote, open_store, resolve
from tests.support import clouds

STORES = ["local", "memory", "s3", "gcs", "azure"]


@pytest.fixture(params=STORES)
def store(request, tmp_path):
    if request.param == "local":
        return open_store(str(tmp_path / "ckpt"))
    if request.param == "memory":
        return open_store(f"memory://unit-{uuid.uuid4().hex[:8]}/ckpt")
    return open_store(request.getfixturevalue(clouds.URL_FIXTURES[request.param]))


def test_put_get_size_exists_delete(store):
    store.put("a/b.bin", b"hello")
    assert bytes(store.get("a/b.bin")) == b"hello"
    assert store.size("a/b.bin") == 5 and store.exists("a/b.bin") and not store.exists("a/c.bin")
    store.delete("a/b.bin")
    store.delete("a/b.bin")  # deleting a missing object is not an error
    assert not store.exists("a/b.bin")
    with pytest.raises(FileNotFoundError):
        store.get("a/b.bin")
    with pytest.raises(FileNotFoundError):
        store.size("a/b.bin")


def test_ranged_reads_return_exactly_the_ranges_and_refuse_past_the_end(store):
    data = bytes(range(256)) * 64
    store.put("x", data)
    got = store.get_ranges("x", [0, 100, 5000, 7], [10, 0, 3000, 1])
    assert [bytes(g) for g in got] == [data[:10], b"", data[5000:8000], data[7:8]]
    with pytest.raises(CheckpointingException, match="truncated"):
        store.get_ranges("x", [len(data) - 4], [8])


def test_list_names_every_object_below_the_location_relative_to_it(store):
    for name in ("m.json", "d/1", "d/2"):
        store.put(name, b"12")
    assert store.list() == {"d/1": 2, "d/2": 2, "m.json": 2}
    assert store.list("d/") == {"d/1": 2, "d/2": 2}
    assert store.child("d").list() == {"1": 2, "2": 2}


def test_a_child_of_a_child_addresses_the_same_objects_as_the_nested_name(store):
    store.child("a").child("b").put("c", b"xyz")
    assert bytes(store.get("a/b/c")) == b"xyz"
    assert store.list() == {"a/b/c": 3} and store.child("a").list() == {"b/c": 3}
    assert store.child("a").child("b").where("c") == store.where("a/b/c")


def test_put_if_absent_writes_once(store):
    assert store.put_if_absent("marker", b"first")
    assert not store.put_if_absent("marker", b"second")
    assert bytes(store.get("marker")) == b"first"


def test_of_concurrent_puts_if_absent_exactly_one_wins(store):
    """The commit's guarantee: of saves committing at once, one commits (S3 and Azure
    ``If-None-Match: *``, GCS generation precondition 0, local ``link(2)``)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda i: store.put_if_absent("race", b"%d" % i), range(8)))
    assert won.count(True) == 1
    assert bytes(store.get("race")) == b"%d" % won.index(True)


def test_a_writer_publishes_on_close_and_leaves_nothing_on_abort(store):
    with store.open_writer("w") as w:
        w.write(b"ab")
        w.write(memoryview(b"cd"))
    assert bytes(store.get("w")) == b"abcd"
    with pytest.raises(RuntimeError):
        with store.open_writer("gone") as w:
            w.write(b"x" * 1000)
            raise RuntimeError("stop")
    assert not store.exists("gone")
    assert set(store.list()) == {"w"}


def test_writes_and_puts_do_not_depend_on_the_callers_buffer_after_they_return(store):
    """The caller reuses its buffer at once (a staging buffer's next wave, a pinned slot's next
    piece): the object holds the bytes the buffer had at each write or put."""
    buf = bytearray(b"a" * 1000)
    with store.open_writer("reused") as w:
        w.write(buf)
        buf[:] = b"b" * 1000
        w.write(memoryview(buf)[:500])
        buf[:] = b"c" * 1000
    assert bytes(store.get("reused")) == b"a" * 1000 + b"b" * 500
    for name, put in (("put", store.put), ("once", store.put_if_absent)):
        buf[:] = b"d" * 1000
        put(name, memoryview(buf))
        buf[:] = b"e" * 1000  # an in-memory store would otherwise serve the buffer itself
        assert bytes(store.get(name)) == b"d" * 1000, name


def test_commit_markers_follow_the_store_s_overwrite_rule(store):
    names = ("metadata.json", ".metadata")
    store.begin_save(names, None)
    store.commit("metadata.json", b"{}")
    with pytest.raises(CheckpointingException, match="committed checkpoint"):
        store.begin_save(names, False)
    if store.supports_rename:
        store.begin_save(names, None)  # local directories are replaced by default
    else:
        with pytest.raises(CheckpointingException, match="overwrite=True"):
            store.begin_save(names, None)
        assert store.exists("metadata.json")
        store.begin_save(names, True)
    assert not store.exists("metadata.json")


def test_locations_resolve_to_local_paths_or_stores(tmp_path):
    assert resolve(str(tmp_path)) == tmp_path
    assert resolve(f"file://{tmp_path}") == tmp_path
    assert resolve(LocalStore(tmp_path)) == tmp_path
    assert is_remote("s3://b/x") and is_remote("gs://b/x") and is_remote("az://c/x")
    assert not is_remote(str(tmp_path)) and not is_remote(f"file://{tmp_path}")
    with pytest.raises(CheckpointingException, match="unsupported storage scheme"):
        resolve("ftp://host/x")
