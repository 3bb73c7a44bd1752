"""Tests of distckpt.local: the local tier."""
