"""Checkpoint surgery as library functions (the ``distckpt`` command is a thin face over them).

Everything here runs in one process, without a process group.
"""
