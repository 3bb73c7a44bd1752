"""Tests of distckpt.tools and distckpt.cli: surgery, conversion, verification, the command."""
