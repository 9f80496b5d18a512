"""Load a script of ``examples/`` as a module (they are not a package), for tests of its
engine-free parts."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

_EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` imported under the module name ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(_EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
