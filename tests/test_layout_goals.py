"""Size goals of kdax/pipeline.py (issue 38), read from the source: the module keeps the
pipeline's own composition (forward F1-F5, backward B0-B5), each step of which reads top
to bottom in one function; what is not its own lives with the concept that owns it
(kdax._plan, kdax._validate, kdax._layouts, kdax._runner)."""

import ast
import pathlib

PIPELINE = pathlib.Path(__file__).resolve().parents[1] / "kdax" / "pipeline.py"


def _functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield node.name, node.end_lineno - start + 1


def test_pipeline_module_size():
    lines = len(PIPELINE.read_text().splitlines())
    assert lines <= 450, f"kdax/pipeline.py has {lines} lines (goal: at most 450)"


def test_no_long_function_in_pipeline():
    long = [(n, size) for n, size in _functions(ast.parse(PIPELINE.read_text())) if size > 60]
    assert not long, f"functions over 60 lines in kdax/pipeline.py: {long}"


def test_pipeline_class_size():
    """``KDAPipeline`` itself: its fields, constructors and the two straight lines; the
    forward's route (layout, casts, hooks, tiles) lives in ``kdax._runner.forward``."""
    tree = ast.parse(PIPELINE.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KDAPipeline"]
    lines = cls.end_lineno - cls.lineno + 1
    assert lines <= 250, f"KDAPipeline has {lines} lines (goal: at most 250)"
