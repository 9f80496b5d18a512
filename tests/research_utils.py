"""Load a research script of ``docs/research/`` as a module (they are not a package), for
tests of its engine-free parts."""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

RESEARCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "research")


def load_research(name: str) -> ModuleType:
    """``docs/research/<name>.py`` imported under the module name ``name``."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(RESEARCH_DIR, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
