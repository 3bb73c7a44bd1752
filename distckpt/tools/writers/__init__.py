"""What a conversion writes into: the writers of :mod:`distckpt.tools.convert`'s writer protocol.

- :mod:`~distckpt.tools.writers.checkpoint`: :class:`TorchDistWriter` and :class:`ZarrWriter`,
  distckpt checkpoints committed the distckpt way (:class:`DistckptWriter`);
- :mod:`~distckpt.tools.writers.files`: :class:`SafetensorsWriter` and :class:`TorchFileWriter`,
  plain tensor files (:func:`make_file_writer` picks one by format name).

The checkpoint writers are registered under their backend names by :mod:`distckpt.tools.convert`,
the file writers under ``safetensors`` and ``torch`` by :mod:`distckpt.tools.export`.
"""

from distckpt.tools.writers.checkpoint import DistckptWriter, TorchDistWriter, ZarrWriter
from distckpt.tools.writers.files import SafetensorsWriter, TorchFileWriter, make_file_writer

__all__ = [
    "DistckptWriter",
    "SafetensorsWriter",
    "TorchDistWriter",
    "TorchFileWriter",
    "ZarrWriter",
    "make_file_writer",
]
