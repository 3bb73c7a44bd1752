"""A checkpoint as untrusted input: containment, bounds, damage, hostile files, checksums."""
