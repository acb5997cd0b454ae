"""The patch surface (:mod:`.patch_surface`) checked against a vLLM release's source, never
imported: an installed ``vllm`` package directory or a downloaded wheel, read with ``ast``.
Names re-exported with ``from ... import`` and members inherited from classes of the same
release are followed."""

from __future__ import annotations

import ast
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_retrieval_spec.integration.patch_surface import (
    CLASS,
    FIELD,
    INSTANCE,
    MODULE,
    PATCH_SURFACE,
    VllmSymbol,
    signature_problem,
)

MAX_HOPS = 8  # re-exports and base classes followed from one name
Found = tuple[str, ast.AST]  # the module defining a node, and the node


class SourceTree:
    """Python files by path relative to the directory holding the ``vllm`` package."""

    def read(self, path: str) -> str | None:
        raise NotImplementedError


@dataclass
class DirectoryTree(SourceTree):
    root: Path  # e.g. site-packages

    def read(self, path: str) -> str | None:
        file = self.root / path
        return file.read_text(encoding="utf-8") if file.is_file() else None


@dataclass
class WheelTree(SourceTree):
    wheel: Path
    _archive: zipfile.ZipFile | None = field(default=None, repr=False)

    def read(self, path: str) -> str | None:
        if self._archive is None:
            self._archive = zipfile.ZipFile(self.wheel)
        try:
            return self._archive.read(path).decode("utf-8")
        except KeyError:
            return None


@dataclass
class SourceIndex:
    """Parsed modules of one release, and lookups of names, classes and members in them."""

    tree: SourceTree
    _modules: dict[str, ast.Module | None] = field(default_factory=dict)

    def module(self, name: str) -> ast.Module | None:
        if name not in self._modules:
            base = name.replace(".", "/")
            text = self.tree.read(f"{base}.py") or self.tree.read(f"{base}/__init__.py")
            self._modules[name] = None if text is None else ast.parse(text)
        return self._modules[name]

    def is_package(self, name: str) -> bool:
        return self.tree.read(f"{name.replace('.', '/')}/__init__.py") is not None

    def lookup(self, module: str, name: str, hops: int = MAX_HOPS) -> Found | None:
        """The node defining module-level ``name``, following ``from X import name`` (or ``*``)."""
        tree = self.module(module)
        if tree is None or hops == 0:
            return None
        for node in tree.body:
            if _defines(node, name):
                return module, node
        for node in tree.body:
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) in (name, "*"):
                        imported = name if alias.name == "*" else alias.name
                        found = self.lookup(self._absolute(module, node), imported, hops - 1)
                        if found:
                            return found
        return _lazy_getattr(module, tree, name)

    def member(self, module: str, class_name: str, name: str, hops: int = MAX_HOPS) -> Found | None:
        """``class_name.name`` in the class body, its methods' ``self.name`` or its bases."""
        found = self.lookup(module, class_name) if "." not in class_name else None
        if found is None or not isinstance(found[1], ast.ClassDef) or hops == 0:
            return None
        where, node = found
        own = _own_member(node, name)
        if own is not None:
            return where, own
        for base in node.bases:
            base_name = _base_name(base)
            inherited = base_name and self.member(where, base_name, name, hops - 1)
            if inherited:
                return inherited
        return None

    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        package = module if self.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        return f"{package}.{node.module}" if node.module else package


def source_problems(tree: SourceTree, surface: Iterable[VllmSymbol] = PATCH_SURFACE) -> list[str]:
    """What of ``surface`` the release in ``tree`` lacks or has with other parameters."""
    index = SourceIndex(tree)
    return [problem for symbol in surface if (problem := _problem(index, symbol))]


def _problem(index: SourceIndex, symbol: VllmSymbol) -> str | None:
    missing = f"{symbol.qualified} is missing"
    if index.module(symbol.module) is None:
        return missing
    if symbol.kind == MODULE:
        return None
    owner, _, attribute = symbol.name.rpartition(".")
    found = index.member(symbol.module, owner, attribute) if owner else index.lookup(symbol.module, attribute)
    if found is None:
        return missing
    node = found[1]
    if symbol.kind == CLASS:
        return None if isinstance(node, ast.ClassDef) else f"{symbol.qualified} is no class"
    if symbol.kind in (FIELD, INSTANCE):
        return None
    if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" != attribute:
        return None  # a lazily created global: its signature is not in the source
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None if isinstance(node, ast.ClassDef) and not symbol.params else f"{symbol.qualified} is no function"
    arguments = node.args.posonlyargs + node.args.args
    return signature_problem(symbol, [arg.arg for arg in arguments if arg.arg != "self"])


def _defines(node: ast.AST, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(target, ast.Name) and target.id == name for target in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _own_member(node: ast.ClassDef, name: str) -> ast.AST | None:
    """A definition of ``name`` in the class body, else a ``self.name = ...`` in one of its methods."""
    for child in node.body:
        if _defines(child, name):
            return child
    for child in ast.walk(node):
        targets = [child.target] if isinstance(child, (ast.AnnAssign, ast.AugAssign)) else \
            getattr(child, "targets", [])
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr == name and \
                    isinstance(target.value, ast.Name) and target.value.id == "self":
                return child
    return None


def _base_name(base: ast.expr) -> str | None:
    """A base class named by a plain name (``Base`` or ``Base[T]``); others are not followed."""
    if isinstance(base, ast.Subscript):
        base = base.value
    return base.id if isinstance(base, ast.Name) else None


def _lazy_getattr(module: str, tree: ast.Module, name: str) -> Found | None:
    """A module-level ``__getattr__`` that names ``name`` in a string (vLLM's lazy globals)."""
    for node in tree.body:
        names_it = any(isinstance(child, ast.Constant) and child.value == name for child in ast.walk(node))
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and names_it:
            return module, node
    return None
