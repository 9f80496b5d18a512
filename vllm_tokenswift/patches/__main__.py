"""``python -m vllm_tokenswift.patches``: the plugin's vLLM patches in this vLLM.

Prints each patch's status in the installed vLLM (applied, not needed here, failed with
the reason) and checks the vLLM functions the proposer calls without patching them;
``--source DIR`` checks the same targets statically in an unpacked vLLM source tree.
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
    args = p.parse_args(argv)
    from vllm_tokenswift import patches as plugin
    from vllm_tokenswift.compat import patching as reg

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
    return 1 if bad or probs else 0


if __name__ == "__main__":
    sys.exit(main())
