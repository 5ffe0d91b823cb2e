"""Trailing comments of a Python module: counted (tests/test_comments.py), or moved above their code.

    python tests/comments_tool.py FILE [FILE ...]
        move every trailing comment of each FILE onto a comment line of its own above the code it
        explains (into the block, for one on an ``else:``/``except ...:`` line), except a short one (a
        unit, a form: ``# watts``) and tool directives (``# noqa``, ``# type: ignore``, ``# pragma``).
        Only comments move: a file whose syntax tree would change is left as it was, and named.

Meant for merges: take the other side's version of a conflicting module, then run this on it.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

DIRECTIVE = re.compile(r"#\s*(noqa\b|type:\s*ignore|pragma\b)")
SHORT = 20
WIDTH = 120
_NOT_CODE = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
             tokenize.ENDMARKER, tokenize.ENCODING}
_CLAUSE = re.compile(r"(else|elif|except|finally|case)\b")


def _scan(source: str) -> tuple[set[int], set[int], list[tokenize.TokenInfo]]:
    """The lines that carry code, the lines inside a multi-line token (past its first), and the
    trailing comments."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    code: set[int] = set()
    inner: set[int] = set()
    for tok in tokens:
        if tok.type not in _NOT_CODE:
            code.update(range(tok.start[0], tok.end[0] + 1))
            inner.update(range(tok.start[0] + 1, tok.end[0] + 1))
    found = [tok for tok in tokens
             if tok.type == tokenize.COMMENT and tok.start[0] in code and not DIRECTIVE.match(tok.string)]
    return code, inner, found


def trailing_comments(source: str) -> tuple[int, list[int]]:
    """The number of lines of code in ``source`` (a line inside a multi-line string counts), and
    the line numbers of its trailing comments (tool directives left out)."""
    code, _, found = _scan(source)
    return len(code), [tok.start[0] for tok in found]


def _indent(line: str) -> str:
    return line[:len(line) - len(line.lstrip())]


def move_above(source: str) -> str:
    """``source`` with its trailing comments moved as the module docstring says."""
    _, inner, found = _scan(source)
    lines = source.splitlines(keepends=True)
    above: dict[int, list[str]] = {}
    below: dict[int, list[str]] = {}
    for tok in found:
        ln, col = tok.start
        text = tok.string.lstrip("#").strip()
        if len(text) <= SHORT:
            continue
        line = lines[ln - 1]
        lines[ln - 1] = line[:col].rstrip() + ("\n" if line.endswith("\n") else "")
        head = lines[ln - 1].strip()
        nxt = lines[ln] if ln < len(lines) else ""
        if (_CLAUSE.match(head) and head.endswith(":") and ln not in inner and nxt.strip()
                and len(_indent(nxt)) > len(_indent(line))):
            below.setdefault(ln + 1, []).append(text)
            continue
        target = ln
        # never inside a string, nor between a line and its backslash continuation
        while target in inner or (target > 1 and lines[target - 2].rstrip("\n").endswith("\\")):
            target -= 1
        above.setdefault(target, []).append(text)
    for target, texts in below.items():
        above[target] = texts + above.get(target, [])
    for target in sorted(above, reverse=True):
        indent = _indent(lines[target - 1])
        block = [f"{indent}# {part}\n" for text in above[target]
                 for part in textwrap.wrap(text, WIDTH - len(indent) - 2, break_long_words=False,
                                           break_on_hyphens=False)]
        lines[target - 1:target - 1] = block
    return "".join(lines)


def main(paths: list[str]) -> int:
    status = 0
    for name in paths:
        path = Path(name)
        source = path.read_text()
        moved = move_above(source)
        if ast.dump(ast.parse(source)) != ast.dump(ast.parse(moved)):
            print(f"{name}: left as it was (moving its comments would change its code)", file=sys.stderr)
            status = 1
        elif moved != source:
            path.write_text(moved)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
