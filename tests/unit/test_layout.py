"""The shape of the rl/ package, read from the source alone (pure `ast`: nothing is imported, no model).

Four rules (README, "Architecture: the layers"):

(a) at most MAX_TOP modules directly under rl/ besides __init__.py (the facades and errors.py; the
    rest lives in the layer packages);
(b) no module of rl/ longer than MAX_LINES lines;
(c) no import cycle between rl modules. Every import statement counts, wherever it stands: at module
    top, inside a function, under `if TYPE_CHECKING:` (a deferred import still ties the two modules
    together). `import rl.a.b` and `from rl.a.b import c` name the module rl.a.b.c when that is a
    module, else rl.a.b (else the longest enclosing module); relative imports are resolved the same
    way. A module importing one of its own enclosing packages (rl, rl.engine for rl.engine.x) does not
    count: Python runs that package first anyway;
(d) no module imports a layer above its own. Layers, bottom to top:
        errors < config < algos < engine < data < models < rewards < envs < rollout < trainers < scripts
        < the top-level facades (rl/{ppo,dpo,reward_model,environments,forward_backward}.py) and rl/__init__.py
    A new top-level module must be placed in LAYERS below, or (d) fails naming it.

`python tests/unit/test_layout.py` (from the checkout) prints the facts and every violation.
"""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "rl"
MAX_TOP = 12
MAX_LINES = 400

# bottom to top; a module's layer is the one of its first name below rl (rl.engine.x -> "engine")
LAYERS = ("errors", "config", "algos", "engine", "data", "models", "rewards", "envs", "rollout", "trainers",
          "scripts", "facades")
