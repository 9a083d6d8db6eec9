"""Packaging: every subpackage is listed for wheels; CI runs exactly the README's test command."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the check is the same on 3.10
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    on_disk = set()
    for name, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            on_disk.add(".".join([name, *relative.parts]))
    # a subfolder of fxpipe/ that is mapped elsewhere (none today) would be counted twice
    assert listed == on_disk


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, flags=re.S)
    test_command = next(c.strip() for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_the_test_extra_installs_every_package_a_test_would_skip_without():
    """CI installs the test extra, so no test is skipped there for a missing package."""
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["test"]
    installed = {re.match(r"[\w.-]+", requirement).group() for requirement in extra}
    wanted = {name for path in (ROOT / "tests").rglob("*.py") if path != pathlib.Path(__file__)
              for name in re.findall(r"importorskip\(\s*[\"'](\w+)", path.read_text())}
    assert wanted - {"tomllib"} <= installed  # tomllib: the standard library's, from 3.11


def test_a_skip_says_why_in_the_quiet_output(tmp_path):
    import subprocess
    import sys

    (tmp_path / "test_skipping.py").write_text(
        "import pytest\npytest.importorskip('fxpipe_nosuch', reason='fxpipe_nosuch is needed')\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
                             str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert "1 skipped" in result.stdout
    assert "fxpipe_nosuch is needed" in result.stdout


def _imports(path: pathlib.Path) -> set[str]:
    """The fxpipe modules a source file imports."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("fxpipe")}


@pytest.mark.parametrize("folder, forbidden", [
    ("runtime", ("fxpipe.passes", "fxpipe.compiler", "fxpipe.pipeline", "fxpipe.calibrate")),
    ("passes", ("fxpipe.runtime", "fxpipe.compiler", "fxpipe.pipeline")),
    ("fxpipe", ("fxpipe.runtime", "fxpipe.passes")),
])
def test_dependencies_flow_one_way(folder, forbidden):
    """IR <- analysis <- partition <- compiler -> runtime: only the compiler wires the passes
    and the runtime into the IR; the runtime never imports the passes."""
    for path in (ROOT / folder).rglob("*.py"):
        if folder == "fxpipe" and "compiler" in path.relative_to(ROOT / folder).parts:
            continue
        wrong = {name for name in _imports(path) if name.startswith(forbidden)}
        assert not wrong, f"{path.relative_to(ROOT)} imports {sorted(wrong)}"
