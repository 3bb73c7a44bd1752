"""What the bytes on disk look like: the file formats distckpt writes and reads, every backend alike.

- :mod:`~distckpt.formats.manifest`: the integrity manifest ``.distckpt_manifest.json`` (every
  file's size, every range's CRC32C), built, read by schema, and checked against the files;
- :mod:`~distckpt.formats.zip_archive`: the ``torch.save`` zip archive of one item of a
  ``.distcp`` file, framed around a tensor's bytes and parsed without ``torch.load``;
- :mod:`~distckpt.formats.blockcrc`: the per-file block CRC32C tables ``__R_B.distcp.crc``;
- :mod:`~distckpt.formats.metadata_pickle`: DCP's ``.metadata`` pickle stream, written from arrays;
- :mod:`~distckpt.formats.index_format`, :mod:`~distckpt.formats.index_write`,
  :mod:`~distckpt.formats.index_read`: the sidecar index ``.distckpt_index`` (layout, building,
  partial reads).

A format module knows bytes, names and numbers, and reads through :mod:`distckpt.storage`; it never
imports a strategy, nor :mod:`distckpt.io` (how bytes move sits above it). What a backend alone
writes stays with the backend (``strategies/torch_dist/metadata.py``, ``strategies/zarr/meta.py``);
the commit record of an object-store overwrite stays in :mod:`distckpt.storage.record`, where the
object store resolves every name through it. The bytes themselves are specified in docs/formats.md.
"""
