"""One distribution, `pagedllm`; the top-level folders are its namespaced import packages."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reference", "optimized", "kernels", "serving")


def source_tree(dest: Path) -> Path:
    """What the build reads, copied: pyproject.toml, the readme, the package folders. A build in
    the checkout would reuse its build/ folder, where a file deleted from the source (such as
    kernels/__init__.py, issue 43) stays and goes into the wheel."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    dest.mkdir()
    for name in ("pyproject.toml", config["project"]["readme"]):
        shutil.copy2(ROOT / name, dest / name)
    for folder in config["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(ROOT / folder, dest / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def test_normal_install_from_a_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(source_tree(tmp_path / "src"))],
                   check=True)
    wheel = next((tmp_path / "dist").glob("pagedllm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in PACKAGES:
        if pkg != "kernels":
            assert f"pagedllm/{pkg}/__init__.py" in names
    # kernels/ has no __init__.py (tests/unit/test_kernels_name.py): a namespace package, all
    # of whose modules the wheel carries
    assert "pagedllm/kernels/__init__.py" not in names
    kernel_files = sorted(p.name for p in (ROOT / "kernels").glob("*.py"))
    assert "paged_attention.py" in kernel_files
    assert sorted(n.removeprefix("pagedllm/kernels/") for n in names
                  if n.startswith("pagedllm/kernels/") and n.endswith(".py")) == kernel_files
    assert "pagedllm/reference/model/loader.py" in names
    # the CPU kernels build from their sources on first use
    assert {"pagedllm/kernels/cpu/cpu.h", "pagedllm/kernels/cpu/rms_norm.cpp"} <= set(names)
    assert not any(n.startswith(("tests/", "reference/", "kernels/")) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    code = ("import pagedllm.reference as r, pagedllm.kernels.paged_attention as p, "
            "pagedllm.kernels.backend, pagedllm.serving.cli; print(r.__file__, p.__file__)")
    env = {"PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env, check=True).stdout.split()
    assert out == [str(target / "pagedllm" / "reference" / "__init__.py"),
                   str(target / "pagedllm" / "kernels" / "paged_attention.py")]
    out = subprocess.run([sys.executable, "-m", "pagedllm.kernels.compile_check", "--help"],
                         capture_output=True, text=True, cwd=tmp_path, env=env,
                         check=True).stdout
    assert out.startswith("usage: python -m pagedllm.kernels.compile_check")


def test_reference_tier_runs_without_triton(checkpoints):
    """Block triton's import; the reference tier must still load and generate."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from pagedllm.reference import load_model, generate\n"
            f"print(generate(load_model({str(checkpoints['llama'])!r}), [1, 2, 3], 4))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("[")


def test_no_top_level_kernels_module_is_installed():
    """A top-level `kernels` would shadow Hugging Face's package of that name."""
    code = "import importlib.util as u; print(u.find_spec('kernels'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd="/", check=True).stdout
    assert out.strip() == "None" or "site-packages/kernels" in out


def test_only_ci_prints_the_slowest_tests():
    """A contributor's `pytest -x tests/unit` ends with its result, not a table of the 30
    slowest tests; CI's log keeps that table (it says where the suite's minutes go)."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"]
    assert "--durations" not in addopts
    assert 'PYTEST_ADDOPTS="--durations=30" make test' in (ROOT / ".ci" / "run").read_text()
