"""Fingerprints of the code an entry point runs: normalized sources over a static dependency closure.

Normalization: a module is parsed with :mod:`ast`, the docstrings of the module, its classes and functions
are dropped, and the tree is dumped without positions, so comments, docstrings and formatting never change a
fingerprint. Parsed modules are cached per (path, mtime, size).

The closure is static, over the top-level statements of the given packages' modules (third-party code is
pinned by the environment). A part is one top-level statement (a whole class or function, an import, an
assignment, an ``if``/``try`` block); the rules:

1. A name of a module brings in the statements binding it at the top level, and a statement brings in what
   every name it reads is bound to: other top-level names of its module, imported names (followed through
   re-exports, so a package ``__init__`` that re-exports everything brings in only the names imported from
   it), attributes read from an imported module (``pipeline.statistic_file``), and the targets of every import
   inside it (in functions too, relative or absolute). A name a module does not bind brings in the module.
2. Registrations: a top-level definition decorated, or a top-level call made, with something named
   ``*register*`` (``@STATISTICS.register``, ``register_feature(...)``) registers into the module defining
   that callee; once any part of that module is reached, every registration into it is (so a registry
   brings in every registered method). A callee whose definition reads a third-party name
   (``register_quantizer`` of transformers) registers outside the packages: rule 3.
3. Other import-time effects (a top-level call or expression, an assignment to an attribute or item, a
   registration outside the packages) are brought in by every closure: importing one lrkv module imports
   nearly all of them, so they run in every process.

A module that reads ``globals()``/``vars()``, star-imports, imports by string or defines ``__getattr__`` is
taken whole wherever any of it is reached. The fingerprint hashes the module names and normalized
sources of the statements reached.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

# a part of a closure: ("module", module), ("name", module, name) or ("stmt", module, index)
Part = tuple

_COMPOUND = (ast.If, ast.Try, ast.With, ast.For, ast.While)
_SCOPES = (
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda,
    ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp,
)  # fmt: skip
_DYNAMIC = (["globals"], ["locals"], ["__import__"], ["import_module"])  # calls that look names up by string
_MODULE_ATTRIBUTES = {"__file__", "__name__", "__path__", "__spec__", "__package__", "__loader__", "__doc__"}


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _drop_docstrings(tree: ast.Module) -> ast.Module:
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    node.body = node.body[1:]
    return tree


def normalized_dump(source: str) -> str:
    """The module's AST without docstrings, comments or positions (what its fingerprint hashes)."""
    return ast.dump(_drop_docstrings(ast.parse(source)))


def _toplevel(stmt: ast.stmt) -> Iterable[ast.stmt]:
    """The statement and those nested in its ``if``/``try``/``with``/loop blocks (not in defs or classes)."""
    yield stmt
    if isinstance(stmt, _COMPOUND):
        handlers = [s for h in getattr(stmt, "handlers", []) for s in h.body]
        for block in (stmt.body, stmt.orelse, getattr(stmt, "finalbody", []), handlers):
            for s in block:
                yield from _toplevel(s)


def _shallow(node: ast.AST) -> Iterable[ast.AST]:
    """The node and its descendants, not entering function, class or lambda bodies or comprehensions."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, _SCOPES):
            yield from _shallow(child)


def _bound_names(stmt: ast.stmt) -> set[str]:
    """Names a top-level statement binds (the first component for ``import a.b``)."""
    if isinstance(stmt, _SCOPES):
        return {stmt.name}
    names: set[str] = set()
    for n in _shallow(stmt):
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(n.name)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in n.names if a.name != "*"}
        elif isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            names.add(n.id)
    return names


def _reads(node: ast.AST) -> list[tuple[str, tuple[str, ...]]]:
    """Every name the node reads, with the attributes read from it (``a.b.c`` → ``("a", ("b", "c"))``)."""
    out: list[tuple[str, tuple[str, ...]]] = []

    def visit(n: ast.AST) -> None:
        chain: list[str] = []
        root = n
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if isinstance(root, ast.Name):
            out.append((root.id, tuple(reversed(chain))))
            return
        for child in ast.iter_child_nodes(root):
            visit(child)

    visit(node)
    return out


def _callee(node: ast.expr) -> list[str]:
    """The names along a call's callee, root first (``@STATISTICS.register`` → STATISTICS, register)."""
    names: list[str] = []
    while isinstance(node, ast.Call | ast.Attribute):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


@dataclass
class ModuleSource:
    """One parsed module: its top-level statements, their digests and what they bind, register and do."""

    name: str
    path: str
    is_package: bool
    body: list[ast.stmt]
    digests: list[str]
    bindings: dict[str, list[int]] = field(default_factory=dict)
    registrations: list[tuple[int, str]] = field(default_factory=list)  # (statement, callee root name)
    effects: list[int] = field(default_factory=list)  # statements with import-time effects
    dynamic: bool = False


