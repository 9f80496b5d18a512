"""The CPU attention kernel is shipped prebuilt and its status is reported (issue 57 item 5).

* On CI's machine the set-up (``scripts/setup.sh`` → ``python -m vllm_tokenswift.kernels``)
  leaves the kernel built in the default cache before any test runs: a process that cannot
  compile (``CC=/nonexistent-cc``, ``--no-build``) loads it from there.
* Without a compiler and without a prebuilt file the status command says why and exits 1;
  where the kernel cannot run on the CPU it says "not applicable" and exits 0.
* A file built under one compiler name is found under another (the image's build stage has
  gcc, its runtime no compiler at all).
* ``python -m vllm_tokenswift.patches`` ends with the kernel's status line.
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from vllm_tokenswift.kernels import build as kb
from vllm_tokenswift.kernels.__main__ import main as kernels_main
from vllm_tokenswift.patches import __main__ as patches_main

ROOT = Path(__file__).resolve().parent.parent
#: when this module was imported: at collection, before any test of the session ran (xdist
#: workers all collect before the first test is handed out)
IMPORTED_AT = time.time()


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """This process's kernel state forgotten (restored after the test) and an empty cache."""
    for name, value in (("_loaded", False), ("_kernel", None), ("_kernel_error", None), ("_status", None)):
        monkeypatch.setattr(kb, name, value)
    monkeypatch.setenv("VLLM_TOKENSWIFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def test_setup_left_the_kernel_prebuilt():
    """What ``scripts/setup.sh`` guarantees (it ends with ``python -m vllm_tokenswift.kernels``):
    the kernel for this source is in the cache this environment uses, built before the test
    session, and loads in a process that could not compile it."""
    env = dict(os.environ, CC="/nonexistent-cc")
    r = subprocess.run([sys.executable, "-m", "vllm_tokenswift.kernels", "--no-build"], env=env,
                       capture_output=True, text=True, timeout=300)
    why = kb.cpu_supports_kernel()
    if why is not None:
        assert r.returncode == 0 and f"status: not applicable on this platform: {why}" in r.stdout, r.stdout
        pytest.skip(why)
    path = kb.kernel_path()
    assert path.parent == kb.kernel_cache_dir()
    assert r.returncode == 0 and f"status: loaded from {path}\n" in r.stdout, (
        f"the kernel is not prebuilt at {path}: run scripts/setup.sh (or `python -m "
        f"vllm_tokenswift.kernels`)\n{r.stdout}{r.stderr}")
    assert path.stat().st_mtime <= IMPORTED_AT, (
        f"{path} was built during this test session, not by the set-up: scripts/setup.sh must "
        f"build it (`python -m vllm_tokenswift.kernels`)")


def test_setup_sh_builds_the_kernel_on_cpu_only():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    block = text[text.index('if [ "$TARGET" = cpu ]; then\n  "$VPY" -m vllm_tokenswift.kernels'):]
    assert block.splitlines()[2].strip() == "fi", block
    assert text.rstrip().endswith("fi")                      # the last step of the set-up


def test_no_compiler_and_an_empty_cache(fresh_kernel, monkeypatch, capsys):
    monkeypatch.setenv("CC", "/nonexistent-cc")
    if kb.cpu_supports_kernel() is not None:
        pytest.skip(kb.cpu_supports_kernel())
    assert kernels_main([]) == 1
    out = capsys.readouterr()
    assert ("status: not loaded: the verification kernel could not be built or loaded: no C compiler: "
            "'/nonexistent-cc' was not found") in out.out
    assert "vLLM's CPU attention is used instead" in out.err
    st = kb.kernel_status()
    assert st.state == kb.FAILED and kb.load_kernel() is None and "no C compiler" in kb.kernel_error()
    assert not fresh_kernel.exists() or not any(fresh_kernel.iterdir())   # nothing half-built left


def test_built_under_one_compiler_name_found_under_another(fresh_kernel, monkeypatch, capsys):
    """``--build-only`` (the image's build stage, with gcc) then ``--no-build`` under a
    compiler that does not exist (its runtime): the same path, loaded."""
    if kb.cpu_supports_kernel() is not None:
        pytest.skip(kb.cpu_supports_kernel())
    assert kernels_main(["--build-only"]) == 0
    path = kb.kernel_path()
    assert path.is_file() and f"status: built with {kb.compiler()}: {path}" in capsys.readouterr().out
    monkeypatch.setenv("CC", "/nonexistent-cc")
    assert kb.kernel_path() == path
    assert kernels_main(["--no-build"]) == 0
    assert f"status: loaded from {path}\n" in capsys.readouterr().out
    assert kernels_main(["--build-only"]) == 0                 # already there: nothing to do
    assert "built (already there)" in capsys.readouterr().out


def test_not_applicable_on_this_cpu_exits_zero(fresh_kernel, monkeypatch, capsys):
    monkeypatch.setattr(kb, "cpu_supports_kernel", lambda: "the CPU lacks avx2")
    assert kernels_main([]) == 0
    assert "status: not applicable on this platform: the CPU lacks avx2" in capsys.readouterr().out
    assert kb.kernel_status().state == kb.NOT_APPLICABLE


def test_patches_command_reports_the_kernel(fresh_kernel, monkeypatch):
    """The status line of ``python -m vllm_tokenswift.patches`` in each case; it never
    compiles."""
    monkeypatch.setenv("CC", "/nonexistent-cc")
    assert patches_main.kernel_line(True) == \
        "not applicable on this platform: the kernel serves vLLM's CPU backend only"
    if kb.cpu_supports_kernel() is not None:
        assert patches_main.kernel_line(False).startswith("not applicable on this platform: ")
        return
    path = kb.kernel_path()
    assert patches_main.kernel_line(False) == (f"not loaded: not built at {path} and no C compiler "
                                               f"('/nonexistent-cc' not found): vLLM's CPU attention runs instead")
    monkeypatch.setenv("CC", "cc")
    assert "not built yet" in patches_main.kernel_line(False) and not path.exists()
    kb.build_kernel(path)
    assert patches_main.kernel_line(False) == f"loaded from {path}"
    monkeypatch.setattr(kb, "cpu_supports_kernel", lambda: "the CPU lacks fma")
    assert patches_main.kernel_line(False) == "not applicable on this platform: the CPU lacks fma"


def test_patches_command_prints_the_kernel_line_last(capsys, monkeypatch, tmp_path):
    """Both modes end with the kernel's line (the patches themselves are left out here:
    applying and checking them is tests/test_patches.py's and test_vllm_interfaces.py's)."""
    from vllm_tokenswift import patches as plugin

    monkeypatch.setattr(plugin, "register", lambda: None)
    monkeypatch.setattr(plugin, "PATCHES", ())
    monkeypatch.setattr(plugin, "INTERFACES", ())
    assert patches_main.main([]) == 0
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert last.startswith(patches_main.KERNEL_LABEL)
    if kb.cpu_supports_kernel() is None:
        assert last.split(None, 3)[-1] == f"loaded from {kb.kernel_path()}", last
    patches_main.main(["--source", str(tmp_path)])
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert last.startswith(patches_main.KERNEL_LABEL) and last.endswith(
        "not checked (--source checks a vLLM source tree, not this machine)")


def test_a_wheel_ships_the_kernel_source():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    for src in kb.KERNEL_SOURCES:
        rel = src.relative_to(ROOT / "vllm_tokenswift").as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in data["vllm_tokenswift"]), (rel, data)
