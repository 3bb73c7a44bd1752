"""How bytes move: between tensors, host buffers, devices, files and stores, checked on the way.

- :mod:`~distckpt.io.byteio`: writable byte views of tensors, exact ``preadv`` reads (with their
  CRC32C);
- :mod:`~distckpt.io.filesystem`: the items of ``.distcp`` files written checksummed and zero-copy
  into a file or a store writer, and read straight into their destination;
- :mod:`~distckpt.io.copies`: a load's copies out of a stored item (:class:`~distckpt.io.copies.CopyOp`),
  from a tensor or a mapping of the file;
- :mod:`~distckpt.io.blockread`: checked partial reads of an item, block by block;
- :mod:`~distckpt.io.device_io`: CUDA tensors filled and emptied through pinned host slots;
- :mod:`~distckpt.io.staging`: the process-wide pool of host buffers async saves stage into
  (bounded by the host memory budget), and :mod:`~distckpt.io.staging_buffers`: one save's
  copies into it.

Modules here take tensors, file descriptors, byte ranges and :mod:`distckpt.storage` writers; the
formats they frame and check come from :mod:`distckpt.formats`. Nothing here imports a strategy:
which items go where is decided above (``strategies/``), and carried out here.
"""
