"""``examples/train.py`` as a module, for the tests that run its ``main(argv)`` in-process."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

TRAIN_SCRIPT = Path(__file__).parents[2] / "examples" / "train.py"


def load_train_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_script", TRAIN_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script
