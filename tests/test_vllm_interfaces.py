"""For the installed vLLM: every attribute the plugin patches or calls exists, is vLLM's
original (or the plugin's replacement of it), and has the signature the plugin's code
expects. A vLLM release that changes one of them fails here, not in a running engine.

The static checker used for vLLM 0.33 (`python -m vllm_tokenswift.patches --source DIR`,
run against the unpacked 0.33.0 wheel, which cannot run on this CPU) is validated here
against the installed sources and on a synthetic tree with a changed signature.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_tokenswift import patches
from vllm_tokenswift.compat import patching
from vllm_tokenswift.compat import vllm_minor
from vllm_tokenswift.compat.patching import Target, check_source_target, check_target, source_minor

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module", autouse=True)
def _registered():
    patches.register()


def _vllm_root() -> Path:
    import vllm

    return Path(vllm.__file__).resolve().parents[1]


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_patched_attributes_exist_with_expected_signatures(patch):
    problems = [pr for t in patch.targets for pr in check_target(t, patch.name)]
    problems += [pr for t in patch.reads for pr in check_target(t, None)]
    assert problems == []
    rec = patching.RECORDS[patch.name]
    assert rec.status in ("applied", "not-needed"), rec
    if rec.status == "applied":
        for t in patch.targets:  # installed, marked, and the original kept
            owner, name = patching._resolve_owner(t)
            fn = patching._function_of(patching._raw(owner, name), t.kind)
            assert patching.patch_of(fn) == patch.name


def test_proposer_interfaces_exist_with_expected_signatures():
    assert [pr for t in patches.INTERFACES for pr in check_target(t)] == []


def test_every_tokenswift_patch_is_active_here():
    assert patches.runner_patch_active()
    patches.require_patches()
    optional = {"api-server-metrics", "draft-free-sampling", "draft-ids-in-output", "cpu-verify-attention",
                "cpu-recovered-noise"}
    assert set(patches.required_patch_names()) == {p.name for p in patches.PATCHES} - optional


def test_static_checker_agrees_on_the_installed_sources():
    root = _vllm_root()
    assert source_minor(root) == "%d.%d" % vllm_minor()
    targets = [t for p in patches.PATCHES for t in p.targets + p.reads] + list(patches.INTERFACES)
    assert [pr for t in targets for pr in check_source_target(root, t)] == []


def test_static_checker_catches_a_changed_signature(tmp_path):
    (tmp_path / "vllm" / "v1" / "sample" / "ops").mkdir(parents=True)
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    (tmp_path / "vllm" / "v1" / "sample" / "rejection_sampler.py").write_text(
        "from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p\n")
    ops = tmp_path / "vllm" / "v1" / "sample" / "ops" / "topk_topp_sampler.py"
    target = next(t for p in patches.PATCHES for t in p.targets if t.path.endswith(":apply_top_k_top_p"))
    # 0.33 added has_topp_only_rows: the 0.32 signature in a 0.33 tree is a problem
    ops.write_text("def apply_top_k_top_p(logits, k, p):\n    return logits\n")
    assert "signature (logits, k, p) differs" in check_source_target(tmp_path, target)[0]
    ops.write_text("def apply_top_k_top_p(logits, k, p, has_topp_only_rows=True):\n    return logits\n")
    assert check_source_target(tmp_path, target) == []
    ops.write_text("def renamed(logits, k, p):\n    return logits\n")
    assert "missing" in check_source_target(tmp_path, target)[0]
    new = Target("vllm.v1.sample.rejection_sampler:RejectionSampler.stats", "new")
    assert "owner class missing" in check_source_target(tmp_path, new)[0]


@pytest.mark.parametrize("patch", patches.PATCHES, ids=lambda p: p.name)
def test_every_patch_is_documented(patch):
    for field in ("changes", "why", "upstream", "remove_when"):
        assert len(getattr(patch, field)) > 20, field
    assert set(patch.versions) == {"0.32", "0.33"}
    section = README.read_text().split("## Supported vLLM versions and patches", 1)[1].split("\n## ", 1)[0]
    row = [ln for ln in section.splitlines() if ln.startswith(f"| `{patch.name}`")]
    assert len(row) == 1, f"README's patch table has no row for {patch.name}"
    status = re.split(r"\s*(?<!\\)\|\s*", row[0].strip("| "))
    assert len(status) == 6 and all(status), row[0]
