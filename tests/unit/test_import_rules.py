"""The rooms' import rules (DESIGN.md, "The three rooms"), checked on the source.

- The core (``ckptd/``, the CLI excepted) imports neither ``ckptd.client`` nor
  ``ckptd.server`` at module level.
- The server never imports the client; the client never imports the server.
- The restore flow (``client/restore/``) never writes a store directly: every
  write goes through a ``Repository`` (``import_step``, ``put_chunk``), and only
  ``restore/prefetch.py`` (``ckptd restore --to DIR``) may import one at all.
- The engine's packages depend one way: ``staging`` imports neither ``save`` nor
  ``restore``; ``save`` and ``restore`` do not import each other; none of them
  imports the faces built on them (``checkpointer``, ``dcp``).

import-linter cannot see ``ckptd.client`` and ``ckptd.server`` (they live in
``client/`` and ``server/`` through setuptools' package-dir mapping), so this reads
the modules' syntax trees instead, with relative imports resolved.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Source folder -> the package it installs as (pyproject's package-dir).
ROOMS = {"ckptd": "ckptd", "client": "ckptd.client", "server": "ckptd.server"}
STORE_WRITES = {"put_if_absent", "compare_and_swap", "delete"}


@dataclass(frozen=True, slots=True)
class Import:
    module: str  # absolute, e.g. "ckptd.client.staging"
    line: int
    module_level: bool  # runs on import (not in a function, not under TYPE_CHECKING)


def module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package ``__init__``) of a source file."""
    rel = path.relative_to(ROOT)
    parts = [ROOMS[rel.parts[0]], *rel.parts[1:]]
    is_package = parts[-1] == "__init__.py"
    parts[-1] = parts[-1].removesuffix(".py")
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path) -> Iterator[Import]:
    """Every import in ``path``, resolved to absolute module names."""
    name, is_package = module_name(path)
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))

    def walk(node: ast.AST, module_level: bool) -> Iterator[Import]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(child, False)
            elif isinstance(child, ast.If) and _is_type_checking(child):
                for stmt in child.body:  # only for the type checker
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), False)
                for stmt in child.orelse:
                    yield from walk(ast.Module(body=[stmt], type_ignores=[]), module_level)
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    yield Import(alias.name, child.lineno, module_level)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                yield Import(target, child.lineno, module_level)
                for alias in child.names:  # "from ckptd import client" names a module
                    yield Import(f"{target}.{alias.name}", child.lineno, module_level)
            else:
                yield from walk(child, module_level)

    yield from walk(tree, True)


def sources(room: str) -> list[Path]:
    return sorted((ROOT / room).rglob("*.py"))


def under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(paths: list[Path], forbidden: tuple[str, ...], *, module_level_only: bool
               ) -> list[str]:
    out = []
    for path in paths:
        for imp in imports(path):
            if module_level_only and not imp.module_level:
                continue
            if any(under(imp.module, f) for f in forbidden):
                out.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}")
    return out


def test_the_core_imports_neither_client_nor_server_at_module_level() -> None:
    core = [p for p in sources("ckptd") if "cli" not in p.relative_to(ROOT / "ckptd").parts]
    assert core
    assert violations(core, ("ckptd.client", "ckptd.server"), module_level_only=True) == []


def test_the_server_never_imports_the_client() -> None:
    assert violations(sources("server"), ("ckptd.client",), module_level_only=False) == []


def test_the_client_never_imports_the_server() -> None:
    assert violations(sources("client"), ("ckptd.server",), module_level_only=False) == []


def store_writes(path: Path) -> list[str]:
    """Calls of a store's write methods in ``path`` (``x.put_if_absent(...)``...)."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} calls .{node.func.attr}()"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in STORE_WRITES
    ]


def test_the_restore_flow_never_writes_a_store_directly() -> None:
    restore = sorted((ROOT / "client").glob("restore*.py")) + sorted(
        (ROOT / "client").glob("restore/**/*.py"))
    assert restore
    assert [v for p in restore for v in store_writes(p)] == []


@pytest.mark.parametrize(
    ("source", "rule"),
    [
        ("from ckptd.client import Checkpointer\n", "module"),
        ("import ckptd.server.app\n", "module"),
        ("from ckptd import client\n", "module"),
        ("def f():\n    from ckptd.client import x\n", "function"),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ckptd.client\n",
         "function"),
    ],
)
def test_the_checker_sees_each_kind_of_import(tmp_path: Path, source: str, rule: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # The rules above are only as good as the import finder: it must see absolute,
    # from-, and package-attribute imports, and tell module level from the rest.
    fake_root = tmp_path
    (fake_root / "ckptd").mkdir()
    path = fake_root / "ckptd" / "mod.py"
    path.write_text(source)
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    found = violations([path], ("ckptd.client", "ckptd.server"), module_level_only=True)
    assert bool(found) == (rule == "module")
    assert violations([path], ("ckptd.client", "ckptd.server"), module_level_only=False)


def test_relative_imports_resolve_to_their_package(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    (tmp_path / "server" / "routes").mkdir(parents=True)
    path = tmp_path / "server" / "routes" / "x.py"
    path.write_text("from ...client import staging\nfrom ..deps import RepoDep\n")
    found = [i.module for i in imports(path)]
    assert "ckptd.client.staging" in found and "ckptd.server.deps" in found


def package_sources(name: str) -> list[Path]:
    return sorted((ROOT / "client" / name).rglob("*.py"))


def test_only_the_prefetch_imports_a_repository_or_a_store_writer() -> None:
    restore = [p for p in package_sources("restore") if p.name != "prefetch.py"]
    assert restore
    # Type-only imports (a Store in an annotation) are fine: nothing runs them.
    assert violations(restore, ("ckptd.repository", "ckptd.store"),
                      module_level_only=True) == []
    assert [v for p in restore for v in violations(
        [p], ("ckptd.repository", "ckptd.store.local", "ckptd.store.s3"),
        module_level_only=False)] == []


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("staging", ("ckptd.client.save", "ckptd.client.restore")),
        ("save", ("ckptd.client.restore",)),
        ("restore", ("ckptd.client.save",)),
    ],
)
def test_the_engine_packages_depend_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    paths = package_sources(package)
    assert paths
    faces = ("ckptd.client.checkpointer", "ckptd.client.dcp")
    assert violations(paths, (*forbidden, *faces), module_level_only=False) == []


def test_integrations_load_only_when_asked_for() -> None:
    """Integrations (client/integrations/) need optional packages: the core, the CLI
    included, and the rest of the client import them only inside the functions
    that use them; the engine's packages and the faces never."""
    outside = [p for p in sources("ckptd") + sources("client")
               if "integrations" not in p.relative_to(ROOT).parts]
    assert violations(outside, ("ckptd.client.integrations",), module_level_only=True) == []
    engine = [p for pkg in ("staging", "save", "restore", "dcp", "peer", "health")
              for p in package_sources(pkg)]
    assert engine
    assert violations(engine, ("ckptd.client.integrations",), module_level_only=False) == []


def test_setup_ships_the_integrations_packages() -> None:
    """setup.py finds packages instead of listing them: the integrations ship too."""
    import runpy
    from unittest import mock

    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    shipped = set(setup.call_args.kwargs["packages"])
    assert {"ckptd.client.integrations", "ckptd.client.integrations.safetensors"} <= shipped
