"""``python -m vllm_tokenswift.patches``: the plugin's vLLM patches in this vLLM.

Prints each patch's status in the installed vLLM (applied, not needed here, failed with
the reason) and checks the vLLM functions the proposer calls without patching them;
``--source DIR`` checks the same targets statically in an unpacked vLLM source tree;
``--markdown`` prints the README's table of patches from the records. The last line is
the CPU attention kernel's status (loaded from PATH, not loaded and why, or not applicable
on this platform; ``not checked`` with ``--source``).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv=None) -> int:
    """``python -m vllm_tokenswift.patches [--source DIR]``: each patch's status (or the
    static check of an unpacked source tree) and the proposer's vLLM interfaces; exit
    status 1 on a problem."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m vllm_tokenswift.patches",
                                description="Show the plugin's vLLM patches and check their targets")
    p.add_argument("--source", help="check statically against an unpacked vLLM source tree "
                                    "(the folder that contains vllm/) instead of the installed vLLM")
    p.add_argument("--markdown", action="store_true",
                   help="print the README's table of patches, generated from the Patch records")
    args = p.parse_args(argv)
    from vllm_tokenswift import patches as plugin
    from vllm_tokenswift.compat import patching as reg

    if args.markdown:
        print(plugin.markdown_table(), end="")
        return 0

    bad = 0
    if args.source:
        root = Path(args.source)
        print(f"vLLM source tree {root} (series {reg.source_minor(root)})")
        for patch in plugin.PATCHES:
            probs = []
            for t in patch.targets + patch.reads:
                probs += reg.check_source_target(root, t)
            bad += bool(probs)
            print(f"{patch.name:24s} {'OK' if not probs else 'PROBLEM'}")
            for pr in probs:
                print(f"    {pr}")
        probs = []
        for t in plugin.INTERFACES:
            probs += reg.check_source_target(root, t)
        bad += bool(probs)
        print(f"{'(proposer interfaces)':24s} {'OK' if not probs else 'PROBLEM'}")
        for pr in probs:
            print(f"    {pr}")
        print(f"{KERNEL_LABEL:24s} not checked (--source checks a vLLM source tree, not this machine)")
        return 1 if bad else 0
    plugin.register()
    from vllm_tokenswift.compat import vllm_version

    print(f"installed vLLM {vllm_version()}")
    for patch in plugin.PATCHES:
        r = reg.RECORDS.get(patch.name)
        status = r.status if r else "never applied"
        print(f"{patch.name:24s} {status:11s} {'required' if patch.required else 'optional':8s} "
              f"{r.detail if r else ''}")
        bad += bool(r is None or (r.status == "failed" and patch.required))
    probs = [pr for t in plugin.INTERFACES for pr in reg.check_target(t)]
    print(f"{'(proposer interfaces)':24s} {'OK' if not probs else 'PROBLEM'}")
    for pr in probs:
        print(f"    {pr}")
    attn = reg.RECORDS.get("cpu-verify-attention")
    print(f"{KERNEL_LABEL:24s} {kernel_line(attn.status == 'not-needed' if attn else False)}")
    return 1 if bad or probs else 0


#: the label of the attention kernel's status line
KERNEL_LABEL = "(cpu attention kernel)"


def kernel_line(other_platform: bool) -> str:
    """The CPU attention kernel's status in one line: ``loaded from PATH``, ``not loaded:
    WHY`` or ``not applicable on this platform: WHY`` (``other_platform``: vLLM's platform is
    not its CPU backend, where the ``cpu-verify-attention`` patch is not needed). Loads a
    prebuilt kernel but never compiles one: where none is built yet it says what an engine
    would do (``python -m vllm_tokenswift.kernels`` builds it). Does not change the exit
    status (the patch is optional)."""
    from vllm_tokenswift.kernels import build as kb

    if other_platform:
        return "not applicable on this platform: the kernel serves vLLM's CPU backend only"
    why = kb.cpu_supports_kernel()
    if why is not None:
        return f"not applicable on this platform: {why}"
    path = kb.kernel_path()
    if not path.is_file():
        import shutil

        cc = kb.compiler()
        if shutil.which(cc) is None:
            return (f"not loaded: not built at {path} and no C compiler ({cc!r} not found): vLLM's CPU "
                    f"attention runs instead")
        return (f"not loaded: not built yet at {path} (an engine compiles it with {cc!r} at first use; "
                f"`python -m vllm_tokenswift.kernels` builds it now)")
    import torch  # noqa: F401  (load after torch, as in vLLM: the kernel binds torch's libgomp)

    return kb.kernel_status(build=False).line()


if __name__ == "__main__":
    sys.exit(main())
