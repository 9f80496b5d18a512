"""``python -m vllm_tokenswift.kernels``: build (if needed) and load the plugin's CPU kernel (the
attention kernel and the native draft forward, one library) and print its status.

Run at the end of ``scripts/setup.sh`` (CPU target) and in the CPU Docker image's build, so
that the kernel is there before the first engine starts, also where no compiler is. Output,
one ``key: value`` per line (``status`` last)::

    source: .../vllm_tokenswift/kernels/verify_attention.c .../vllm_tokenswift/kernels/draft_forward.c
    path: ~/.cache/vllm-tokenswift/kernels/verify_attention-<key>.so
    status: loaded from ~/.cache/vllm-tokenswift/kernels/verify_attention-<key>.so

Exit status 0 when the kernel loads, or when it does not apply to this machine (not x86-64,
no AVX2/FMA: the status line says so); 1 when it should apply but cannot be built or loaded.

Modes:

``--no-build``
    load a prebuilt file only, never compile (the CPU image's check that its runtime finds
    what its build stage compiled).
``--build-only``
    compile into the cache if the file is missing, without loading it and without the
    AVX2/FMA check (x86-64 only; for an image built on one machine and run on another, and
    for a build stage that has a compiler but no torch).
"""

from __future__ import annotations

import argparse
import sys

from vllm_tokenswift.kernels import build as kb


def main(argv=None) -> int:
    """Entry point; returns the exit status (see the module doc)."""
    p = argparse.ArgumentParser(prog="python -m vllm_tokenswift.kernels",
                                description="Build (if needed) and load the TokenSwift CPU attention "
                                            "kernel, and print its status")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--no-build", action="store_true",
                      help="only load a prebuilt kernel; never run the compiler")
    mode.add_argument("--build-only", action="store_true",
                      help="compile into the cache if missing (x86-64, no CPU-flag check), do not load")
    args = p.parse_args(argv)

    path = kb.kernel_path()
    print(f"source: {' '.join(str(p) for p in kb.KERNEL_SOURCES)}")
    print(f"path: {path}")
    if args.build_only:
        if not kb.is_x86_64():
            print(f"status: not applicable on this platform: {kb.cpu_supports_kernel()}")
            return 0
        if path.is_file():
            print(f"status: built (already there): {path}")
            return 0
        try:
            kb.build_kernel(path)
        except kb.KernelBuildError as e:
            print(f"status: not built: {e}")
            return 1
        print(f"status: built with {kb.compiler()}: {path}")
        return 0
    try:  # load after torch, as in vLLM's processes: the kernel then binds torch's libgomp
        import torch  # noqa: F401
    except ImportError:
        pass
    st = kb.kernel_status(build=not args.no_build)
    print(f"status: {st.line()}")
    if st.state == kb.FAILED:
        print("  vLLM's CPU attention is used instead (correct, but verifying drafts costs more "
              "at long context)", file=sys.stderr)
    return 1 if st.state == kb.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
