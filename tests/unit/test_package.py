"""One distribution, `pagedllm`; the top-level folders are its namespaced import packages."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reference", "optimized", "kernels", "serving")


def test_normal_install_from_a_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("pagedllm-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for pkg in PACKAGES:
        assert f"pagedllm/{pkg}/__init__.py" in names
    assert "pagedllm/reference/model/loader.py" in names
    assert "pagedllm/optimized/csrc/cpu_ops.cpp" in names  # the CPU kernel builds from it
    assert not any(n.startswith(("tests/", "reference/", "kernels/")) for n in names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    code = ("import pagedllm.reference as r, pagedllm.kernels, pagedllm.serving.cli; "
            "print(r.__file__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(target)}, check=True).stdout
    assert out.strip().startswith(str(target))


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


def test_a_top_level_kernels_import_from_the_checkout_is_hugging_faces():
    """From the repository root (python -c, python -m, pytest) ``kernels/`` is importable as
    ``kernels``; transformers imports Hugging Face's package by that name when it loads a
    model, so there it must be that package (or absent, as outside the checkout)."""
    code = ("import importlib.util as u\n"
            "if u.find_spec('kernels') is None: print('absent')\n"
            "else:\n"
            "    try:\n"
            "        import kernels; print(kernels.__file__)\n"
            "    except ModuleNotFoundError: print('absent')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "absent" or "site-packages" in out, out


def test_only_ci_prints_the_slowest_tests():
    """A contributor's `pytest -x tests/unit` ends with its result, not a table of the 30
    slowest tests; CI's log keeps that table (it says where the suite's minutes go)."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"]
    assert "--durations" not in addopts
    assert 'PYTEST_ADDOPTS="--durations=30" make test' in (ROOT / ".ci" / "run").read_text()
