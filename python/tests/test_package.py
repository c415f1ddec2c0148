"""The package's surface: the stubs declare exactly the runtime API, help() documents it, and the
README's Python example is this repository's tests/python/readme_example.py and prints what the README says."""

import ast
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import softkv

ROOT = pathlib.Path(__file__).resolve().parents[2]
STUB = pathlib.Path(softkv.__file__).with_name("__init__.pyi")
TYPE_ALIASES = {"ArrayLike", "MetricName", "IndexName", "FsyncName"}


def stub_tree():
    return ast.parse(STUB.read_text())


def stub_names():
    names = {}
    for node in stub_tree().body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names[t.id] = node
    return names


def test_the_stubs_declare_every_public_name_and_nothing_else():
    declared = set(stub_names()) - TYPE_ALIASES
    assert declared == set(softkv.__all__)
    assert STUB.with_name("py.typed").exists()


def public_members(cls):
    return {n for n in dir(cls) if not n.startswith("_")}


def native_keywords(fn):
    """Parameter names from pybind11's signature line, e.g. 'query_soft(self: ..., query: object, *, temperature: ...)'."""
    first = fn.__doc__.splitlines()[0]
    params = first[first.index("(") + 1:first.rindex(")")]
    return [p.split(":")[0].strip() for p in re.split(r",\s*(?![^\[]*\])", params) if p.strip() not in ("*", "self")
            and not p.strip().startswith("self:")]


@pytest.mark.parametrize("name", ["Collection", "CollectionView", "Database", "Client", "Contributors", "SoftResult",
                                  "HardResult", "SoftBatchResult", "HardBatchResult"])
def test_each_class_in_the_stubs_matches_the_runtime_class(name):
    node = stub_names()[name]
    runtime = getattr(softkv, name)
    stubbed = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    stubbed |= {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)}
    inherited = set()
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in stub_names():
            base_node = stub_names()[base.id]
            inherited |= {n.name for n in base_node.body if isinstance(n, ast.FunctionDef)}
    expected = public_members(runtime)
    if name == "Client":
        expected |= {"max_frame", "server_version", "server_version_number", "protocol_version", "auth_required"}  # set in __init__
        expected -= {"sock", "next_id"}
    assert {n for n in stubbed | inherited if not n.startswith("_")} == expected
    for fn in (n for n in node.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")):
        attr = getattr(runtime, fn.name)
        if isinstance(attr, property) or not callable(attr):
            continue
        stub_params = [a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg not in ("self", "cls")]
        if inspect.isbuiltin(attr) or type(attr).__name__ == "instancemethod" or not hasattr(attr, "__code__"):
            assert stub_params == native_keywords(attr), fn.name
        else:
            assert stub_params == [p for p in inspect.signature(attr).parameters if p != "self"], fn.name


def test_help_shows_the_api_with_docstrings():
    text = subprocess.run([sys.executable, "-c", "import softkv; help(softkv.Collection)"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PAGER": "cat"}).stdout
    for needle in ("query_soft(", "temperature", "top_k", "add_batch(", "GIL", "float32"):
        assert needle in text
    for cls in (softkv.Collection, softkv.CollectionView, softkv.Database, softkv.Client):
        assert cls.__doc__
        for member in public_members(cls):
            doc = getattr(cls, member).__doc__
            assert doc and len(doc.strip()) > 10, f"{cls.__name__}.{member} has no docstring"
    assert "softkv.Error" in softkv.__doc__ and softkv.__version__.count(".") == 2


def test_the_readme_python_example_runs_and_prints_what_the_readme_shows():
    example = (ROOT / "tests" / "python" / "readme_example.py").read_text()
    readme = (ROOT / "README.md").read_text()
    assert example in readme, "copy tests/python/readme_example.py into the README's Python example block"
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "python" / "readme_example.py")], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    after = readme[readme.index(example) + len(example):]
    shown = re.search(r"```\n+prints\n+```\n(.*?)```", after, re.S).group(1)
    assert out == shown


def test_without_the_native_module_the_import_error_says_how_to_build_it(tmp_path):
    import shutil
    copy = tmp_path / "softkv"
    shutil.copytree(pathlib.Path(softkv.__file__).parent, copy, ignore=shutil.ignore_patterns("_softkv*.so", "__pycache__"))
    out = subprocess.run([sys.executable, "-c", "import softkv"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert out.returncode != 0 and "softkv_python" in out.stderr and "PYTHONPATH" in out.stderr
