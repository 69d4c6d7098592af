"""Where a script hands its data over: the file and line of the `fit` call or `for` loop that
takes it, the name it has there, and the assignment that made it — so that the script doctor's
recipe can say which line of the script to replace, with the script's own variable.

Found from the frame that handed the data over (the probes note it) and the script's source,
parsed, never run.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from pathlib import Path


def rel_path(path: str) -> str:
    """`path` relative to the working directory where it lies under it, else as given."""
    r = os.path.relpath(path)
    return path if r.startswith("..") else r


@dataclass
class Origin:
    """Where the script hands its data over: the file and line of that call, the name the data
    has there (None when it is made in the call itself) and the assignment that made it."""

    file: str
    call_line: int
    name: str | None
    made: tuple[int, int] | None = None  # first and last line of `name = ...`
    made_text: str = ""  # what it was: `name = ...`, on one line, shortened
    handed_text: str = ""  # without a name: the expression handed over, as written

    def where(self, lines: tuple[int, int] | None = None) -> str:
        first, last = lines or (self.call_line, self.call_line)
        return f"{rel_path(self.file)}:{first}" + (f"-{last}" if last != first else "")

    def assign(self, call: str, data_name: str) -> str:
        """The line that makes `call` the script's data, in place of the old one."""
        if self.made is not None:
            return f"{self.name} = {call}   # in place of {self.where(self.made)}: {self.made_text}"
        return f"data = {call}\n# then write data in place of `{self.handed_text or data_name}` at {self.where()}"


def origin_of(data, frame) -> Origin:
    """Origin of `data`, handed over in `frame` (the script's own code)."""
    scope = {**frame.f_globals, **frame.f_locals}
    names = [n for n, v in scope.items() if v is data and not n.startswith("_")]
    origin = Origin(frame.f_code.co_filename, frame.f_lineno, names[0] if names else None)
    parsed = _parse(origin.file)
    if parsed is None:
        return origin
    if origin.name:
        origin.made, origin.made_text = _assignment(*parsed, origin.name, origin.call_line, type(data).__name__)
    if origin.made is None:
        origin.handed_text = _handed(*parsed, origin.call_line)
    return origin


def _parse(path: str):
    try:
        source = Path(path).read_text(encoding="utf-8")
        return source, ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None


def _handed(source: str, tree, line: int) -> str:
    """The expression handed over at `line`, as written: the first argument of a `.fit(...)` call,
    or what a `for` loop iterates over; "" where it is neither or spans lines."""
    for node in ast.walk(tree):
        expr = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fit" \
                and node.lineno <= line <= node.end_lineno:
            expr = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "x"), None)
        elif isinstance(node, ast.For) and node.lineno <= line <= node.iter.end_lineno:
            expr = node.iter
        if expr is not None and expr.lineno == expr.end_lineno:
            return ast.get_source_segment(source, expr) or ""
    return ""


def _assignment(source: str, tree, name: str, before: int, maker: str = "") -> tuple[tuple[int, int] | None, str]:
    """The last plain `name = ...` at or before line `before` in the same function (or module
    level) — among several (if/else), the last that names `maker`, the data's type — as (first
    line, last line) and its text; (None, "") where there is none."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
    scope = min((n for n in ast.walk(tree) if isinstance(n, functions) and n.lineno <= before <= n.end_lineno),
                key=lambda n: n.end_lineno - n.lineno, default=tree)
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, functions):
                continue  # another scope
            targets = child.targets if isinstance(child, ast.Assign) else \
                [child.target] if isinstance(child, ast.AnnAssign) and child.value is not None else []
            if len(targets) == 1 and isinstance(targets[0], ast.Name) and targets[0].id == name \
                    and child.lineno <= before:
                found.append(child)
            visit(child)

    visit(scope)
    if not found:
        return None, ""
    naming = [n for n in found if maker and maker in (ast.get_source_segment(source, n.value) or "")]
    found = max(naming or found, key=lambda n: n.lineno)
    text = " ".join((ast.get_source_segment(source, found) or name).split())
    return (found.lineno, found.end_lineno), (text if len(text) <= 70 else text[:67] + "...")
