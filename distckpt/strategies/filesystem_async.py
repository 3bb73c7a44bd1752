"""Megatron-Core's ``strategies.filesystem_async``: a PyTorch DCP storage writer whose writing can
be split from planning (stage now, write later) and whose per-bucket write is a patchable hook.

:class:`FileSystemWriterAsync` is a :class:`torch.distributed.checkpoint.FileSystemWriter` that
works with ``torch.distributed.checkpoint.save`` as it is, and with Megatron-Core's split protocol:

1. ``prepare_write_data(plan, planner)`` resolves every item to host memory (the device-to-host
   copy) and groups the items into ``thread_count`` buckets, one file each;
2. ``get_save_function_and_args()`` returns ``(write_fn, preload_fn, args)``; ``write_fn(*args)``
   writes the buckets (one thread each, every bucket through the static method
   :meth:`FileSystemWriterAsync.write_preloaded_data`) and puts the results, or the error, on the
   results queue;
3. ``retrieve_write_results()`` returns the ``WriteResult``s, or raises ``Worker failure: ...``.

The hook: ``FileSystemWriterAsync.write_preloaded_data`` is looked up on the class at each write,
so replacing it (``mock.patch.object`` or assignment, as Megatron-Core's tests do) observes or
injects a failure in every write this class makes.

**distckpt's own saves do not write through this class**: ``distckpt.save`` with the default
``torch_dist`` strategy writes with :mod:`distckpt.strategies.torch_dist.write` (the same file
format, plus CRC32Cs and the manifest). To observe or inject there, wrap the ``async_fn`` of the
``AsyncRequest`` that ``save(..., async_sharded_save=True)`` returns (it runs in the background; an
error it raises reaches every rank at finalization and nothing is committed), or patch
``distckpt.strategies.torch_dist.write.Output.write`` (each data file's writer, sync and async).
docs/megatron-compat.md shows both.

``_results_queue`` is the module-level queue Megatron-LM's training loop imports (and shuts down);
:func:`_get_write_results_queue` creates it on first use. The buckets are written by threads of the
calling process (distckpt's async engine runs ``write_fn`` in a background thread), so it is a
thread-safe ``queue.Queue``, not Megatron-Core's ``spawn`` manager queue (which needs a process
and an import guard in the user's script).
"""

from __future__ import annotations

import io
import logging
import os
import queue
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import filesystem as _dcp_fs
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

logger = logging.getLogger(__name__)

__all__ = ["FileSystemWriterAsync", "WriteBucket"]

# (path of the file, its storage key, (byte items with their BytesIO, tensor items with their tensor))
WriteBucket = Tuple[Path, str, Tuple[List[Tuple[Any, io.BytesIO]], List[Tuple[Any, torch.Tensor]]]]

_results_queue = None


def _get_write_results_queue():
    """The queue write results travel on (created once, on first use)."""
    global _results_queue
    if _results_queue is None:
        _results_queue = queue.Queue()
    return _results_queue


