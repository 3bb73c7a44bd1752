"""``python -m distckpt.cli``: the ``distckpt`` command without an installed entry point."""

from distckpt.cli import main

main(prog_name="distckpt")
