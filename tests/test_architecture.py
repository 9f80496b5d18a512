"""The package's shape, checked from its source: import layers point down only, no import
circle (module-level or deferred), no module over 600 lines, and the proposer's step
walk (``propose_with_runner`` calls its five steps, and reaches the drafting policy
only through ``account`` and ``plan``).

Layers, lowest first (a module may import its own layer and the layers below):

0. algorithm, engine-free: n-grams, chains, penalty, heads, KV views, the policy, its
   estimates and facade, request state, settings, counters;
1. vLLM glue: version checks, patches and the plugin, the target model's hooks and the
   draft forward, attention kernels, drafting over the runner, metrics;
2. the proposer;
3. tools: the CLI, ``generate``, ``serve``, model fetching, benchmarks, training.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "vllm_tokenswift"
MAX_LINES = 600

LAYERS = {
    0: {"vllm_tokenswift", "ngram", "chain", "penalty", "heads", "kv_view", "estimates", "policy",
        "drafting_policy", "request_state", "config", "profiling", "counters", "locations"},
    1: {"compat", "verify_attention", "cpu_attention", "draft_forward", "drafting", "metrics",
        "prometheus", "patches", "plugin"},
    2: {"proposer"},
    3: {"cli", "generate", "serve", "models", "yarn", "assets_cli", "engine_helpers", "bench", "training"},
}


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
    top = module.split(".")[1] if "." in module else module
    for level, names in LAYERS.items():
        if top in names:
            return level
    raise AssertionError(f"{module}: in no layer of tests/test_architecture.py (add it)")


def test_every_module_has_a_layer_and_imports_point_down():
    mods = _modules()
    up = [(m, d, _layer(m), _layer(d)) for m, deps in _imports(mods).items() for d in deps
          if _layer(d) > _layer(m)]
    assert up == [], "imports from a higher layer: " + "; ".join(f"{m} (L{a}) -> {d} (L{b})" for m, d, a, b in up)


def test_no_import_circle():
    graph = _imports(_modules())
    # a package's submodules importing their own package's __init__ is not a circle
    # unless that __init__ imports them back; the graph has both edges then
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


def test_no_module_over_600_lines():
    big = {str(p.relative_to(PKG.parent)): n for p in PKG.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


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
    methods = _methods(PKG / "proposer.py", "TokenSwiftProposer")
    step = _calls(methods["propose_with_runner"])
    own = [c.removeprefix("self.") for c in step if c.startswith("self._") and c.count(".") == 1]
    assert own == ["_account", "_update", "_plan", "_draft", "_hand_over"]
    walk = ["propose_with_runner", *own, "_new_state"]
    policy_calls = [c for m in walk for c in _calls(methods[m]) if c.startswith("self.policy.")]
    assert sorted(policy_calls) == ["self.policy.account", "self.policy.plan"]
    # each reached from its own step, once
    assert [c for c in _calls(methods["_account"]) if c.startswith("self.policy.")] == ["self.policy.account"]
    assert [c for c in _calls(methods["_plan"]) if c.startswith("self.policy.")] == ["self.policy.plan"]


@pytest.mark.parametrize("module", ["policy", "estimates", "drafting_policy", "request_state", "kv_view",
                                    "ngram", "chain", "penalty"])
def test_algorithm_modules_import_no_vllm_at_module_level(module):
    tree = ast.parse((PKG / f"{module}.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in top if isinstance(n, ast.ImportFrom) and n.module]
    assert not [n for n in names if n == "vllm" or n.startswith("vllm.")]
