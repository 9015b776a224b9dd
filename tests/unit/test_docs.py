"""The docs and the layout stay true to the code: docs/design.md's module map is the one the
package's docstrings generate (every module listed), and no file, class or function of
the package outgrows what a reader takes in at once."""

from __future__ import annotations

import ast
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_compose"


def module_map():
    spec = importlib.util.spec_from_file_location("module_map", ROOT / "docs" / "module_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_design_module_map_is_generated_from_the_package():
    tool = module_map()
    assert tool.documented() == tool.module_map(), "run: python docs/module_map.py --write"
    listed = tool.documented()
    for path in PACKAGE.rglob("*.py"):
        if path.parent != PACKAGE and path.name != "__init__.py":
            assert f"  {path.name} " in listed, f"{path.relative_to(ROOT)} is not in the map"
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert sorted(tool.ORDER) == folders


def test_no_file_class_or_function_outgrows_a_read():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if source.count("\n") > 300:
            too_long.append(f"{path.name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            limit = 300 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    too_long.append(f"{path.name}: {node.name} {length} lines")
    assert not too_long