def _host_copy(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.detach().to("cpu", copy=True).contiguous()
    return data


class FileSystemWriterAsync(FileSystemWriter):
    """A DCP ``FileSystemWriter`` with Megatron-Core's split write protocol (see the module)."""

    def __init__(self, path: Union[str, os.PathLike], *args, separation_hint: Optional[str] = None, **kwargs):
        kwargs.pop("use_msc", None)  # Megatron's multi-storage client: not supported, local paths only
        super().__init__(path, *args, **kwargs)
        if not self.single_file_per_rank:
            raise ValueError(
                "FileSystemWriterAsync writes one file per bucket: single_file_per_rank must be True"
            )
        self.separation_hint = separation_hint
        self.write_buckets: Optional[List[WriteBucket]] = None
        self.results_queue = None

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Copy every item of ``plan`` to host memory and group them into buckets (files)."""
        prefix = plan.storage_data.prefix
        buckets: List[WriteBucket] = []
        for index, items in enumerate(_dcp_fs._split_by_size_and_type(max(1, self.thread_count), plan.items)):
            name = f"{prefix}{index}{_dcp_fs.DEFAULT_SUFFIX}"
            as_bytes, as_tensors = [], []
            for item in items:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    as_bytes.append((item, data))
                else:
                    as_tensors.append((item, _host_copy(data)))
            buckets.append((self.fs.concat_path(self.path, name), name, (as_bytes, as_tensors)))
        self.write_buckets = buckets
        self.results_queue = _get_write_results_queue() if buckets else None

    def get_save_function_and_args(self) -> Tuple[Optional[Callable], Optional[Callable], List]:
        """``(write_fn, preload_fn, args)``: ``write_fn(*args)`` writes the prepared buckets.
        ``(None, None, [])`` when this rank has nothing to write."""
        if not self.write_buckets:
            return None, None, []
        args = [
            self.transforms,
            self.serialization_format,
            self.sync_files,
            self.write_buckets,
            self.results_queue,
        ]
        return self.write_preloaded_data_multiproc, None, args

    @staticmethod
    def write_preloaded_data_multiproc(
        transforms, serialization_format, use_fsync, write_buckets, results_queue
    ):
        """Write every bucket (one thread each) through ``write_preloaded_data``; put a dict
        bucket index -> WriteResults, or the first error, on ``results_queue``."""
        local: queue.Queue = queue.Queue()
        count: queue.Queue = queue.Queue()
        hook = FileSystemWriterAsync.write_preloaded_data  # looked up now: a patch is seen
        threads = []

        def run(index: int, bucket: WriteBucket) -> None:
            try:
                hook(
                    transforms,
                    index,
                    bucket,
                    local,
                    count,
                    use_fsync,
                    serialization_format=serialization_format,
                )
            except BaseException as e:  # noqa: BLE001 - a hook that raised instead of reporting
                local.put((index, e))

        for index, bucket in enumerate(write_buckets):
            count.put(index)
            t = threading.Thread(target=run, args=(index, bucket), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:  # each ends whether its write succeeded or not
            t.join()
        results: Dict[int, Any] = {}
        while not local.empty():
            index, value = local.get()
            results[index] = value
        failed = {i: v for i, v in results.items() if isinstance(v, BaseException)}
        if failed:
            results_queue.put(RuntimeError(f"Worker failure: {failed}"))
        elif len(results) != len(write_buckets):
            lost = sorted(set(range(len(write_buckets))) - set(results))
            results_queue.put(RuntimeError(f"Worker failure: buckets {lost} reported no result"))
        else:
            results_queue.put(results)

    @staticmethod
    def write_preloaded_data(
        transform_list,
        local_proc_idx: int,
        write_bucket: WriteBucket,
        results_queue,
        count_queue,
        use_fsync,
        **kwargs,
    ) -> None:
        """Write one bucket to its file; put ``(local_proc_idx, [WriteResult, ...])`` (or
        ``(local_proc_idx, error)``) on ``results_queue``, then mark one task of ``count_queue`` done."""
        fmt = kwargs.get("serialization_format", _dcp_fs.SerializationFormat.TORCH_SAVE)
        path, storage_key, (as_bytes, as_tensors) = write_bucket
        try:
            written = []
            with open(path, "wb") as stream:
                for item, data in as_bytes + as_tensors:
                    written.append(_dcp_fs._write_item(transform_list, stream, data, item, storage_key, fmt))
                if use_fsync:
                    stream.flush()
                    os.fsync(stream.fileno())
            output: Any = written
        except Exception as e:  # noqa: BLE001 - reported through the queue, raised by the caller
            output = e
        results_queue.put((local_proc_idx, output))
        count_queue.get()
        count_queue.task_done()

    def retrieve_write_results(self) -> List[WriteResult]:
        """The WriteResults of the last write; raises ``RuntimeError('Worker failure: ...')``."""
        if self.results_queue is None:
            return []
        got = self.results_queue.get()
        if isinstance(got, BaseException):
            raise RuntimeError(f"Worker failure: {got}") from got
        if len(got) != len(self.write_buckets or ()):
            raise RuntimeError(f"Worker failure: {len(got)} results for {len(self.write_buckets)} buckets")
        return [result for index in sorted(got) for result in got[index]]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """The synchronous path ``torch.distributed.checkpoint.save`` takes: prepare, write, collect."""
        self.prepare_write_data(plan, planner)
        write_fn, _, args = self.get_save_function_and_args()
        if write_fn is not None:
            write_fn(*args)
        future: Future = Future()
        future.set_result(self.retrieve_write_results())  # a failure raises here; DCP gathers it
        return future