TOP_LEVEL_LAYER = {  # modules directly in rl/ (not layer packages) -> their layer
    "rl": "facades",
    "rl.errors": "errors",
    "rl.ppo": "facades",
    "rl.dpo": "facades",
    "rl.reward_model": "facades",
    "rl.environments": "facades",
    "rl.forward_backward": "facades",
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under rl/ (a package is its __init__.py)."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _enclosing(name: str, mods: dict[str, Path]) -> str | None:
    """`name` if it is a module of rl, else its longest enclosing module; None outside rl."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and child in node.body:
            return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return True
    return False


def imports(mods: dict[str, Path], root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """module -> {imported rl module -> ["file:line (where)", ...]} under the rules of (c)."""
    edges: dict[str, dict[str, list[str]]] = {m: {} for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [_enclosing(a.name, mods) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = []
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    targets.append(sub if sub in mods else _enclosing(source, mods))
            else:
                continue
            where = ("TYPE_CHECKING" if _under_type_checking(node, parents)
                     else "in a function" if _in_function(node, parents) else "module top")
            rel = path.relative_to(root.parent)
            for t in targets:
                if t is None or t == mod or mod.startswith(t + "."):  # outside rl, itself, its own package
                    continue
                edges[mod].setdefault(t, []).append(f"{rel}:{node.lineno} ({where})")
    return edges


def cycles(edges: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start, targets in edges.items():
        if start in index:
            continue
        work = [(start, iter(targets))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out)


def shortest_cycle(comp: list[str], edges: dict[str, dict[str, list[str]]]) -> list[str]:
    """One shortest cycle through the component's first module, as [a, b, ..., a] (breadth-first)."""
    start, members = comp[0], set(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in edges[v]:
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in prev and w != start:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [*comp, comp[0]]


def layer(mod: str) -> str | None:
    """The layer of an rl module; None for a top-level module nobody has placed."""
    if mod in TOP_LEVEL_LAYER:
        return TOP_LEVEL_LAYER[mod]
    first = mod.split(".")[1]
    return first if first in LAYERS and first not in ("errors", "facades") else None


# ------------------------------------------------------------------------------------------ the rules

def top_level_problems(root: Path = ROOT) -> list[str]:
    top = sorted(f.name for f in root.glob("*.py") if f.name != "__init__.py")
    return [f"{len(top)} modules directly in rl/ (at most {MAX_TOP}): {', '.join(top)}"] if len(top) > MAX_TOP else []


def length_problems(mods: dict[str, Path]) -> list[str]:
    sizes = {m: len(f.read_text().splitlines()) for m, f in mods.items()}
    return [f"{mods[m].relative_to(ROOT.parent)}: {n} lines (at most {MAX_LINES})"
            for m, n in sorted(sizes.items(), key=lambda kv: -kv[1]) if n > MAX_LINES]


def cycle_problems(edges: dict[str, dict[str, list[str]]]) -> list[str]:
    out = []
    for comp in cycles(edges):
        loop = shortest_cycle(comp, edges)
        steps = "; ".join(f"{a} -> {b} at {edges[a][b][0]}" for a, b in pairwise(loop))
        out.append(f"import cycle among {len(comp)} modules ({', '.join(comp)}), e.g. {steps}")
    return out


def layer_problems(edges: dict[str, dict[str, list[str]]]) -> list[str]:
    out = []
    for mod in sorted(edges):
        mine = layer(mod)
        if mine is None:
            out.append(f"{mod} has no layer: a module directly in rl/ goes into a layer package, or into "
                       f"TOP_LEVEL_LAYER in tests/unit/test_layout.py")
            continue
        for target, where in sorted(edges[mod].items()):
            theirs = layer(target)
            if theirs is not None and LAYERS.index(theirs) > LAYERS.index(mine):
                out.append(f"{mod} ({mine}) imports {target} ({theirs}, a layer above) at {', '.join(where)}")
    return out


def test_at_most_12_top_level_modules():
    problems = top_level_problems()
    assert not problems, "\n".join(problems)


def test_no_module_over_400_lines():
    problems = length_problems(modules())
    assert not problems, "modules over the limit (split them):\n" + "\n".join(problems)


def test_no_import_cycle():
    problems = cycle_problems(imports(modules()))
    assert not problems, "\n".join(problems)


def test_no_import_of_a_layer_above():
    problems = layer_problems(imports(modules()))
    assert not problems, f"layers, bottom to top: {' < '.join(LAYERS)}\n" + "\n".join(problems)


# ------------------------------------------------------------------------------------------ the checker

def test_the_checker_sees_every_kind_of_import(tmp_path):
    """The rules themselves, on a made-up package: deferred and TYPE_CHECKING imports count, `from
    pkg import module` names the module, an import of the own package does not count, and a layer
    violation is found."""
    pkg = tmp_path / "rl"
    for d in ("engine", "trainers"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "engine" / "a.py").write_text("import rl.engine\nfrom rl.engine import b\n")
    (pkg / "engine" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from . import c\n")
    (pkg / "engine" / "c.py").write_text("def f():\n    from rl.engine.a import x\n")
    (pkg / "trainers" / "t.py").write_text("from ..engine import a\n")
    (pkg / "engine" / "up.py").write_text("def g():\n    from rl.trainers import t\n")
    mods = modules(pkg)
    edges = {m: {t: [w.split(" ", 1)[1] for w in ws] for t, ws in e.items()}
             for m, e in imports(mods, pkg).items()}
    assert edges["rl.engine.a"] == {"rl.engine.b": ["(module top)"]}  # `import rl.engine`: its own package
    assert edges["rl.engine.b"] == {"rl.engine.c": ["(TYPE_CHECKING)"]}
    assert edges["rl.engine.c"] == {"rl.engine.a": ["(in a function)"]}
    assert edges["rl.trainers.t"] == {"rl.engine.a": ["(module top)"]}
    assert cycles(edges) == [["rl.engine.a", "rl.engine.b", "rl.engine.c"]]
    assert shortest_cycle(["rl.engine.a", "rl.engine.b", "rl.engine.c"], edges) == [
        "rl.engine.a", "rl.engine.b", "rl.engine.c", "rl.engine.a"]
    problems = layer_problems(edges)
    assert len(problems) == 1 and problems[0].startswith("rl.engine.up (engine) imports rl.trainers.t (trainers")


if __name__ == "__main__":
    import sys

    mods = modules()
    edges = imports(mods)
    top = sorted(f.name for f in ROOT.glob("*.py") if f.name != "__init__.py")
    sizes = sorted(((len(f.read_text().splitlines()), m) for m, f in mods.items()), reverse=True)
    print(f"rl/: {len(mods)} modules, {sum(n for n, _ in sizes)} lines; {len(top)} directly in rl/ "
          f"({', '.join(top)}); {sum(map(len, edges.values()))} import edges; largest: "
          + ", ".join(f"{m} {n}" for n, m in sizes[:4]))
    problems = (top_level_problems() + length_problems(mods) + cycle_problems(edges) + layer_problems(edges))
    for p in problems:
        print("FAIL " + p)
    print("layout: " + ("within the rules" if not problems else f"{len(problems)} problems"))
    sys.exit(1 if problems else 0)
