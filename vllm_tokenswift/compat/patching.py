"""A typed, fail-closed monkey-patch helper and the record of what was applied.

Every change the plugin makes to vLLM goes through :func:`apply`, in the spirit of
Arctic Inference's ``ArcticPatch`` and vllm-ascend's patch registry:

* A :class:`Patch` names its :class:`Target` attributes (``"module:Class.attr"``),
  what each one must be *before* patching (the original's ``module.qualname``, its
  kind and its parameter names) and documents what it changes, why, the upstream
  status and when it can be removed.
* :func:`apply` checks every target first (still vLLM's original, or already ours;
  same kind; same signature; not overridden by a subclass the platform uses) and
  installs all of a patch's replacements or none of them. The outcome is recorded
  in :data:`RECORDS` (``applied``, ``not-needed`` on another platform or process,
  ``failed`` with the reason).
* :func:`require` raises :class:`TokenSwiftPatchError` naming every patch a
  TokenSwift engine relies on that is not active, so the engine refuses to start
  instead of running with, say, min_p silently ignored in verification. Engines
  without TokenSwift never call it: a failed patch leaves vLLM's original in place.

The patches themselves live in :mod:`vllm_tokenswift.patches`, one module per vLLM subsystem
(:mod:`~vllm_tokenswift.patches.engine_args`, :mod:`~vllm_tokenswift.patches.runner`,
:mod:`~vllm_tokenswift.patches.sampling`, :mod:`~vllm_tokenswift.patches.outputs`,
:mod:`~vllm_tokenswift.patches.api_metrics`, :mod:`~vllm_tokenswift.patches.attention`),
each holding its :class:`Patch` records next to their replacement functions;
:mod:`vllm_tokenswift.patches` lists them in application order and declares which ones a
TokenSwift engine requires (:func:`declare_required`, checked by :func:`require_declared`).
This module imports nothing from the rest of the package: the layers above it (kernels,
engine, patches) import it, never the other way.

``python -m vllm_tokenswift.patches`` prints the record for the installed vLLM;
``--source DIR`` checks the targets statically against an unpacked vLLM source tree
(how the vLLM 0.33 wheel, which cannot run on CPU, was checked).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

logger = logging.getLogger("vllm_tokenswift")

Kind = Literal["function", "method", "staticmethod", "classmethod", "property", "new"]
Status = Literal["applied", "not-needed", "failed"]

#: Marker set on every replacement the plugin installs (value: the patch name).
MARKER = "_tokenswift_patch"
#: Attribute of a replacement holding the function it replaced.
ORIGINAL = "_tokenswift_original"


class TokenSwiftPatchError(RuntimeError):
    """A patch a TokenSwift engine relies on is not active in this process."""


@dataclass(frozen=True)
class Target:
    """One attribute a patch replaces (or adds).

    Attributes:
        path: ``"package.module:Attr"`` or ``"package.module:Class.attr"``.
        kind: how the attribute is stored: a module-level ``function``; a class's
            plain ``method``, ``staticmethod``, ``classmethod`` or ``property`` (its
            getter is the function); ``new`` for an attribute the plugin adds
            (it must not exist yet).
        origin: ``module.qualname`` of vLLM's original function (for a name imported
            into another module, where it was defined). ``None`` for ``new``.
        params: the original's parameter names, in order; or a dict from minor series
            (``"0.32"``, ``"0.33"``) to the names in that series when vLLM changed them.
            The replacement is written against exactly these signatures; any other
            fails the patch.
        not_overridden_by: ``(platform, "module:Class")`` pairs: on that platform
            (``"cpu"``, ``"cuda"``, ...) the class, a subclass the platform uses, must
            inherit the attribute, or the patch would never be reached.
    """

    path: str
    kind: Kind
    origin: str | None = None
    params: tuple[str, ...] | dict | None = None
    not_overridden_by: tuple[tuple[str, str], ...] = ()

    def expected_params(self, minor: str | None) -> list[tuple[str, ...]] | None:
        """Accepted parameter-name tuples for vLLM ``minor`` (``"0.33"``); for a series
        the target does not list, any listed one."""
        if self.params is None:
            return None
        if isinstance(self.params, dict):
            if minor in self.params:
                return [tuple(self.params[minor])]
            return [tuple(v) for v in self.params.values()]
        return [tuple(self.params)]

    @property
    def module(self) -> str:
        return self.path.split(":", 1)[0]

    @property
    def attr_path(self) -> list[str]:
        return self.path.split(":", 1)[1].split(".")


@dataclass(frozen=True)
class Patch:
    """A named change to vLLM: its targets, the replacement builder and its record.

    Attributes:
        name: short stable name (used in errors, logs and the README).
        targets: the attributes replaced together (all or none).
        build: ``build(originals) -> {target.path: replacement}``; ``originals`` maps
            each target's path to vLLM's original function (``None`` for ``new``).
            Replacements are plain functions; the helper wraps them back into
            ``staticmethod``/``classmethod``/``property`` as the target's kind says.
        changes: what the patch changes.
        why: why TokenSwift needs it.
        upstream: upstream status (issue/PR, or "none filed").
        remove_when: when the patch can be removed.
        versions: per supported minor series (``"0.32"``, ``"0.33"``), what was
            checked and what changed.
        required: whether a TokenSwift engine relies on it (refuses to start without).
        platforms: platforms it applies to (``None``: all); elsewhere ``not-needed``.
        when: optional predicate; if it returns a string, the patch is recorded as
            ``not-needed`` with that reason (e.g. no API server in this process).
        reads: further vLLM attributes the replacements call or read (checked like
            targets by :func:`check_target` and the tests, never replaced).
    """

    name: str
    targets: tuple[Target, ...]
    build: Callable[[dict], dict]
    changes: str
    why: str
    upstream: str
    remove_when: str
    versions: dict = field(default_factory=dict)
    required: bool = True
    platforms: frozenset | None = None
    when: Callable[[], str | None] | None = None
    reads: tuple[Target, ...] = ()


@dataclass
class PatchRecord:
    """Outcome of :func:`apply` for one patch in this process."""

    name: str
    status: Status
    detail: str = ""
    required: bool = True


#: patch name -> record, in application order (this process only).
RECORDS: dict[str, PatchRecord] = {}
_lock = threading.RLock()


# ------------------------------------------------------------------ resolution
def _current_platform() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(getattr(current_platform, "device_type", "") or "other")


def _installed_minor() -> str | None:
    try:
        from vllm_tokenswift.compat import vllm_minor

        return "%d.%d" % vllm_minor()
    except Exception:  # noqa: BLE001 - no vLLM importable: accept any listed signature
        return None


def _resolve_owner(target: Target):
    """The object holding the attribute (module or class) and the attribute name."""
    obj = importlib.import_module(target.module)
    parts = target.attr_path
    for p in parts[:-1]:
        obj = getattr(obj, p)
    return obj, parts[-1]


def _raw(owner, name: str):
    """The stored attribute: a class's own ``__dict__`` entry (so staticmethod and
    property objects are seen as such), or a module attribute."""
    if inspect.isclass(owner):
        return owner.__dict__.get(name, _MISSING)
    return getattr(owner, name, _MISSING)


_MISSING = object()


def _function_of(raw, kind: Kind):
    """The function inside a stored attribute of ``kind`` or None if it is not one."""
    if kind in ("function", "method"):
        return raw if inspect.isfunction(raw) else None
    if kind == "staticmethod":
        return raw.__func__ if isinstance(raw, staticmethod) else None
    if kind == "classmethod":
        return raw.__func__ if isinstance(raw, classmethod) else None
    if kind == "property":
        return raw.fget if isinstance(raw, property) else None
    return raw if callable(raw) else None


def _wrap(fn, kind: Kind, raw_original):
    if kind == "staticmethod":
        return staticmethod(fn)
    if kind == "classmethod":
        return classmethod(fn)
    if kind == "property":
        return property(fn, doc=getattr(raw_original, "__doc__", None))
    return fn


def patch_of(fn) -> str | None:
    """The name of the patch that installed ``fn`` (None for vLLM's own code)."""
    return getattr(fn, MARKER, None)


def original_of(fn):
    """vLLM's original behind a replacement (``fn`` itself if it is not ours)."""
    while getattr(fn, ORIGINAL, None) is not None:
        fn = getattr(fn, ORIGINAL)
    return fn


def check_target(target: Target, patch_name: str | None = None, platform: str | None = None) -> list[str]:
    """Problems that would make patching ``target`` unsafe in this process (empty: OK).

    Checks, for the installed vLLM: the attribute exists with the expected kind; it is
    vLLM's original (``origin``) or this plugin's replacement for ``patch_name``; the
    original's parameter names equal ``params``; no class in ``not_overridden_by``
    (for this platform) overrides it. A ``new`` target must not exist yet (or be ours).
    """
    try:
        owner, name = _resolve_owner(target)
    except (ImportError, AttributeError) as e:
        return [f"{target.path}: cannot import ({type(e).__name__}: {e})"]
    raw = _raw(owner, name)
    problems: list[str] = []
    if target.kind == "new":
        if raw is not _MISSING and patch_of(_function_of(raw, "new")) is None:
            problems.append(f"{target.path}: already defined by vLLM or another plugin ({raw!r})")
        return problems
    if raw is _MISSING:
        return [f"{target.path}: missing (vLLM no longer defines it)"]
    fn = _function_of(raw, target.kind)
    if fn is None:
        return [f"{target.path}: expected a {target.kind}, found {type(raw).__name__}"]
    mine = patch_of(fn)
    if mine is not None and patch_name is not None and mine != patch_name:
        problems.append(f"{target.path}: already replaced by this plugin's patch {mine!r}")
    orig = original_of(fn)
    found = f"{getattr(orig, '__module__', '?')}.{getattr(orig, '__qualname__', '?')}"
    if target.origin is not None and found != target.origin:
        problems.append(f"{target.path}: is {found}, not vLLM's {target.origin} "
                        "(replaced by another plugin or moved by vLLM)")
    want = target.expected_params(_installed_minor())
    if want is not None:
        try:
            got = tuple(inspect.signature(orig).parameters)
        except (TypeError, ValueError) as e:
            got = (f"<no signature: {e}>",)
        if got not in want:
            problems.append(f"{target.path}: signature ({', '.join(got)}) differs from the expected "
                            f"({' | '.join(', '.join(w) for w in want)})")
    plat = platform
    for where, cls_path in target.not_overridden_by:
        if plat is None:
            try:
                plat = _current_platform()
            except Exception as e:  # noqa: BLE001 - reported as a problem
                return problems + [f"cannot determine the platform: {e}"]
        if where != plat:
            continue
        mod, _, qual = cls_path.partition(":")
        try:
            cls = importlib.import_module(mod)
            for p in qual.split("."):
                cls = getattr(cls, p)
        except (ImportError, AttributeError) as e:
            problems.append(f"{cls_path}: cannot import ({e})")
            continue
        if name in cls.__dict__:
            problems.append(f"{cls_path} overrides {name}: the patch of {target.path} would be bypassed")
    return problems


# ------------------------------------------------------------------ application
def apply(patch: Patch, *, platform: str | None = None) -> PatchRecord:
    """Check and install ``patch`` (idempotent; all targets or none). Never raises:
    the outcome is recorded in :data:`RECORDS` and returned."""
    with _lock:
        rec = _apply_locked(patch, platform)
        RECORDS[patch.name] = rec
        if rec.status == "failed":
            log = logger.error if patch.required else logger.warning
            log("vllm-tokenswift: patch %r not applied: %s%s", patch.name, rec.detail,
                " (TokenSwift engines will refuse to start; other engines are unaffected)"
                if patch.required else "")
        return rec


def _apply_locked(patch: Patch, platform: str | None) -> PatchRecord:
    req = patch.required
    try:
        plat = platform or (_current_platform() if patch.platforms is not None
                            or any(t.not_overridden_by for t in patch.targets) else None)
    except Exception as e:  # noqa: BLE001
        return PatchRecord(patch.name, "failed", f"cannot determine the platform: {e}", req)
    if patch.platforms is not None and plat not in patch.platforms:
        return PatchRecord(patch.name, "not-needed", f"only on {', '.join(sorted(patch.platforms))}", req)
    if patch.when is not None:
        try:
            reason = patch.when()
        except Exception as e:  # noqa: BLE001
            return PatchRecord(patch.name, "failed", f"precondition raised {type(e).__name__}: {e}", req)
        if reason:
            return PatchRecord(patch.name, "not-needed", reason, req)
    problems: list[str] = []
    for t in patch.targets:
        problems += check_target(t, patch.name, plat)
    for t in patch.reads:  # read, never replaced: may already be another patch's replacement
        problems += check_target(t, None, plat)
    if problems:
        return PatchRecord(patch.name, "failed", "; ".join(problems), req)
    resolved = []
    ours = 0
    for t in patch.targets:
        owner, name = _resolve_owner(t)
        raw = _raw(owner, name)
        fn = None if raw is _MISSING else _function_of(raw, t.kind)
        if fn is not None and patch_of(fn) == patch.name:
            ours += 1
        resolved.append((t, owner, name, raw, fn))
    if ours == len(patch.targets):
        return PatchRecord(patch.name, "applied", "already applied", req)
    if ours:
        return PatchRecord(patch.name, "failed", "partly applied earlier (inconsistent state)", req)
    originals = {t.path: fn for t, _, _, _, fn in resolved}
    try:
        repl = patch.build(originals)
    except Exception as e:  # noqa: BLE001
        return PatchRecord(patch.name, "failed", f"building the replacement raised {type(e).__name__}: {e}", req)
    if set(repl) != {t.path for t in patch.targets}:
        return PatchRecord(patch.name, "failed", "replacement does not cover exactly its targets", req)
    done = []
    try:
        for t, owner, name, raw, fn in resolved:
            new = repl[t.path]
            setattr(new, MARKER, patch.name)
            setattr(new, ORIGINAL, fn)
            setattr(owner, name, _wrap(new, t.kind, raw))
            done.append((owner, name, raw))
    except Exception as e:  # noqa: BLE001 - roll back what was installed
        for owner, name, raw in reversed(done):
            if raw is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, raw)
        return PatchRecord(patch.name, "failed", f"installing raised {type(e).__name__}: {e}", req)
    return PatchRecord(patch.name, "applied", "", req)


