"""The package's shape, checked from its source: one folder per layer, imports pointing down
only (deferred imports included), no import circle, the engine-free core free of vLLM, the
proposer's step walk, and the package docstring naming every folder.

Layers, lowest first (a module may import its own layer and the layers below):

0. ``core/``: the engine-free algorithm (settings, n-grams, chains, penalty, draft
   distributions, heads, KV views, the step's values, request state, counters, the drafting
   policies and their estimates);
1. ``compat/``: which vLLM is supported and the fail-closed patch helper;
2. ``kernels/``: the CPU attention kernel, its build and binding, and the vLLM CPU-attention
   glue that decides which rows it computes;
3. ``engine/``: the proposer and its vLLM-facing parts (the step input, the target's draft
   forward, the drafter, key layouts, tensor parallelism, the counters over RPC, /metrics);
4. ``patches/``: every change to vLLM, one module per subsystem, and their registry;
5. the entry point (``plugin.py``) and the tools: ``cli/`` (user commands), ``bench/``,
   ``training/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "vllm_tokenswift"

#: top-level folder (or module) -> layer
LAYERS = {"core": 0, "compat": 1, "kernels": 2, "engine": 3, "patches": 4,
          "plugin": 5, "cli": 5, "bench": 5, "training": 5}
#: the package's own ``__init__`` (version, the proposer's class path) sits below everything
ROOT = "vllm_tokenswift"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG.parent).with_suffix("")
        name = ".".join(rel.parts)
        if name.endswith(".__init__"):
            name = name[: -len(".__init__")]
        mods[name] = p
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere (deferred imports included)."""
    out = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm_tokenswift"):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    deps.add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("vllm_tokenswift"))
        deps.discard(name)
        out[name] = deps
    return out


def _layer(module: str) -> int:
    if module == ROOT:
        return -1
    top = module.split(".")[1]
    if top not in LAYERS:
        raise AssertionError(f"{module}: in no layer of tests/test_architecture.py (put it in a folder)")
    return LAYERS[top]


def test_the_top_level_is_folders_and_the_entry_point():
    top = sorted(p.name for p in PKG.iterdir() if p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))
    assert top == sorted(["__init__.py", "plugin.py", *[k for k in LAYERS if k != "plugin"]])


def test_every_module_has_a_layer_and_imports_point_down():
    mods = _modules()
    up = [(m, d, _layer(m), _layer(d)) for m, deps in _imports(mods).items() for d in deps
          if _layer(d) > _layer(m)]
    assert up == [], "imports from a higher layer: " + "; ".join(f"{m} (L{a}) -> {d} (L{b})" for m, d, a, b in up)


def test_no_import_circle():
    graph = _imports(_modules())
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_package_docstring_names_every_folder():
    doc = ast.get_docstring(ast.parse((PKG / "__init__.py").read_text()))
    for folder in LAYERS:
        if folder != "plugin":
            assert f"``{folder}/``" in doc, f"the package docstring does not describe {folder}/"


@pytest.mark.parametrize("path", sorted(str(p.relative_to(PKG)) for p in (PKG / "core").rglob("*.py")))
def test_core_imports_no_vllm_at_module_level(path):
    tree = ast.parse((PKG / path).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
    assert not [n for n in names if n == "vllm" or n.startswith("vllm.")]


def _calls(fn: ast.FunctionDef) -> list[str]:
    """Dotted names of the calls in ``fn``, in source order (``self.policy.plan`` ...)."""
    names = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call):
            parts, f = [], node.func
            while isinstance(f, ast.Attribute):
                parts.append(f.attr)
                f = f.value
            if isinstance(f, ast.Name):
                parts.append(f.id)
            names.append(".".join(reversed(parts)))
    return names


def _methods(path: Path, cls: str) -> dict[str, ast.FunctionDef]:
    tree = ast.parse(path.read_text())
    (c,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {n.name: n for n in c.body if isinstance(n, ast.FunctionDef)}


def test_the_proposer_step_is_its_five_steps_and_visits_the_policy_twice():
    methods = _methods(PKG / "engine" / "proposer.py", "TokenSwiftProposer")
    step = _calls(methods["propose_step"])
    own = [c.removeprefix("self.") for c in step if c.startswith("self._") and c.count(".") == 1]
    assert own == ["_update", "_account", "_plan", "_draft", "_hand_over"]
    walk = ["propose_step", *own, "_new_state"]
    policy_calls = [c for m in walk for c in _calls(methods[m]) if c.startswith("self.policy.")]
    assert sorted(policy_calls) == ["self.policy.account", "self.policy.on_new_request", "self.policy.plan"]
    assert [c for c in _calls(methods["_account"]) if c.startswith("self.policy.")] == ["self.policy.account"]
    assert [c for c in _calls(methods["_plan"]) if c.startswith("self.policy.")] == ["self.policy.plan"]


def test_each_step_takes_its_inputs_as_arguments_and_returns_its_output():
    """The steps pass values, not side channels: each one's parameters are what it reads,
    and the ones that produce something return it (``_account`` books into the policy)."""
    methods = _methods(PKG / "engine" / "proposer.py", "TokenSwiftProposer")

    def params(name):
        return [a.arg for a in methods[name].args.args][1:]

    assert params("_update") == ["step"]
    assert params("_account") == ["step", "verified", "started"]
    assert params("_plan") == ["rows"]
    assert params("_draft") == ["step", "plan"]
    assert params("_hand_over") == ["step", "plan", "drafts"]
    for name in ("_update", "_plan", "_draft", "_hand_over"):
        returns = [n for n in ast.walk(methods[name]) if isinstance(n, ast.Return) and n.value is not None]
        assert returns, f"{name} returns nothing"


def test_the_drafter_reaches_the_policy_only_through_cut():
    src = (PKG / "engine" / "drafter.py").read_text()
    tree = ast.parse(src)
    calls = {c for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) for c in _calls(fn)
             if c.startswith("self.policy.")}
    assert calls == {"self.policy.cut"}


def test_nothing_switches_on_the_policy_name():
    """Strategies are chosen in one place (``core.policy.policy_class``); nothing else
    compares ``cfg.policy`` with a name."""
    hits = []
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                side = ast.unparse(node.left)
                if side.endswith(".policy") or side == "policy":
                    hits.append(f"{path.relative_to(PKG)}:{node.lineno}: {ast.unparse(node)}")
    assert hits == []
