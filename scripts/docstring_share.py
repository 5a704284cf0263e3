"""Lines inside docstrings (module, class, function) / all lines, per module of a package and in total.

python scripts/docstring_share.py shared/cookbook
"""

import ast
import sys
from pathlib import Path


def docstring_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def main(root: str) -> None:
    total = doc = 0
    for path in sorted(Path(root).rglob("*.py")):
        text = path.read_text()
        n, d = len(text.splitlines()), len(docstring_lines(ast.parse(text)))
        total, doc = total + n, doc + d
        print(f"{str(path.relative_to(root)):28s} {n:6d} {d:5d} {d / max(n, 1):6.1%}")
    print(f"{'total':28s} {total:6d} {doc:5d} {doc / total:6.1%}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "shared/cookbook")