@functools.lru_cache(maxsize=4096)
def _parse(path: str, mtime_ns: int, size: int, name: str, is_package: bool) -> ModuleSource:
    body = _drop_docstrings(ast.parse(Path(path).read_text())).body
    mod = ModuleSource(name, path, is_package, body, [_digest(ast.dump(s)) for s in body])
    for i, stmt in enumerate(body):
        for n in _bound_names(stmt):
            mod.bindings.setdefault(n, []).append(i)
        for s in _toplevel(stmt):
            calls = [s.value] if isinstance(s, ast.Expr) else getattr(s, "decorator_list", [])
            for call in calls:
                callee = _callee(call)
                if any("register" in n for n in callee):
                    mod.registrations.append((i, callee[0]))
                elif isinstance(s, ast.Expr) and not isinstance(s.value, ast.Constant):
                    mod.effects.append(i)
            if isinstance(s, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
                targets = s.targets if isinstance(s, ast.Assign | ast.Delete) else [s.target]
                if any(isinstance(t, ast.Attribute | ast.Subscript) for t in targets):
                    mod.effects.append(i)
    mod.dynamic = "__getattr__" in mod.bindings or any(
        (isinstance(n, ast.ImportFrom) and n.names[0].name == "*")
        or (isinstance(n, ast.Call) and _callee(n)[-1:] in _DYNAMIC)
        or (isinstance(n, ast.Call) and _callee(n) == ["vars"] and not n.args)
        for s in body
        for n in ast.walk(s)
    )
    return mod


class CodeIndex:
    """The modules of some packages (top-level name → source folder) and fingerprints of closures over them.

    The sources are read in one snapshot (:meth:`refresh`, first done on first use): a process computes its
    keys from the code as it was when it started using them, which is the code it has loaded. Parsed
    modules are cached by (path, mtime, size), so a refresh re-parses only what changed.
    """

    def __init__(self, packages: Mapping[str, str | Path]):
        self.packages = {name: Path(root) for name, root in packages.items()}
        self._lock = threading.RLock()
        self._files: dict[str, tuple[str, int, int, bool]] | None = None
        self._sources: dict[str, ModuleSource] = {}
        self._found: tuple[dict[str, list[Part]], list[Part]] | None = None
        self._fingerprints: dict[tuple, str] = {}

    def refresh(self) -> None:
        """Read the sources again (every module's file, parsed unless unchanged)."""
        files = {}
        for top, root in self.packages.items():
            for p in sorted(root.rglob("*.py")):
                parts = p.relative_to(root).with_suffix("").parts
                is_package = parts[-1] == "__init__"
                parts = parts[:-1] if is_package else parts
                if not is_package and (root.joinpath(*parts) / "__init__.py").is_file():
                    continue  # a package shadows a module of the same name
                if all((root.joinpath(*parts[:k]) / "__init__.py").is_file() for k in range(len(parts))):
                    st = p.stat()
                    files[".".join((top, *parts))] = (str(p), st.st_mtime_ns, st.st_size, is_package)
        with self._lock:
            self._files = files
            self._sources = {
                name: _parse(path, t, size, name, pkg) for name, (path, t, size, pkg) in files.items()
            }
            self._found = None
            self._fingerprints = {}

    def _snapshot(self) -> None:
        if self._files is None:
            self.refresh()

    def is_module(self, name: str) -> bool:
        self._snapshot()
        return name in self._sources

    def source(self, name: str) -> ModuleSource:
        self._snapshot()
        return self._sources[name]

    def modules(self) -> list[str]:
        """Every module of the packages."""
        self._snapshot()
        return sorted(self._sources)

    # -- imports -------------------------------------------------------------------------------------------

    def _targets(self, module: str, node: ast.Import | ast.ImportFrom) -> dict[str, Part]:
        """What each name an import binds refers to (``import a.b`` binds ``a``; its target is ``a.b``)."""
        if isinstance(node, ast.Import):
            return {a.asname or a.name: ("module", a.name) for a in node.names if self.is_module(a.name)}
        base = node.module or ""
        if node.level:
            parts = module.split(".")[: None if self.source(module).is_package else -1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        if not self.is_module(base):
            return {}
        out = {}
        for a in node.names:
            sub = f"{base}.{a.name}"
            out[a.asname or a.name] = ("module", sub) if self.is_module(sub) else ("name", base, a.name)
        return out

    def _imports_in(self, module: str, node: ast.AST) -> list[Part]:
        return [
            target
            for n in ast.walk(node)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for target in self._targets(module, n).values()
        ]

    def _resolve_read(self, module: str, root: str, chain: tuple[str, ...]) -> list[Part]:
        """What reading ``root.chain`` in ``module`` brings in (nothing for a local or builtin name)."""
        mod = self.source(module)
        parts: list[Part] = []
        for i in mod.bindings.get(root, []):
            parts.append(("stmt", module, i))
            stmt = mod.body[i]
            if not isinstance(stmt, ast.Import | ast.ImportFrom):
                continue  # an if/try block binding it: the block brings in all its imports
            target = self._targets(module, stmt).get(root)
            if target is None and isinstance(stmt, ast.Import) and self.is_module(root):
                target = ("module", root)  # ``import a.b`` binds ``a``
            if target is not None and target[0] == "module":  # a module: follow the attributes read from it
                name, rest = target[1], list(chain)
                if isinstance(stmt, ast.Import) and root in (a.name.split(".")[0] for a in stmt.names):
                    name = root
                while rest and self.is_module(f"{name}.{rest[0]}"):
                    name = f"{name}.{rest.pop(0)}"
                target = ("name", name, rest[0]) if rest else ("module", name)
            if target is not None:
                parts.append(target)
        return parts

    # -- closure -------------------------------------------------------------------------------------------

    @property
    def _registrations(self) -> tuple[dict[str, list[Part]], list[Part]]:
        """Registrations by the module they register into, and the import-time effects of every module."""
        if self._found is None:
            self._found = self._find_registrations()
        return self._found

    def _find_registrations(self) -> tuple[dict[str, list[Part]], list[Part]]:
        by_registry: dict[str, list[Part]] = {}
        effects: list[Part] = []
        for name in self.modules():
            mod = self.source(name)
            effects += [("stmt", name, i) for i in mod.effects]
            for i, root in mod.registrations:
                registry = self._registry_module(name, root)
                if registry is None:
                    effects.append(("stmt", name, i))
                else:
                    by_registry.setdefault(registry, []).append(("stmt", name, i))
        return by_registry, effects

    def _registry_module(self, module: str, name: str) -> str | None:
        """The module of the packages whose statement defines ``name`` as read in ``module``, if that
        statement reads no name imported from a third-party package (else None: a global effect)."""
        seen = set()
        while (module, name) not in seen:
            seen.add((module, name))
            mod = self.source(module)
            stmts = [mod.body[i] for i in mod.bindings.get(name, [])]
            imports = [s for s in stmts if isinstance(s, ast.Import | ast.ImportFrom)]
            if stmts and not imports:
                reads = {root for s in stmts for root, _ in _reads(s)}
                return None if any(self._third_party(module, r) for r in reads) else module
            targets = [self._targets(module, s).get(name) for s in imports]
            target = next((t for t in targets if t is not None), None)
            if target is None or target[0] == "module":
                return None
            module, name = target[1], target[2]
        return None

    def _third_party(self, module: str, name: str) -> bool:
        """Whether ``name`` is bound in ``module`` by an import from outside the packages and the stdlib."""
        mod = self.source(module)
        for i in mod.bindings.get(name, []):
            for s in _toplevel(mod.body[i]):
                if isinstance(s, ast.ImportFrom) and not s.level:
                    names = [s.module or ""]
                elif isinstance(s, ast.Import):
                    names = [a.name for a in s.names]
                else:
                    continue
                if any(n.split(".")[0] not in (*self.packages, *sys.stdlib_module_names) for n in names):
                    return True
        return False

    def _expand(self, part: Part) -> tuple[tuple[str, str] | None, list[Part]]:
        """The (module, digest) a part contributes and the parts it brings in."""
        module = part[1]
        mod = self.source(module)
        registered = self._registrations[0].get(module, [])
        if part[0] == "module" or (part[0] == "name" and mod.dynamic):
            return None, [("stmt", module, i) for i in range(len(mod.body))] + registered
        if part[0] == "name":
            stmts = mod.bindings.get(part[2])
            if stmts is None and part[2] in _MODULE_ATTRIBUTES:
                return None, []
            if stmts is None:
                sub = f"{module}.{part[2]}"
                return None, [("module", sub if self.is_module(sub) else module)]
            return None, self._resolve_read(module, part[2], ()) + registered
        stmt = mod.body[part[2]]
        deps: list[Part] = list(registered)
        if mod.dynamic:
            deps.append(("module", module))
        if not isinstance(stmt, ast.Import | ast.ImportFrom):  # an import's targets come with the reads
            for root, chain in _reads(stmt):
                deps += self._resolve_read(module, root, chain)
            deps += self._imports_in(module, stmt)
        return (module, mod.digests[part[2]]), deps

    def closure(self, entries: Iterable[Part]) -> set[tuple[str, str]]:
        """The (module, statement digest) of every statement the entries and all effects bring in."""
        with self._lock:
            self._snapshot()
            todo = [*entries, *self._registrations[1]]
            seen: set[Part] = set()
            items: set[tuple[str, str]] = set()
            while todo:
                part = todo.pop()
                if part in seen or not self.is_module(part[1]):
                    continue
                seen.add(part)
                item, deps = self._expand(part)
                if item is not None:
                    items.add(item)
                todo += deps
            return items

    def fingerprint(self, entries: Iterable[Part]) -> str:
        """Hash of the closure of ``entries`` (``("name", module, name)`` or ``("module", module)``)."""
        entries = tuple(sorted(entries))
        with self._lock:
            if entries not in self._fingerprints:
                items = sorted(self.closure(entries))
                self._fingerprints[entries] = _digest("\n".join(f"{m}:{d}" for m, d in items))
            return self._fingerprints[entries]

    def modules_reached(self, entries: Iterable[Part]) -> set[str]:
        """The modules any statement of which the entries bring in."""
        return {m for m, _ in self.closure(entries)}
