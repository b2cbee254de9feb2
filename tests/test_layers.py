"""The import graph of memox has layers and no cycle (issue 31): a module imports only
from its own layer or the layers below, never lazily inside a function, and the graph
has no cycle. Read from the source with `ast`, so a new import is checked the moment it
is written."""

import ast
import pathlib

import pytest


PACKAGE = pathlib.Path(__file__).parent.parent / "memox"

# From the bottom. A module may import from its own layer and from the layers below.
LAYERS = [
    # internals, errors, caches
    {"_jax_internals", "_errors", "_caches", "_typing", "_flops"},
    # storage, slot, table, policy
    {"_storage", "_slot", "_table", "_policy"},
    # token, fingerprint, key: the one rule
    {"_token", "_fingerprint", "_key"},
    # sites, partition, donation
    {"_sites", "_partition", "_donation"},
    # the per-call state: the context (one stack), the ledger, a compiled wrapper's
    # trace scope and the hits it decides on the host
    {"_context", "_ledger", "_prehash", "_decided"},
    # planning and the memoised operation; a hoisted value's read
    {"_plan", "_memo", "_hoisted"},
    # the user-facing operations
    {"_cached", "_call", "_lifecycle", "_stats", "_hoist"},
    # the compiled wrappers and scan
    {"_jit", "_filter_jit", "_scan"},
    # public re-exports
    {"__init__", "internal", "policies"},
    # the optional subpackage `memox.diffrax`, on its own
    {"diffrax._chord", "diffrax._solvers"},
    {"diffrax._reuse"},
    {"diffrax.__init__"},
]


def _module_name(path: pathlib.Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)


def _imports(path: pathlib.Path) -> list[tuple[str, bool, bool]]:
    """Each memox module `path` imports: its name, whether the import is inside a function
    (lazy), and whether it is for type checking only."""
    tree = ast.parse(path.read_text())
    package = _module_name(path).rpartition(".")[0]
    found = []

    def visit(node: ast.AST, in_function: bool, checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            typing_only = checking or (
                isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING"
            )
            if isinstance(child, ast.ImportFrom) and child.level > 0:
                base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                base = [p for p in base if p]
                if child.module:
                    found.append((".".join([*base, child.module]), in_function, checking))
                else:
                    for alias in child.names:
                        found.append((".".join([*base, alias.name]), in_function, checking))
            elif isinstance(child, ast.ImportFrom | ast.Import):
                names = [child.module] if isinstance(child, ast.ImportFrom) else []
                names += [a.name for a in child.names] if isinstance(child, ast.Import) else []
                for name in names:
                    if name and name.startswith("memox."):
                        found.append((name.removeprefix("memox."), in_function, checking))
            visit(child, lazy, typing_only)

    visit(tree, False, False)
    return found


def _graph() -> dict[str, list[tuple[str, bool, bool]]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = []
        for target, lazy, checking in _imports(path):
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]  # (`from ._x import name`)
            if target not in modules:
                target = target + ".__init__" if target + ".__init__" in modules else target
            if target in modules and target != name:
                edges.append((target, lazy, checking))
        graph[name] = edges
    return graph


def _layer(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"memox/{name}.py has no layer: add it to LAYERS in {__file__}")


def test_every_module_has_a_layer():
    for name in _graph():
        _layer(name)


def test_no_module_imports_memox_inside_a_function():
    lazy = [(m, t) for m, edges in _graph().items() for t, is_lazy, _ in edges if is_lazy]
    assert not lazy, f"imports inside functions (a cycle in disguise): {lazy}"


@pytest.mark.parametrize("name", sorted(_graph()))
def test_imports_go_down_the_layers(name):
    graph = _graph()
    up = [t for t, _, checking in graph[name] if not checking and _layer(t) > _layer(name)]
    assert not up, f"memox/{name}.py (layer {_layer(name)}) imports from a layer above: {up}"


def test_the_import_graph_has_no_cycle():
    graph = {m: [t for t, _, checking in edges if not checking] for m, edges in _graph().items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in graph[node]:
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
