"""fsdp8's import layers (docs/DESIGN.md, "Layers"), read from the source with ``ast``: every import
of an fsdp8 module, at module level or inside a function, relative or absolute, goes down the
table below or stays in its own entry; no modules import each other in a circle; and an import of
an fsdp8 module inside a function is one of the few listed with their reason."""

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp8"

# Bottom to top: a module may import from its own entry and from the entries before it, never
# from one after it. A module belongs to the longest entry naming it or a package above it
# ("fsdp8" is the package's __init__ alone: the public names).
LAYERS: List[Tuple[str, List[str]]] = [
    ("foundation", ["fsdp8.config", "fsdp8.distributed"]),
    ("library", ["fsdp8.fp8", "fsdp8.engine", "fsdp8.models", "fsdp8.checkpoint", "fsdp8.planner", "fsdp8.parallel",
                 "fsdp8.data"]),
    ("public API", ["fsdp8"]),
    ("applications", ["fsdp8.app", "fsdp8.__main__"]),
]

# The fsdp8 imports that stay inside functions, and why (anything else goes at module level).
FUNCTION_LEVEL = {
    ("fsdp8.fp8.kernels", "fsdp8.fp8.triton_kernels"): "Triton, an optional dependency, loads at the first CUDA kernel",
    ("fsdp8.fp8.weight_kernels", "fsdp8.fp8.triton_weights"): "Triton, an optional dependency, loads at the first "
                                                              "CUDA kernel",
    ("fsdp8.fp8.convert", "fsdp8.fp8.mlp"): "mlp.py's fused backward (swiglu.py) imports Triton, an optional "
                                            "dependency: loaded once a model is converted",
}

ENTRIES = [entry for _, entries in LAYERS for entry in entries]


def _modules() -> Dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _entry(module: str) -> str:
    """The table entry ``module`` belongs to."""
    named = [e for e in ENTRIES if module == e or (e != "fsdp8" and module.startswith(e + "."))]
    assert named, f"{module} is in no entry of LAYERS: give it a place in the table (and in docs/DESIGN.md)"
    return max(named, key=len)


def _rank(module: str) -> int:
    return ENTRIES.index(_entry(module))


def _layer(module: str) -> str:
    entry = _entry(module)
    return next(name for name, entries in LAYERS if entry in entries)


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _imports(module: str, path: Path) -> Iterator[Tuple[str, int, bool]]:
    """(imported fsdp8 module, line, inside a function) for every import in ``module``'s source."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def targets(node) -> Iterator[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            return
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(base + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:  # a name that is a module of its own is that module
            yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base

    def walk(node, in_function: bool) -> Iterator[Tuple[str, int, bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(child):
                    if target == "fsdp8" or target.startswith("fsdp8."):
                        yield target, child.lineno, in_function
            yield from walk(child, in_function or isinstance(child, _FUNCTIONS))

    yield from walk(ast.parse(path.read_text(), str(path)), False)


def _edges() -> List[Tuple[str, str, int, bool]]:
    edges = []
    for module, path in MODULES.items():
        for target, line, in_function in _imports(module, path):
            assert target in MODULES, f"{module} (line {line}) imports {target}, which is no module of fsdp8"
            edges.append((module, target, line, in_function))
    return edges


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found = []
    counter = [0]

    def visit(start: str) -> None:  # Tarjan's algorithm, iteratively (no recursion limit)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_has_a_place_in_the_layers():
    assert "fsdp8.config" in MODULES and "fsdp8.app.cli" in MODULES  # the walk found the package
    for module in MODULES:
        _entry(module)


def test_imports_go_down_the_layers():
    wrong = [f"{src} (line {line}, {_layer(src)}: {_entry(src)}) imports {dst} ({_layer(dst)}: {_entry(dst)})"
             for src, dst, line, _ in _edges() if _rank(dst) > _rank(src)]
    assert not wrong, "imports from a lower layer, or an earlier entry, to a later one:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph: Dict[str, Set[str]] = {module: set() for module in MODULES}
    for src, dst, _, _ in _edges():
        graph[src].add(dst)
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other, directly or through others:\n" + "\n".join(
        " <-> ".join(members) for members in cycles)


def test_fsdp8_imports_inside_functions_are_the_listed_ones():
    inside = {(src, dst) for src, dst, _, in_function in _edges() if in_function}
    unlisted = [f"{src} (line {line}) imports {dst} inside a function" for src, dst, line, in_function in _edges()
                if in_function and (src, dst) not in FUNCTION_LEVEL]
    assert not unlisted, ("import these at module level, or list them in FUNCTION_LEVEL with the reason (an optional "
                          "dependency, a measured start-up cost):\n" + "\n".join(unlisted))
    stale = [pair for pair in FUNCTION_LEVEL if pair not in inside]
    assert not stale, f"FUNCTION_LEVEL lists imports that are no longer inside functions: {stale}"
