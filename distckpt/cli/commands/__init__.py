"""The commands of ``distckpt``, one module per family; :data:`COMMANDS` lists them all.

Each is a plain click command; :mod:`distckpt.cli` adds them to the group of
:mod:`distckpt.cli.app`, whose shared options and output helpers they use.
"""

from __future__ import annotations

from distckpt.cli.commands.checks import diff, verify
from distckpt.cli.commands.cleanup import gc
from distckpt.cli.commands.convert import convert
from distckpt.cli.commands.demo import demo
from distckpt.cli.commands.inspect_show import inspect, show
from distckpt.cli.commands.surgery import rename, rm_prefix
from distckpt.cli.commands.tiers import tiers

COMMANDS = (inspect, show, verify, diff, convert, rm_prefix, rename, gc, demo, tiers)

__all__ = ["COMMANDS"]
