"""The fail-closed patch helper (vllm_tokenswift/compat/patching.py) on synthetic targets: it
installs all of a patch or nothing, refuses targets that are not vLLM's original (another
plugin's replacement, a changed signature, a subclass override), is idempotent, and
`require` names every missing patch."""

from __future__ import annotations

import sys
import types

import pytest

from vllm_tokenswift.compat import patching as patches
from vllm_tokenswift.compat.patching import Patch, PatchRecord, Target, TokenSwiftPatchError

MOD = "tokenswift_fake_vllm"


@pytest.fixture
def fake(monkeypatch):
    """A throwaway module standing in for a vLLM module, plus a clean record."""
    m = types.ModuleType(MOD)
    src = '''
def helper(x, y=1):
    return x + y

class Runner:
    def step(self, out):
        return ("orig", out)

    @staticmethod
    def penalties(logits):
        return ("orig", logits)

    @property
    def lookahead(self):
        return 0

class CpuRunner(Runner):
    pass
'''
    exec(compile(src, MOD + ".py", "exec"), m.__dict__)
    for obj in (m.helper, m.Runner.step, m.Runner.__dict__["penalties"].__func__,
                m.Runner.__dict__["lookahead"].fget):
        obj.__module__ = MOD
    m.Runner.__module__ = m.CpuRunner.__module__ = MOD
    monkeypatch.setitem(sys.modules, MOD, m)
    saved = dict(patches.RECORDS)
    patches.RECORDS.clear()
    yield m
    patches.RECORDS.clear()
    patches.RECORDS.update(saved)


def _patch(name="p", required=True, targets=None, build=None, **kw):
    targets = targets or (
        Target(f"{MOD}:Runner.step", "method", f"{MOD}.Runner.step", ("self", "out")),
        Target(f"{MOD}:Runner.penalties", "staticmethod", f"{MOD}.Runner.penalties", ("logits",)),
    )

    def default_build(orig):
        def step(self, out):
            return ("ours", orig[f"{MOD}:Runner.step"](self, out))

        def penalties(logits):
            return ("ours", logits)

        return {f"{MOD}:Runner.step": step, f"{MOD}:Runner.penalties": penalties}

    return Patch(name=name, targets=targets, build=build or default_build, changes="c", why="w",
                 upstream="u", remove_when="r", required=required, **kw)


def test_applies_all_targets_and_is_idempotent(fake):
    p = _patch()
    rec = patches.apply(p, platform="cpu")
    assert (rec.status, rec.detail) == ("applied", "")
    r = fake.Runner()
    assert r.step(1) == ("ours", ("orig", 1)) and fake.Runner.penalties(2) == ("ours", 2)
    assert isinstance(fake.Runner.__dict__["penalties"], staticmethod)
    assert patches.patch_of(fake.Runner.step) == "p"
    assert patches.original_of(fake.Runner.step)(r, 3) == ("orig", 3)
    # a second application (another vLLM process-level plugin load) changes nothing
    assert patches.apply(p, platform="cpu").detail == "already applied"
    assert r.step(1) == ("ours", ("orig", 1))
    # the targets still pass the signature check through the replacement
    assert all(patches.check_target(t, "p", "cpu") == [] for t in p.targets)


def test_foreign_replacement_is_refused_and_nothing_installed(fake):
    def other_plugin_step(self, out):
        return "other"

    fake.Runner.step = other_plugin_step  # e.g. another plugin patched it first
    rec = patches.apply(_patch(), platform="cpu")
    assert rec.status == "failed"
    assert "<locals>.other_plugin_step, not vLLM" in rec.detail
    assert f"not vLLM's {MOD}.Runner.step" in rec.detail
    # all or nothing: the other target was not touched either
    assert fake.Runner.penalties(2) == ("orig", 2)


def test_changed_signature_is_refused(fake):
    t = Target(f"{MOD}:helper", "function", f"{MOD}.helper", ("x",))
    rec = patches.apply(_patch(targets=(t,), build=lambda o: {t.path: lambda x: x}), platform="cpu")
    assert rec.status == "failed" and "signature (x, y) differs from the expected (x)" in rec.detail
    assert fake.helper(1) == 2
    # per-series signatures: the installed series' tuple must match
    t2 = Target(f"{MOD}:helper", "function", f"{MOD}.helper", {"0.32": ("x", "y"), "0.33": ("x", "y", "z")})
    assert patches.check_target(t2, "p", "cpu") == []  # the installed vLLM is 0.32


