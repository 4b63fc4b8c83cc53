"""The Python the benchmark pages run in Pyodide sits in JavaScript template literals (static/bench/*.html):
JavaScript turns its escapes into characters before Python sees it (a "\\n" inside a Python string literal
becomes a line break that ends the string), so a page can break on a syntax error only the browser meets.
Each page's Python, as the template literal delivers it, must compile."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "static" / "bench"
# the template literal handed to benchPythonPage(...) or pyodide.runPythonAsync(...)
_LITERAL = re.compile(r"(?:benchPythonPage\(.*?\}\),|runPythonAsync\()\s*`(.*?)`\);", re.S)
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", "`": "`", "$": "$", "'": "'", '"': '"', "r": "\r", "0": "\0"}


def template_literal_value(raw: str) -> str:
    """What a JavaScript template literal without substitutions evaluates to (the escapes pages use)."""
    if re.search(r"(?<!\\)\$\{", raw):
        raise AssertionError("a ${...} substitution inside the page's Python: JavaScript would fill it in")

    def unescape(match: re.Match) -> str:
        char = match.group(1)
        if char not in _ESCAPES:
            raise AssertionError(f"escape \\{char} in the page's Python: JavaScript would change it")
        return _ESCAPES[char]

    return re.sub(r"\\(.)", unescape, raw, flags=re.S)


def python_blocks(page: Path) -> list[str]:
    return [template_literal_value(raw) for raw in _LITERAL.findall(page.read_text(encoding="utf-8"))]


@pytest.mark.parametrize("page", sorted(BENCH.glob("*.html")), ids=lambda p: p.name)
def test_bench_page_python_compiles(page):
    blocks = python_blocks(page)
    if page.name != "storage.html":  # the one page without Python
        assert blocks, f"{page.name}: no Python found (has the page's structure changed?)"
    for source in blocks:
        compile(source, page.name, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


def test_a_javascript_escape_that_breaks_python_is_caught():
    """The check sees Python as the browser delivers it: "\\n" inside a Python string ends the string."""
    raw = 'x = engine.encode_prompt("x = 1\\n")\n'
    with pytest.raises(SyntaxError):
        compile(template_literal_value(raw), "page", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    compile(template_literal_value(raw.replace("\\n", "\\\\n")), "page", "exec")  # "\\n" in the page is fine