def record_skipped(patch: Patch, reason: str) -> None:
    """Record ``patch`` as not applied (e.g. unsupported vLLM version)."""
    with _lock:
        RECORDS[patch.name] = PatchRecord(patch.name, "failed", reason, patch.required)


def missing(names=None) -> list[PatchRecord]:
    """Records of required patches (or of ``names``) that are not active here.
    A patch never attempted in this process counts as missing."""
    with _lock:
        if names is None:
            return [r for r in RECORDS.values() if r.required and r.status == "failed"]
        out = []
        for n in names:
            r = RECORDS.get(n)
            if r is None:
                out.append(PatchRecord(n, "failed", "never applied in this process (plugin not loaded?)"))
            elif r.status == "failed":
                out.append(r)
        return out


def require(names, what: str = "TokenSwift") -> None:
    """Raise :class:`TokenSwiftPatchError` unless every patch in ``names`` is applied
    (or not needed here). The message names each missing patch and its reason."""
    bad = missing(names)
    if bad:
        lines = "\n".join(f"  - {r.name}: {r.detail}" for r in bad)
        raise TokenSwiftPatchError(
            f"{what} cannot start: {len(bad)} vLLM patch(es) it relies on are not active "
            f"in this process:\n{lines}\nOutputs would silently differ from plain decoding "
            "without them. Check the vLLM version (vllm_tokenswift/compat.py) and other "
            "plugins that patch the same functions.")


