"""Count the branches of fxpipe/, passes/, runtime/ mentioning CUDA or NCCL, and those tests reach.

A branch is one arm of an `if`/`elif`/`else`, of a conditional expression or a comprehension's
`if` filter, counted when its
condition or its own code mentions cuda or nccl (case-insensitive, comments excluded). It is
reached when its first line ran under the tests (a conditional expression: when its line ran,
so both of its arms count as reached at once; they are marked "line"). Functions that call
torch.cuda outside any such branch are listed apart: they are what the tests replace by fakes.

    pip install coverage    # for measuring only; not a dependency of fxpipe
    coverage run --source=fxpipe/,passes/,runtime/ -m pytest -q tests/test_devices.py \\
        tests/runtime/test_device_copies.py tests/test_gpu_check.py tests/test_peak_memory.py \\
        tests/test_precision.py tests/runtime/test_loss_scaling.py tests/test_cli.py
    python benchmarks/cuda_branches.py --data .coverage
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TREES = ("fxpipe", "passes", "runtime")
MENTION = re.compile(r"cuda|nccl", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Branch:
    path: str
    line: int  # the arm's first line
    kind: str  # "if", "else", "expression"
    condition: str


def _mentions(nodes: list[ast.AST]) -> bool:
    return any(MENTION.search(ast.unparse(node)) for node in nodes)


def branches(path: pathlib.Path) -> list[Branch]:
    """The CUDA/NCCL branches of one file."""
    tree = ast.parse(path.read_text(), str(path))
    name = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            condition = ast.unparse(node.test)
            cuda_test = bool(MENTION.search(condition))
            if cuda_test or _mentions(node.body):
                found.append(Branch(name, node.body[0].lineno, "if", condition))
            explicit_else = node.orelse and not (len(node.orelse) == 1 and
                                                 isinstance(node.orelse[0], ast.If))
            if explicit_else and (cuda_test or _mentions(node.orelse)):
                found.append(Branch(name, node.orelse[0].lineno, "else", f"not ({condition})"))
        elif isinstance(node, ast.IfExp):
            condition = ast.unparse(node.test)
            if MENTION.search(condition) or _mentions([node.body, node.orelse]):
                found.append(Branch(name, node.lineno, "expression", condition))
        elif isinstance(node, ast.comprehension):
            for test in node.ifs:
                condition = ast.unparse(test)
                if MENTION.search(condition) or MENTION.search(ast.unparse(node.iter)):
                    found.append(Branch(name, test.lineno, "filter", condition))
    return sorted(found, key=lambda b: b.line)


def unconditional_cuda_calls(path: pathlib.Path) -> list[tuple[str, int, str]]:
    """Functions whose body calls torch.cuda (not inside a CUDA branch): (path, line, name)."""
    tree = ast.parse(path.read_text(), str(path))
    name = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = [s for s in node.body if not isinstance(s, ast.If | ast.FunctionDef) and
                    not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            if any("torch.cuda" in ast.unparse(s) or "record_stream" in ast.unparse(s)
                   for s in body):
                first = next(s for s in node.body if not (isinstance(s, ast.Expr) and
                                                          isinstance(s.value, ast.Constant)))
                found.append((name, first.lineno, node.name))
    return found


def executed(data_file: str | None) -> dict[str, set[int]]:
    """The lines run per file (relative path), from a coverage data file."""
    if data_file is None:
        return {}
    import coverage

    data = coverage.CoverageData(basename=data_file)
    data.read()
    lines = {}
    for measured in data.measured_files():
        path = pathlib.Path(measured).resolve()
        if ROOT in path.parents:
            lines[str(path.relative_to(ROOT))] = set(data.lines(measured) or ())
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="a coverage data file (.coverage)")
    args = parser.parse_args()
    files = sorted(p for tree in TREES for p in (ROOT / tree).rglob("*.py"))
    found = [b for p in files for b in branches(p)]
    ran = executed(args.data)
    reached = [b for b in found if b.line in ran.get(b.path, set())]
    for b in found:
        mark = "reached" if b in reached else ("-" if args.data else "?")
        extra = " (line)" if b.kind in ("expression", "filter") else ""
        print(f"{mark:8} {b.path}:{b.line:<4} {b.kind:10} {b.condition[:70]}{extra}")
    print(f"\n{len(found)} branches mention cuda/nccl in {', '.join(TREES)}; "
          + (f"{len(reached)} reached by the tests measured" if args.data
             else "run with --data .coverage to count those a test reaches"))
    calls = [c for p in files for c in unconditional_cuda_calls(p)]
    if calls:
        print("\nfunctions calling torch.cuda outside a branch (replaced by fakes in tests):")
        for path, line, name in calls:
            state = ("ran" if args.data and line in ran.get(path, set()) else
                     "not run" if args.data else "?")
            print(f"  {state:8} {path}:{line} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
