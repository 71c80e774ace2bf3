"""The import graph of kvckpt, checked against its layers: ``python scripts/layers.py [--check] [--graph]``.

Prints each module's layer, size and kvckpt imports (``--graph``), then every rule broken:

* an import of a higher layer (each layer may import its own and the ones before it);
* an import cycle between modules;
* a reach into another module's private name (``from m import _x``, ``module._x``, or
  ``obj._x`` where ``_x`` is not defined in the module doing it);
* a consumer (a module of :data:`CONSUMERS`: the integrations, the reference trainer, the tools and the
  benchmarks) importing past kvckpt's public API: anything of kvckpt other than the names ``kvckpt``
  exports in its ``__all__``, the :data:`PUBLIC_PACKAGES`, a face named for it in :data:`FACES` (the tools'
  ``kvckpt.tooling``), and the consumers themselves (a layer-internal module such as ``kvckpt.storage.store`` is refused
  even for a public-looking name: adapters import ``from kvckpt import fsync_dir``);
* a module over :data:`MAX_LINES` lines whose docstring does not say why (the word "long", as in
  "the module is long because ...").

Every import counts, including those inside functions (a lazy import still ties the layers).
``--check`` exits 1 if a rule is broken; ``tests/tools/test_layers.py`` runs the same checks.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Package folder of each installed prefix (``integrations/``, ``reference/`` and ``tools/`` install under kvckpt).
SOURCES = {"kvckpt": ROOT / "kvckpt", "kvckpt.tools": ROOT / "tools", "kvckpt.integrations": ROOT / "integrations",
           "kvckpt.reference": ROOT / "reference", "benchmarks": ROOT / "benchmarks"}
#: The layers, lowest first: a module may import modules of its own layer and of earlier ones.
LAYERS = (
    ("common", ("kvckpt.errors", "kvckpt.args")),
    ("storage", ("kvckpt.storage",)),
    ("tables", ("kvckpt.tables", "kvckpt.values")),
    ("samplers", ("kvckpt.samplers",)),
    ("transitions", ("kvckpt.transitions",)),
    ("durability", ("kvckpt.durability",)),
    ("buffer", ("kvckpt.buffer", "kvckpt.metrics")),
    ("api", ("kvckpt",)),
    ("tools", ("kvckpt.tools",)),
    ("testing", ("kvckpt.testing",)),
    ("integrations", ("kvckpt.integrations",)),
    ("reference", ("kvckpt.reference",)),  # the reference trainer and demo: a user of the integrations
    ("cli", ("kvckpt.tools.cli",)),  # the command line: the tools' verbs and the demo
    ("benchmarks", ("benchmarks",)),  # measurements of everything above, kvckpt beside its baselines
)
MAX_LINES = 400
#: The packages held to kvckpt's public API: they use kvckpt as a user does (docs/architecture.md, "The public API").
CONSUMERS = ("kvckpt.integrations", "kvckpt.reference", "kvckpt.tools", "benchmarks")
#: A named face a consumer may import beside the public API, and the consumers it is for: the tools' face
#: (kvckpt/tooling.py, the file-level parts the tools and benchmarks build on).
FACES = {"kvckpt.tooling": ("kvckpt.tools", "benchmarks")}
#: Packages public as a whole (but for their ``_private`` parts), beside the names ``kvckpt`` exports: the error
#: classes, the samplers and their registry (for sampler authors), the shipped harnesses, and the operation table
#: (for authors of a surface of the buffer: the Ray actor is made from it).
PUBLIC_PACKAGES = ("kvckpt.errors", "kvckpt.samplers", "kvckpt.testing", "kvckpt.buffer.surface")
#: Private names of other libraries' public API (namedtuple methods, ``os._exit``...).
FOREIGN_PRIVATE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_exit", "_getframe", "_field_defaults"})
#: A peer's private methods an adapter calls on purpose, each because the adapter must behave exactly as the peer
#: does there (a copy would drift from the peer); a peer that moves one fails the adapter's tests loudly.
PEER_PRIVATE_API = {
    # verl's DAPO metric check: the kvckpt verl buffer runs it as verl's _build_replay_buffer does for its own classes
    "_resolve_filter_groups_metric": "kvckpt.integrations.verl.buffer",
}


@dataclass
class Module:
    """One source module: its name, file, line count, layer and what it imports."""

    name: str
    path: Path
    lines: int
    layer: int
    docstring: str
    imports: set[str] = field(default_factory=set)
    #: ``(module, names)`` of every ``from module import names``, resolved by :func:`resolve`.
    from_imports: list[tuple[str, list[str]]] = field(default_factory=list)
    privates: list[str] = field(default_factory=list)
    #: The names of the module's ``__all__`` (a literal list or tuple); empty if it has none.
    exports: frozenset[str] = frozenset()
    #: Every kvckpt module named by ``import kvckpt.x`` and every ``kvckpt.x.y`` attribute chain, with its line.
    dotted: list[tuple[str, int]] = field(default_factory=list)


def layer_of(name: str) -> int:
    """The index in :data:`LAYERS` of the longest matching prefix of ``name``."""
    best, best_len = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def discover(sources: dict[str, Path] | None = None) -> dict[str, Module]:
    """Every module under ``sources`` (package prefix -> folder; :data:`SOURCES` by default), parsed
    and with its imports resolved."""
    found: dict[str, Module] = {}
    for prefix, folder in (SOURCES if sources is None else sources).items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([prefix, *parts])
            if prefix == "kvckpt" and parts[:1] in (["tools"], ["integrations"], ["reference"]):
                continue
            text = path.read_text()
            tree = ast.parse(text)
            found[name] = Module(name, path, text.count("\n"), layer_of(name), ast.get_docstring(tree) or "")
            module = found[name]
            module.imports, module.from_imports, module.privates = _scan(tree, name, path.name == "__init__.py")
            module.exports, module.dotted = _exports(tree), _dotted(tree)
    resolve(found)
    return found


def _scan(tree: ast.Module, name: str, is_package: bool) -> tuple[set[str], list[tuple[str, list[str]]], list[str]]:
    package = name if is_package else name.rpartition(".")[0]
    imports: set[str] = set()
    from_imports: list[tuple[str, list[str]]] = []
    module_aliases: set[str] = set()
    privates: list[str] = []
    own = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                own.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "kvckpt":
                    imports.add(alias.name)
                    module_aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "kvckpt":
                continue
            from_imports.append((base, [alias.name for alias in node.names]))
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    privates.append(f"from {base} import {alias.name}")
                module_aliases.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if node.attr in FOREIGN_PRIVATE_API or PEER_PRIVATE_API.get(node.attr) == name:
                continue
            if isinstance(base, ast.Name) and base.id in module_aliases:
                privates.append(f"{base.id}.{node.attr} (line {node.lineno})")
            elif node.attr not in own:
                privates.append(f"{ast.unparse(base)}.{node.attr} (line {node.lineno})")
    return imports, from_imports, privates


def _exports(tree: ast.Module) -> frozenset[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            try:
                return frozenset(ast.literal_eval(node.value))
            except ValueError:  # a computed __all__ (a lazy package's): not a list this check can read
                return frozenset()
    return frozenset()


def _dotted(tree: ast.Module) -> list[tuple[str, int]]:
    """``import kvckpt.x`` targets and the longest ``kvckpt.x.y`` chains of names bound by ``import kvckpt``."""
    found = [(alias.name, node.lineno) for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names if alias.name.startswith("kvckpt.")]
    bound = any(isinstance(node, ast.Import) and any(a.name.split(".")[0] == "kvckpt" and a.asname is None
                                                      for a in node.names) for node in ast.walk(tree))
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if bound and isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = ast.unparse(node)
            if chain.startswith("kvckpt.") and all(part.isidentifier() for part in chain.split(".")):
                found.append((chain, node.lineno))
    return found


def _public(name: str, exports: frozenset[str], consumer: str = "") -> bool:
    """Whether ``name`` (a dotted kvckpt path) is kvckpt's public API, a consumer's own, or a face ``consumer``
    may use (:data:`FACES`)."""
    if any(part.startswith("_") and not part.startswith("__") for part in name.split(".")):
        return False
    faces = [face for face, users in FACES.items() if any(_within(consumer, user) for user in users)]
    if any(_within(name, p) for p in (*PUBLIC_PACKAGES, *CONSUMERS, *faces)):
        return True
    if name == "kvckpt.__version__":  # the release (CHANGELOG.md), read by the CLI and the benchmarks' reports
        return True
    head = name.split(".")
    return len(head) > 1 and head[0] == "kvckpt" and head[1] in exports


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def boundary(module: Module, exports: frozenset[str]) -> list[str]:
    """What a consumer module imports past the public API (``exports``: ``kvckpt.__all__``), one line each."""
    if not any(_within(module.name, c) for c in CONSUMERS):
        return []
    out = []
    for base, names in module.from_imports:
        for name in names:
            dotted = f"{base}.{name}"
            if not _public(dotted, exports, module.name) or (name.startswith("_") and not name.startswith("__")):
                out.append(f"from {base} import {name}")
    out += [f"{chain} (line {line})" for chain, line in module.dotted if not _public(chain, exports, module.name)]
    return [f"boundary: {module.name} reaches past the public API: {what}" for what in out]


def resolve(modules: dict[str, Module]) -> None:
    """Keep only imports that name a module: ``from p import m`` imports module ``p.m`` when there is
    one, and ``from m import name`` imports ``m``."""
    for module in modules.values():
        for base, names in module.from_imports:
            submodules = {f"{base}.{n}" for n in names} & modules.keys()
            module.imports |= submodules
            if len(submodules) < len(names):
                module.imports.add(base)
        module.imports = {i for i in module.imports if i in modules and i != module.name}


def violations(modules: dict[str, Module]) -> list[str]:
    """Every broken rule, one line each."""
    out = []
    exports = modules["kvckpt"].exports if "kvckpt" in modules else frozenset()
    for module in modules.values():
        out += boundary(module, exports)
        if module.layer < 0:
            out.append(f"layer: {module.name} is in no layer (add its package to LAYERS)")
        for target in sorted(module.imports):
            if module.layer >= 0 and modules[target].layer > module.layer:
                out.append(f"layer: {module.name} ({LAYERS[module.layer][0]}) imports {target} "
                           f"({LAYERS[modules[target].layer][0]})")
        out += [f"private: {module.name} reaches {p}" for p in module.privates]
        if module.lines > MAX_LINES and not re.search(r"\blong\b", module.docstring, re.IGNORECASE):
            out.append(f"size: {module.name} has {module.lines} lines and its docstring does not say why")
    out += [f"cycle: {' -> '.join(c)}" for c in cycles(modules)]
    return out


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Import cycles (one per strongly connected component of more than one module), as paths."""
    graph = {name: {t for t in m.imports if t != "kvckpt" and not name.startswith(t + ".")}
             for name, m in modules.items()}
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if any rule is broken")
    parser.add_argument("--graph", action="store_true", help="print every module's kvckpt imports")
    opts = parser.parse_args(argv)
    modules = discover()
    print(f"{'module':<48} {'layer':<13} {'lines':>5}")
    for module in sorted(modules.values(), key=lambda m: (m.layer, m.name)):
        layer = LAYERS[module.layer][0] if module.layer >= 0 else "-"
        print(f"{module.name:<48} {layer:<13} {module.lines:>5}")
        if opts.graph:
            for target in sorted(module.imports):
                print(f"    -> {target}")
    problems = violations(modules)
    print(f"\n{len(modules)} modules, {sum(m.lines for m in modules.values())} lines; {len(problems)} problems")
    for line in problems:
        print(f"  {line}")
    return 1 if opts.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
