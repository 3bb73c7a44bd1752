"""distckpt as the storage layer of PyTorch DCP (``torch.distributed.checkpoint``).

Keep DCP's API, planners and state dicts (FSDP2, DTensor, ``get_state_dict``, ``Stateful``) and
change one argument::

    import torch.distributed.checkpoint as dcp
    import distckpt.dcp

    dcp.save(state_dict, storage_writer=distckpt.dcp.StorageWriter("s3://bucket/run/step_100"))
    dcp.async_save(state_dict, storage_writer=distckpt.dcp.StorageWriter(path))
    dcp.load(state_dict, storage_reader=distckpt.dcp.StorageReader("s3://bucket/run/step_100"))

What that brings (docs/dcp.md): locations that are paths or object-store URLs; an atomic commit
(staged and swapped in locally, a conditional put on object stores), so an interrupted save
leaves the previous checkpoint loadable; a CRC32C of every byte, checked on every load; reads
that treat the checkpoint as untrusted input (restricted unpickling of ``.metadata`` and of the
stored values, containment of file names, bounds on every claim); distckpt's writer threads and
ranged reads. The files stay DCP's format: DCP's ``FileSystemReader``, ``distckpt.load`` and the
``distckpt`` command read them, and :class:`StorageReader` reads what DCP's own writers wrote.

The package is ``distckpt.dcp`` and is imported as such (``import distckpt.dcp``), so it never
takes the name ``dcp`` that DCP users give ``torch.distributed.checkpoint``.
"""

from distckpt.dcp.reader import StorageReader
from distckpt.dcp.stager import PoolStager
from distckpt.dcp.writer import StorageWriter

__all__ = ["PoolStager", "StorageReader", "StorageWriter"]
