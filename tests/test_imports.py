"""kdax's import graph (read from the source, nothing imported): no cycles among its
modules, no import hidden inside a function, and no private name, or private module of
another subpackage, imported across subpackages (kdax.stages, kdax.pallas,
kdax.parallel, kdax.nn, kdax.ref talk to each other through their packages' public
names; the private machinery, the top-level private modules (kdax._annotations and the like)
and the private subpackages kdax._numerics, kdax._layouts, kdax._stage_protocol, kdax._runner,
is shared by all, and the top level may re-export from a subpackage's modules). The root keeps the
public faces and at most 8 private modules."""

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "kdax"


def _modules() -> dict:
    out = {}
    for f in PKG.rglob("*.py"):
        parts = list(f.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = _modules()


def _imports(mod: str):
    """``(target module, imported name or None, at module level)`` of each kdax import."""
    f = MODULES[mod]
    tree = ast.parse(f.read_text())
    base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
    top = {id(n) for n in tree.body}
    for stmt in tree.body:  # module level also means inside a top-level if/try
        if isinstance(stmt, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level else node.module
            if not target or not target.split(".")[0] == "kdax":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                yield (sub, None, id(node) in top) if sub in MODULES else (target, a.name, id(node) in top)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kdax":
                    yield a.name, None, id(node) in top


def _subpackage(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PKG / parts[1]).is_dir()) else ""


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in _imports(m) if t in MODULES and t != m} for m in MODULES}
    # A package importing its own submodules is how re-exports work; a submodule importing
    # its parent package's __init__ would close a loop.
    state, cycles = {}, []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if t in path or state.get(t) == 1:
                if t in path:
                    cycles.append(path[path.index(t):] + [t])
                continue
            if t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def _entry(mod: str):
    """The folder (subpackage) or root module of kdax that ``mod`` belongs to; None for
    the package itself (its ``__init__`` re-exports every face)."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_cycles_between_folders():
    # Drawn a folder at a time (kdax/_runner, kdax/stages, ... and the root's modules), the
    # imports still go one way (docs/DESIGN.md, "Imports go one way"): a folder that
    # imports another is never imported back by it, through any path.
    graph = {}
    for m in MODULES:
        a = _entry(m)
        for t, _, _ in _imports(m):
            b = _entry(t)
            if a and b and a != b:
                graph.setdefault(a, set()).add(b)
    loops = []

    def reach(a, seen):
        for b in sorted(graph.get(a, ())):
            if b not in seen:
                seen.add(b)
                reach(b, seen)
        return seen

    for a in sorted(graph):
        for b in sorted(graph[a]):
            if a in reach(b, {b}):
                loops.append(f"{a} -> {b}")
    assert not loops, "folders importing each other (directly or through others): " + "; ".join(loops)


def test_no_function_local_imports():
    local = [(m, t) for m in MODULES for t, _, top in _imports(m) if not top]
    assert not local, f"imports inside functions (hiding a cycle?): {local}"


def test_no_private_names_across_subpackages():
    bad = []
    for m in MODULES:
        src = _subpackage(m)
        for target, name, _ in _imports(m):
            dst = _subpackage(target)
            if not dst or dst == src:
                continue  # the top level's modules, or within one subpackage
            # A sibling subpackage's private module, or any private name of another
            # subpackage (the top level re-exports from its subpackages' modules).
            priv_module = bool(src) and any(p.startswith("_") for p in target.split(".")[2:])
            if priv_module or (name or "").startswith("_"):
                bad.append(f"{m} imports {target}{'.' + name if name else ''}")
    assert not bad, "private names across subpackages:\n" + "\n".join(sorted(bad))


def test_root_keeps_few_private_modules():
    # Private machinery lives in the private subpackages, grouped by what it is
    # (docs/DESIGN.md, "Package layout"); the root keeps the public faces.
    private = sorted(f.name for f in PKG.glob("_*.py") if f.name != "__init__.py")
    assert len(private) <= 8, f"{len(private)} private modules at kdax/'s root: {private}"
