"""Strict-mode handling of a load whose requested keys and the checkpoint's keys differ
(re-exported by :mod:`distckpt.validation`)."""

from __future__ import annotations

import logging
from enum import Enum
from typing import Optional, Set, Tuple, Union

from torch.distributed.checkpoint import CheckpointException

from distckpt.core import CheckpointingException

# The name the messages have always been logged under.
logger = logging.getLogger("distckpt.validation")


class StrictHandling(Enum):
    """What to do when the requested keys and the checkpoint's keys differ.

    *Unexpected* keys are requested by the caller but absent from the checkpoint. *Missing* keys
    are in the checkpoint but requested by no rank (finding them needs a gather of every rank's
    requests, so only the ``*_ALL`` modes pay for it).

    - ASSUME_OK_UNEXPECTED: no check; an absent key fails later, inside the strategy.
    - LOG_UNEXPECTED / LOG_ALL: log, skip the unexpected keys, load the rest.
    - RAISE_UNEXPECTED / RAISE_ALL: raise CheckpointingException on every rank.
    - RETURN_UNEXPECTED / RETURN_ALL: skip them and return them from ``load``.
    - IGNORE_ALL: skip unexpected keys silently.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: StrictHandling) -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: StrictHandling) -> bool:
        return val in (StrictHandling.LOG_ALL, StrictHandling.RAISE_ALL, StrictHandling.RETURN_ALL)

    @staticmethod
    def requires_returning_mismatch_keys(val: StrictHandling) -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling]) -> StrictHandling:
    if isinstance(strict, StrictHandling):
        return strict
    try:
        return StrictHandling(strict)
    except ValueError:
        allowed = ", ".join(s.value for s in StrictHandling)
        raise CheckpointingException(f"unknown strict mode {strict!r}; expected one of: {allowed}") from None


def determine_missing_and_unexpected_keys(
    ckpt_keys: Set[str],
    local_keys: Set[str],
    global_keys: Optional[Set[str]] = None,
) -> Tuple[Set[str], Set[str]]:
    """Unexpected: requested here, absent from the checkpoint. Missing: in the checkpoint,
    requested by no rank (only known when ``global_keys`` is given)."""
    unexpected = local_keys - ckpt_keys
    missing = ckpt_keys - global_keys if global_keys is not None else set()
    return missing, unexpected


def mismatch_message(missing: Set[str], unexpected: Set[str], checkpoint_dir: str) -> str:
    """The report of a key mismatch: Megatron-Core's wording first (``Missing keys`` /
    ``Unexpected keys``, which users and tests search for), distckpt's detail after it."""
    parts = []
    if unexpected:
        parts.append(
            f"Unexpected keys (for this rank): {sorted(unexpected)} "
            f"(keys requested but not in the checkpoint: {sorted(unexpected)})"
        )
    if missing:
        parts.append(
            f"Missing keys (for all ranks): {sorted(missing)} "
            f"(keys in the checkpoint but not requested by any rank: {sorted(missing)})"
        )
    return f"{checkpoint_dir}: " + "; ".join(parts)


def handle_mismatched_keys(
    strict: StrictHandling, missing: Set[str], unexpected: Set[str], checkpoint_dir: str
) -> None:
    """Log or raise according to ``strict``; returning and skipping is the caller's job."""
    if not missing and not unexpected:
        return
    text = mismatch_message(missing, unexpected, checkpoint_dir)
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
        raise CheckpointingException(text)
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL):
        logger.warning(text)


class UnexpectedKeysError(CheckpointingException, CheckpointException):
    """A load under ``ASSUME_OK_UNEXPECTED`` asked for keys the checkpoint lacks.

    Megatron-Core lets the storage layer's error through in that mode, for ``torch_dist`` a
    :class:`torch.distributed.checkpoint.CheckpointException`; distckpt raises this error, which is
    both that type and a :class:`CheckpointingException`, on every rank, naming the keys, the rank
    and the checkpoint. ``failures`` maps each failing rank to its message.
    """

    def __init__(self, msg: str, failures: Optional[dict] = None):
        CheckpointingException.__init__(self, msg)
        self._failures = dict(failures or {})
        self.args = (msg,)

    def __str__(self) -> str:
        return self.args[0]
