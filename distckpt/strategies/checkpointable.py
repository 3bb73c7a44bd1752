"""Megatron-Core's ``strategies.checkpointable``: ShardedTensors handed to plain PyTorch DCP
(``torch.distributed.checkpoint.save`` / ``load``) through DCP's checkpointable protocol.

DCP accepts, in place of a tensor, an object that says which chunk of a global tensor it holds
(``__create_chunk_list__``), what to write (``__create_write_items__``) and which local tensor
holds a given chunk (``__get_tensor_shard__``). Two such wrappers:

* :class:`CheckpointableShardedTensor` - one :class:`~distckpt.mapping.ShardedTensor` (its data
  is saved as the chunk at its global offset of a tensor of its global shape);
* :class:`LocalShardsContainer` - several of them under one DCP key, for a rank that holds more
  than one chunk of the same global tensor (DCP takes one value per key and rank).

The files are DCP's, so distckpt's ``torch_dist`` strategy reads them too (as a plain DCP
checkpoint: the key's global shape and chunks come from ``.metadata``). Prepended axes
(``prepend_axis_num``) become size-1 axes of the chunk; flattened ranges are refused (a flat slice
is not a box of the global tensor).
"""

from __future__ import annotations

from itertools import chain
from typing import List, Optional

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from distckpt.core import CheckpointingException
from distckpt.mapping import ShardedTensor

__all__ = ["CheckpointableShardedTensor", "LocalShardsContainer"]


def _refuse_tensor_ops(cls, func) -> None:
    raise NotImplementedError(
        f"{cls.__name__} is a checkpointing wrapper: tensor operation {func} is not supported"
    )


class CheckpointableShardedTensor(torch.Tensor):
    """One ShardedTensor as a DCP checkpointable value (a tensor of its global shape)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, sh_ten: ShardedTensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, torch.Size(sh_ten.global_shape), dtype=sh_ten.dtype, device=data.device
        )

    def __init__(self, data: torch.Tensor, sh_ten: ShardedTensor):
        if sh_ten.flattened_range is not None:
            raise CheckpointingException(
                f"ShardedTensor {sh_ten.key!r} has a flattened_range: DCP's checkpointable protocol "
                f"takes whole boxes only"
            )
        self._data = data
        self._sh_ten = sh_ten

    @classmethod
    def from_sh_ten(cls, sh_ten: ShardedTensor) -> CheckpointableShardedTensor:
        if not isinstance(sh_ten, ShardedTensor):
            raise CheckpointingException(f"expected a ShardedTensor, got {type(sh_ten).__name__}")
        return cls(sh_ten.data, sh_ten)

    def _chunk(self) -> ChunkStorageMetadata:
        sh = self._sh_ten
        sizes = torch.Size((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        data = self._sh_ten.data
        if data is None or data.numel() != sizes.numel():
            raise CheckpointingException(
                f"ShardedTensor {sh.key!r}: data of shape {None if data is None else tuple(data.shape)} "
                f"does not hold its local chunk {tuple(sh.local_shape)}"
            )
        return ChunkStorageMetadata(offsets=torch.Size(sh.global_offset), sizes=sizes)

    def __create_write_items__(
        self, fqn: str, sh_ten: CheckpointableShardedTensor, index: Optional[int] = None
    ):
        chunk = sh_ten._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets, index),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(sh_ten._sh_ten.data),
                    size=torch.Size(sh_ten._sh_ten.global_shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [self._chunk()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._sh_ten.data.view(self._chunk().sizes)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        _refuse_tensor_ops(cls, func)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._sh_ten!r})"


class LocalShardsContainer(torch.Tensor):
    """Several CheckpointableShardedTensors of one global tensor, held by one rank, as one DCP value."""

    @staticmethod
    def __new__(cls, local_shards: List[torch.Tensor]):
        if not local_shards:
            raise CheckpointingException("LocalShardsContainer needs at least one shard")
        first = local_shards[0]
        return torch.Tensor._make_wrapper_subclass(cls, first.size(), dtype=first.dtype, device=first.device)

    def __init__(self, local_shards: List[torch.Tensor]):
        for shard in local_shards:
            if not isinstance(shard, CheckpointableShardedTensor):
                raise CheckpointingException(
                    f"LocalShardsContainer holds CheckpointableShardedTensors, got {type(shard).__name__}"
                )
        self._local_shards = list(local_shards)

    def __create_write_items__(self, fqn: str, local_shards_cont: LocalShardsContainer):
        return list(
            chain.from_iterable(
                shard.__create_write_items__(fqn, shard, index=i)
                for i, shard in enumerate(local_shards_cont._local_shards)
            )
        )

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return list(chain.from_iterable(shard.__create_chunk_list__() for shard in self._local_shards))

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is None:
            raise CheckpointingException(f"{index.fqn}: a LocalShardsContainer is looked up by chunk offset")
        shards = self._local_shards
        hint = index.index
        if hint is not None and 0 <= hint < len(shards):
            if torch.Size(shards[hint]._sh_ten.global_offset) == index.offset:
                return shards[hint].__get_tensor_shard__(index)
        for shard in shards:
            if torch.Size(shard._sh_ten.global_offset) == index.offset:
                return shard.__get_tensor_shard__(index)
        raise CheckpointingException(f"{index.fqn}: this rank holds no chunk at offset {tuple(index.offset)}")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        _refuse_tensor_ops(cls, func)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._local_shards!r})"
