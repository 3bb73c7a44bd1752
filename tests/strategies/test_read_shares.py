"""A load with more reader threads than files: each local file's items are cut into consecutive
shares that any thread reads (``_PlanReads.shares``), same-layout and resharded, with the bytes
checked as a whole-file read checks them."""

from __future__ import annotations

import threading

import pytest
import torch

import distckpt
from distckpt import CheckpointingException, ShardedTensor
from distckpt.strategies.torch_dist import read as read_module
from distckpt.strategies.torch_dist.load import TorchDistLoadShardedStrategy

MiB = 1 << 20


def _full() -> dict:
    g = torch.Generator().manual_seed(5)
    out = {f"w{i}": torch.randn(256 + 16 * i, 1024, generator=g) for i in range(12)}  # ~1-2 MiB each
    out.update({f"b{i}": torch.randn(100 + i, generator=g) for i in range(30)})
    out["big"] = torch.randn(1500, 1024, generator=g)  # larger than a share: a share of its own
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("shares") / "ckpt"
    distckpt.save({k: ShardedTensor.from_rank_offsets(k, v) for k, v in _full().items()}, path)
    assert len(list(path.glob("*.distcp"))) == 2
    return path


class _Counted:
    """Every share read, and by which thread, for the duration."""

    def __init__(self):
        self.calls, self.threads, self.lock = [], set(), threading.Lock()
        self.real = read_module._PlanReads.read_file

    def __enter__(self):
        real, me = self.real, self

        def counting(reads, name, items=None):
            with me.lock:
                me.calls.append((name, None if items is None else len(items)))
                me.threads.add(threading.get_ident())
            return real(reads, name, items)

        read_module._PlanReads.read_file = counting
        return self

    def __exit__(self, *exc):
        read_module._PlanReads.read_file = self.real


@pytest.mark.parametrize("threads", [1, 2, 4, 7])
def test_more_readers_than_files_read_shares_of_them_and_load_the_same_values(saved, threads):
    full = _full()
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in full.items()}
    with _Counted() as seen:
        out = distckpt.load(request, saved, TorchDistLoadShardedStrategy(thread_count=threads, verify=True))
    assert all(torch.equal(out[k], full[k]) for k in full)
    if threads <= 2:
        assert sorted(n for n, _ in seen.calls) == ["__0_0.distcp", "__0_1.distcp"]  # a file each
    else:
        # every file read in shares, more of them than files; each item read exactly once
        assert len(seen.calls) > 2 and all(k is not None for _, k in seen.calls), seen.calls
        assert sum(k for _, k in seen.calls) == len(full)


def test_a_resharded_load_through_shares_gets_every_box(saved):
    full = _full()
    # each matrix as the two column halves (strided boxes) of a 2-way TP split, both here
    cols = {}
    for k, v in full.items():
        if v.dim() == 2:
            half = v.shape[1] // 2
            cols[(k, 0)], cols[(k, 1)] = v[:, :half], v[:, half:]
    request = {
        f"{k}.{i}": ShardedTensor.from_rank_offsets(k, torch.zeros_like(c), (1, i, 2))
        for (k, i), c in cols.items()
    }
    out = distckpt.load(request, saved, TorchDistLoadShardedStrategy(thread_count=6))
    assert all(torch.equal(out[f"{k}.{i}"], c) for (k, i), c in cols.items())


def test_a_damaged_item_in_a_share_is_named(saved, tmp_path):
    import shutil

    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    data = copy / "__0_1.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    full = _full()
    request = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v)) for k, v in full.items()}
    with pytest.raises(CheckpointingException, match=r"__0_1\.distcp.*CRC32C mismatch"):
        distckpt.load(request, copy, TorchDistLoadShardedStrategy(thread_count=5))
