"""Tests of distckpt.formats: the bytes on disk (the sidecar index; the manifest and block tables are
exercised through the backends, tests/untrusted/ and tests/strategies/test_ranged_reads.py)."""
