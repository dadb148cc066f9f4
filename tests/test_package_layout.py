"""The package's shape, checked: modules of at most 400 lines of code, no import cycle, no private name across modules."""

import ast
import os

import pytest

from paths import ROOT

PACKAGE = os.path.join(ROOT, "ddp_hooks")


def _python_files(*folders):
    for folder in folders:
        for base, _, names in os.walk(os.path.join(ROOT, folder)):
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.join(base, name)


def _module_name(path):
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(path):
    """(imported module, names) for every import in the file, relative ones resolved."""
    name = _module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            yield target, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


MAX_CODE_LINES = 400


def code_lines(source: str) -> int:
    """Lines of code: neither blank, nor comments, nor docstrings (of the module, its classes and functions)."""
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                      str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    return sum(1 for number, line in enumerate(source.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)


def test_code_lines_leave_out_docstrings_comments_and_blanks():
    source = '''"""Module.

    Two lines of it.
    """

import os  # a comment on code counts


def f():
    """One."""
    # a comment
    return 1
'''
    assert code_lines(source) == 3


def test_no_module_in_the_package_is_over_400_lines_of_code():
    long = {os.path.relpath(p, ROOT): n for p in _python_files("ddp_hooks")
            if (n := code_lines(open(p).read())) > MAX_CODE_LINES}
    assert not long


def test_the_package_has_no_import_cycle():
    modules = {_module_name(p): p for p in _python_files("ddp_hooks")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for target, names in _imports(path):
            for candidate in [f"{target}.{n}" for n in names] + [target]:
                if candidate in modules and candidate != name:
                    edges.add(candidate)
                    break
        graph[name] = edges
    # a package's __init__ re-exporting its submodules is not a cycle: drop edges into a package from inside it
    for name in graph:
        graph[name] = {t for t in graph[name] if not (modules[t].endswith("__init__.py") and name.startswith(t + "."))}
    state = {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                pytest.fail(f"import cycle: {' -> '.join(trail + [node, nxt])}")
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


@pytest.mark.parametrize("folder", ["ddp_hooks", "tests", "bench", "recipes"])
def test_no_private_name_is_imported_from_another_module(folder):
    crossing = [f"{os.path.relpath(path, ROOT)}: from {target} import {name}"
                for path in _python_files(folder) for target, names in _imports(path)
                for name in names if name.startswith("_") and not name.startswith("__")]
    assert not crossing


def test_the_public_names_stay_where_users_import_them():
    import inspect

    import ddp_hooks
    from ddp_hooks.adaalter import LocalAdaAlter
    from ddp_hooks.sparsify import sparsify_hook
    from ddp_hooks.testing import assert_replicas_equal, free_port, run_distributed  # noqa: F401

    assert sparsify_hook is ddp_hooks.sparsify_hook and LocalAdaAlter is ddp_hooks.LocalAdaAlter
    assert set(ddp_hooks.__all__) >= {
        "SparsifyState", "sparsify_hook", "build_sparsify_sgd", "check_optimizer", "LocalAdaAlter",
        "build_local_adaalter", "AdaAlterAverager", "OuterSGD", "LocalSGDState", "local_sgd_hook",
        "LocalAdaAlterSchedule", "build_sync_adagrad", "build_local_sgd", "__version__"}
    assert list(inspect.signature(ddp_hooks.SparsifyState).parameters) == [
        "process_group", "method", "density", "scope", "aggregation", "error_feedback", "warmup_steps", "seed",
        "momentum", "weight_decay", "grad_scaler", "block_size", "optimizer_momentum", "density_warmup_steps",
        "error_feedback_beta", "value_dtype", "nodes",
        "density_warmup_start"]  # new options go last: positional calls keep working