#: names of the patches a TokenSwift engine requires, set by :mod:`vllm_tokenswift.patches`
#: when it is imported (None: the plugin was never imported in this process)
_REQUIRED: tuple[str, ...] | None = None


def declare_required(names) -> None:
    """Set the names of the patches a TokenSwift engine requires (the plugin's table)."""
    global _REQUIRED
    _REQUIRED = tuple(names)


def required_names() -> list[str]:
    """The names set by :func:`declare_required` (empty before the plugin is imported)."""
    return list(_REQUIRED or ())


def require_declared(what: str = "TokenSwift") -> None:
    """:func:`require` for every patch the plugin declared required.

    Raises:
        TokenSwiftPatchError: a required patch is not active here, or the plugin
            (:mod:`vllm_tokenswift.patches`) was never imported in this process.
    """
    if _REQUIRED is None:
        raise TokenSwiftPatchError(
            f"{what} cannot start: the vllm-tokenswift plugin is not loaded in this process "
            "(vllm_tokenswift.patches was never imported; check VLLM_PLUGINS)")
    require(_REQUIRED, what)


# ------------------------------------------------------------------ static check of a source tree
def _find_def(tree: ast.AST, dotted: list[str]):
    node = tree
    for part in dotted:
        found = None
        for n in ast.iter_child_nodes(node):
            if getattr(n, "name", None) == part and isinstance(
                    n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found = n
            elif isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == part for a in n.names):
                found = n
            elif isinstance(n, ast.Assign) and any(getattr(t, "id", None) == part for t in n.targets):
                found = n
        if found is None:
            return None
        node = found
    return node


