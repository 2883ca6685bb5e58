"""The gateway's layout holds (docs/structure.md): the service core knows no HTTP, the routers of each API reach
the service and never the app, nothing but the server launch imports the app, no import circle, and no file over
400 lines. Read from the source's import statements (those under TYPE_CHECKING and inside functions included), so
a violation fails here whether or not a test runs the code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bouquet.gateway

GATEWAY = Path(bouquet.gateway.__file__).parent
PACKAGE = "bouquet.gateway"
MAX_LINES = 400
HTTP_LIBRARIES = ("starlette", "uvicorn", "httptools")
# The HTTP side: the API routers (and the OpenAPI document of their bodies), the HTTP plumbing, the app.
HTTP_SIDE = (f"{PACKAGE}.api", f"{PACKAGE}.http", f"{PACKAGE}.openapi", f"{PACKAGE}.app")


def _module_name(path: Path) -> str:
    parts = path.relative_to(GATEWAY.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(GATEWAY.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, by absolute name (a `from package import module` names the module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(
                f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES
            )
    return names


IMPORTS = {name: _imports(path) for name, path in MODULES.items()}


def _within(module: str, prefixes: tuple[str, ...] | str) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def test_the_layout_is_what_this_test_reads() -> None:
    """The rules below name these modules: a move that renames one must update them."""
    for module in ("service", "jobs", "app", "http.endpoint", "http.server", "api.openai", "api.tei", "api.vllm"):
        assert f"{PACKAGE}.{module}" in MODULES, module


@pytest.mark.parametrize("module", [m for m in MODULES if not _within(m, HTTP_SIDE)])
def test_the_core_knows_no_http(module: str) -> None:
    """The service and its jobs, the replicas, admission and metrics: no web framework, no router, no app."""
    offending = {name for name in IMPORTS[module] if _within(name, HTTP_LIBRARIES + HTTP_SIDE)}
    assert not offending, f"{module} imports {sorted(offending)}"


def test_nothing_but_the_server_launch_imports_the_app() -> None:
    importers = {module for module, names in IMPORTS.items() if f"{PACKAGE}.app" in names}
    assert importers == {f"{PACKAGE}.http.server"}


@pytest.mark.parametrize("module", [m for m in MODULES if _within(m, f"{PACKAGE}.http")])
def test_the_http_plumbing_knows_no_dialect(module: str) -> None:
    """The endpoint wrapper, body reading and the connection protocol serve every API alike."""
    assert not {name for name in IMPORTS[module] if _within(name, f"{PACKAGE}.api")}, module


def test_no_import_circle() -> None:
    graph = {
        module: {name for name in names if name in MODULES and name != module} for module, names in IMPORTS.items()
    }
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for name in sorted(graph[module]):
            visit(name, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_file_over_the_limit(module: str) -> None:
    lines = MODULES[module].read_text().count("\n")
    assert lines <= MAX_LINES, f"{MODULES[module]}: {lines} lines"
