"""Lint and the lessons site build are part of the tests."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    assert path, f"{name} is not installed; install the dev extras: pip install -e '.[dev]'"
    return path


def test_ruff():
    res = subprocess.run([_tool("ruff"), "check", str(ROOT)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_lessons_build_strict(tmp_path):
    res = subprocess.run([_tool("mkdocs"), "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (tmp_path / "site" / "index.html").is_file()
