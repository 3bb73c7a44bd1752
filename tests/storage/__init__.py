"""Tests of distckpt.storage: local directories and object stores (a moto S3 server)."""