def test_wrong_kind_missing_target_and_subclass_override(fake):
    bad_kind = Target(f"{MOD}:Runner.step", "staticmethod", f"{MOD}.Runner.step", ("self", "out"))
    assert "expected a staticmethod, found function" in patches.check_target(bad_kind, "p", "cpu")[0]
    gone = Target(f"{MOD}:Runner.gone", "method", f"{MOD}.Runner.gone", ("self",))
    assert "missing (vLLM no longer defines it)" in patches.check_target(gone, "p", "cpu")[0]
    t = Target(f"{MOD}:Runner.step", "method", f"{MOD}.Runner.step", ("self", "out"),
               (("cpu", f"{MOD}:CpuRunner"),))
    assert patches.check_target(t, "p", "cpu") == []

    def step(self, out):
        return "cpu"

    fake.CpuRunner.step = step
    assert "CpuRunner overrides step" in patches.check_target(t, "p", "cpu")[0]
    assert patches.check_target(t, "p", "cuda") == []  # only checked where that runner is used


def test_property_and_new_attribute(fake):
    prop = Target(f"{MOD}:Runner.lookahead", "property", f"{MOD}.Runner.lookahead", ("self",))
    new = Target(f"{MOD}:Runner.stats", "new")

    def build(orig):
        fget = orig[prop.path]

        def lookahead(self):
            return fget(self) + 1

        def stats(self):
            return "stats"

        return {prop.path: lookahead, new.path: stats}

    rec = patches.apply(_patch(targets=(prop, new), build=build), platform="cpu")
    assert rec.status == "applied"
    assert fake.Runner().lookahead == 1 and fake.Runner().stats() == "stats"
    # a name vLLM (or another plugin) already defines is refused
    clash = Target(f"{MOD}:Runner.step", "new")
    assert "already defined by vLLM or another plugin" in patches.check_target(clash, "q", "cpu")[0]


def test_failed_install_rolls_back(fake):
    t1 = Target(f"{MOD}:Runner.step", "method", f"{MOD}.Runner.step", ("self", "out"))
    t2 = Target(f"{MOD}:helper", "function", f"{MOD}.helper", ("x", "y"))

    class Unsettable:
        def __setattr__(self, k, v):
            raise TypeError("cannot mark this replacement")

    rec = patches.apply(_patch(targets=(t1, t2), build=lambda o: {t1.path: lambda self, out: 0,
                                                                   t2.path: Unsettable()}), platform="cpu")
    assert rec.status == "failed" and "installing raised TypeError" in rec.detail
    assert fake.Runner().step(1) == ("orig", 1) and fake.helper(1) == 2


def test_platform_and_precondition_mean_not_needed(fake):
    rec = patches.apply(_patch(platforms=frozenset({"cpu"})), platform="cuda")
    assert (rec.status, rec.detail) == ("not-needed", "only on cpu")
    rec = patches.apply(_patch(name="q", when=lambda: "no API server in this process"), platform="cpu")
    assert rec.status == "not-needed" and fake.Runner().step(1) == ("orig", 1)
    patches.require(["p", "q"])  # not-needed counts as satisfied


def test_require_names_every_missing_patch(fake):
    patches.RECORDS["a"] = PatchRecord("a", "applied")
    patches.RECORDS["b"] = PatchRecord("b", "failed", "signature changed")
    patches.RECORDS["c"] = PatchRecord("c", "failed", "optional one", required=False)
    with pytest.raises(TokenSwiftPatchError) as ei:
        patches.require(["a", "b", "never"], "TokenSwift")
    msg = str(ei.value)
    assert "2 vLLM patch(es)" in msg and "  - b: signature changed" in msg
    assert "  - never: never applied in this process" in msg and "  - a:" not in msg
    assert [r.name for r in patches.missing()] == ["b"]  # required ones only