def _ast_params(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return tuple(names)


def _ast_kind(fn: ast.FunctionDef, in_class: bool) -> str:
    decos = {getattr(d, "id", getattr(d, "attr", None)) for d in fn.decorator_list}
    if not in_class:
        return "function"
    for k in ("staticmethod", "classmethod", "property"):
        if k in decos:
            return k
    return "method"


def source_minor(root: Path) -> str | None:
    """``"0.33"`` from an unpacked tree's ``vllm/_version.py`` (None if absent)."""
    f = root / "vllm" / "_version.py"
    if not f.is_file():
        return None
    import re

    m = re.search(r"__version__\s*=\s*(?:version\s*=\s*)?['\"](\d+)\.(\d+)", f.read_text())
    return f"{m.group(1)}.{m.group(2)}" if m else None


def check_source_target(root: Path, target: Target, _depth: int = 0) -> list[str]:
    """Static version of :func:`check_target` against an unpacked vLLM source tree
    ``root`` (the folder holding ``vllm/``): the attribute exists with the expected
    kind, origin module and parameter names. Follows ``from X import name``."""
    mod_file = root / (target.module.replace(".", "/") + ".py")
    if not mod_file.is_file():
        mod_file = root / target.module.replace(".", "/") / "__init__.py"
    if not mod_file.is_file():
        return [f"{target.path}: module file missing"]
    tree = ast.parse(mod_file.read_text())
    parts = target.attr_path
    node = _find_def(tree, parts)
    if target.kind == "new":
        owner = _find_def(tree, parts[:-1])
        if owner is None:
            return [f"{target.path}: owner class missing"]
        return [f"{target.path}: already defined upstream"] if node is not None else []
    if node is None and parts[-1] == "__init__":  # dataclass: __init__ is generated from the fields
        cls = _find_def(tree, parts[:-1])
        if isinstance(cls, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
            fields = tuple(n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)
                           and isinstance(n.target, ast.Name) and "ClassVar" not in ast.unparse(n.annotation))
            want = target.expected_params(source_minor(root))
            got = ("self", *fields)
            if want is not None and got not in want:
                return [f"{target.path}: dataclass fields ({', '.join(got)}) differ from the expected "
                        f"({' | '.join(', '.join(w) for w in want)})"]
            return []
    if node is None:
        return [f"{target.path}: missing"]
    if isinstance(node, ast.ImportFrom):  # re-exported name: check where it is defined
        if _depth > 3 or target.origin is None:
            return [f"{target.path}: imported name, origin unknown"]
        mod, _, qual = target.origin.rpartition(".")
        # origin "pkg.mod.func" -> module pkg.mod, name func (functions only)
        src_mod = node.module if node.level == 0 else None
        if src_mod is not None and src_mod != mod:
            return [f"{target.path}: imported from {src_mod}, expected {mod}"]
        return check_source_target(root, Target(f"{mod}:{qual}", target.kind, target.origin, target.params),
                                   _depth + 1)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return [f"{target.path}: not a function in the source"]
    problems = []
    kind = _ast_kind(node, in_class=len(parts) > 1)
    if kind != target.kind:
        problems.append(f"{target.path}: is a {kind}, expected {target.kind}")
    if target.origin is not None:
        want_mod = target.origin.rsplit(".", len(parts))[0]
        if want_mod != target.module:
            problems.append(f"{target.path}: defined in {target.module}, expected {want_mod}")
    want = target.expected_params(source_minor(root))
    if want is not None and _ast_params(node) not in want:
        problems.append(f"{target.path}: signature ({', '.join(_ast_params(node))}) differs from the "
                        f"expected ({' | '.join(', '.join(w) for w in want)})")
    return problems
