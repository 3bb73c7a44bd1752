"""The ``torch_dist`` backend: PyTorch DCP's on-disk format, file-compatible with Megatron-Core.

On disk (see docs/formats.md):
  ``__R_B.distcp``  rank R's bucket B: a sequence of items, each a complete ``torch.save``
                    archive of one chunk (tensors) or ``torch.save([obj])`` (ShardedObjects)
  ``__R_B.distcp.crc``  the CRC32C of every 256 KiB block of the file's large tensor items, so a
                    partial (resharded) read from an object store is checked (see blockcrc.py)
  ``.metadata``     a pickled ``torch.distributed.checkpoint.metadata.Metadata``: per key the
                    global size, dtype and chunk boxes; per chunk its (file, offset, length)

Flattened ranges are stored in the N-D reformulated shape ``grid + (prod(local_shape),)`` (see
:mod:`distckpt.strategies.resharding`).

One role per module, each importing only those above it in this list:

- :mod:`.records`   key declarations and records of a save, their tables, the sidecar index,
                    rank 0's memory of its last save
- :mod:`.claims`    the claims of a ``.metadata`` checked, and cross-checked with the manifest
- :mod:`.metadata`  ``.metadata`` read (restricted unpickler) and built
- :mod:`.stored`    a load's index of stored chunks (from ``.metadata`` or the sidecar) and the
                    items' checksums
- :mod:`.plan`, :mod:`.write`  a save's items, files and waves; writing them
- :mod:`.loadplan`, :mod:`.partial`, :mod:`.read`  a load's copies; reading them
- :mod:`.save`, :mod:`.load`, :mod:`.surgery`  the strategies, and key removal

The two strategies are registered as the ``torch_dist`` backend by :mod:`distckpt.strategies.builtin`.
"""

from distckpt.strategies.torch_dist.load import TorchDistLoadShardedStrategy
from distckpt.strategies.torch_dist.save import TorchDistSaveShardedStrategy

__all__ = ["TorchDistLoadShardedStrategy", "TorchDistSaveShardedStrategy"]
