"""The package's shape: no import cycles between fastgrpo's modules (function-local imports count), no module
over 500 lines, no undefined or unused names (pyflakes: a name left behind by a move fails only on the path that
reaches it, e.g. only on a GPU)."""
import ast
from pathlib import Path

import pytest

import fastgrpo

ROOT = Path(fastgrpo.__file__).parent
MAX_LINES = 500


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """fastgrpo modules that `path` imports anywhere in its body (a package import counts as its __init__)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in modules and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, name, set(paths)) for name, path in paths.items()}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_module_over_500_lines():
    sizes = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_no_undefined_or_unused_names():
    # imported here: the dev extra installs pyflakes, a GPU machine running `-m gpu` may lack it
    api = pytest.importorskip("pyflakes.api", reason="pyflakes is in the dev extra")
    from pyflakes.reporter import Reporter

    messages = []

    class Collect(Reporter):
        def __init__(self):
            pass

        def flake(self, message):
            messages.append(str(message))

        def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 - pyflakes' interface
            messages.append(f"{filename}:{lineno}: {msg}")

        def unexpectedError(self, filename, msg):  # noqa: N802
            messages.append(f"{filename}: {msg}")

    for path in sorted(ROOT.rglob("*.py")):
        api.checkPath(str(path), Collect())
    assert not messages, "\n".join(messages)
