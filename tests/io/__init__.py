"""Tests of distckpt.io: how bytes move (the .distcp items written and read, the staging pool)."""
