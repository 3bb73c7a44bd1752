"""The ``distckpt`` command: a thin face over the library (see ``distckpt --help``).

:data:`main` (the console script ``distckpt``, and ``python -m distckpt.cli``) is the group of
:mod:`distckpt.cli.app`, the face: exit codes, shared options, output. The commands live in
:mod:`distckpt.cli.commands` and are added to it here, in one place.

Every command runs in one process, on CPU, with no model code and no process group; the work is
done by :mod:`distckpt.tools`. Exit codes (docs/cli.md):

    0  success: the checkpoint is fine / the two sides are identical
    1  problems found (verify) / differences found (diff) / the demo's reload did not match
    2  usage or input error: bad option, missing path, not a checkpoint, unreadable file,
       refusing to unpickle without --trust, ... (one red line on stderr, no traceback)
    3  internal error: a bug in distckpt (a traceback is printed; please report it)
"""

from __future__ import annotations

from distckpt.cli.app import EXIT_INTERNAL, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, main
from distckpt.cli.commands import COMMANDS
from distckpt.cli.commands.checks import diff, verify
from distckpt.cli.commands.cleanup import gc
from distckpt.cli.commands.convert import convert
from distckpt.cli.commands.demo import demo
from distckpt.cli.commands.inspect_show import inspect, show
from distckpt.cli.commands.surgery import rename, rm_prefix
from distckpt.cli.commands.tiers import tiers

# The command objects stay importable from here, where they were defined before the split.
__all__ = [
    "EXIT_INTERNAL",
    "EXIT_OK",
    "EXIT_PROBLEMS",
    "EXIT_USAGE",
    "convert",
    "demo",
    "diff",
    "gc",
    "inspect",
    "main",
    "rename",
    "rm_prefix",
    "show",
    "tiers",
    "verify",
]

for _command in COMMANDS:
    main.add_command(_command)
