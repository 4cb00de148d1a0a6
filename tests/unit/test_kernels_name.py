"""The checkout's ``kernels/`` folder and Hugging Face's ``kernels`` package (issue 43).

A process started in the repository root (``python -m``, ``python -c``, pytest) has the root on
``sys.path``, so the folder ``kernels/`` (the import package ``pagedllm.kernels``) is also found
under the top-level name ``kernels``: the name of a Hugging Face package that transformers probes
for when it loads a tokenizer or a model. The folder has no ``__init__.py``, so under that name it
is only a PEP 420 namespace portion, and a regular package anywhere on ``sys.path`` wins over it:

- Hugging Face's ``kernels`` installed: ``import kernels``, ``find_spec("kernels")`` and
  ``importlib.metadata`` give that package, exactly as outside the checkout.
- not installed: ``importlib.metadata`` raises ``PackageNotFoundError`` and transformers' probe
  says the package is absent, as outside the checkout. ``find_spec("kernels")`` and
  ``import kernels`` give an empty namespace package over ``kernels/`` where outside they give
  ``None`` and ``ModuleNotFoundError``: no layout with a top-level folder named ``kernels`` can
  do better, since Python's path finder takes any directory of that name on ``sys.path`` as a
  namespace portion. transformers reads "no version and no ``__file__``" as exactly that.

Each check runs in a subprocess started in the repository root and compares it with the same
subprocess started outside the checkout. The environment without Hugging Face's package is the
project's own, less that package: ``python -S`` (no site-packages, no ``.pth`` files) with
``PYTHONPATH`` set to a folder of links to every entry of site-packages except ``kernels``, its
``dist-info`` and pagedllm's own install, like lm-evaluation-harness in its own virtual
environment; pagedllm then comes only from the current directory, as in the issue.
"""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "pagedllm" / "models" / "tiny-pydoc"
SITE = Path(importlib.util.find_spec("transformers").origin).parents[1]  # the env's packages
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
HANG_GUARD_S = 600  # only a hang runs this long

try:
    HF_KERNELS = importlib.metadata.version("kernels")
except importlib.metadata.PackageNotFoundError:
    HF_KERNELS = None

# What transformers does with the name: load a tokenizer (the failure), then its probe
# for the package (find_spec, importlib.metadata, as a last resort an import); then what the
# name gives any other caller.
PROBE = r"""
import importlib.metadata, importlib.util, json, sys
from transformers import AutoTokenizer
out = {"tokens": AutoTokenizer.from_pretrained(sys.argv[1])("def f(x):")["input_ids"]}
from transformers.utils import import_utils
out["probe"] = list(import_utils._is_package_available("kernels", return_version=True))
if hasattr(import_utils, "is_kernels_available"):
    out["is_kernels_available"] = import_utils.is_kernels_available()
try:
    out["metadata"] = importlib.metadata.version("kernels")
except importlib.metadata.PackageNotFoundError:
    out["metadata"] = "PackageNotFoundError"
spec = importlib.util.find_spec("kernels")
out["spec"] = None if spec is None else {
    "origin": spec.origin, "locations": list(spec.submodule_search_locations or [])}
try:
    import kernels
    out["import"] = {"file": getattr(kernels, "__file__", None),
                     "path": list(getattr(kernels, "__path__", []))}
except ModuleNotFoundError as e:
    out["import"] = f"ModuleNotFoundError: {e.name}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def without_hf_kernels(tmp_path_factory) -> Path:
    """The folder of links: site-packages less Hugging Face's kernels and pagedllm's install."""
    site = tmp_path_factory.mktemp("site-packages")
    for entry in SITE.iterdir():
        name = entry.name
        if (name == "kernels" or (name.startswith("kernels-") and name.endswith(".dist-info"))
                or name.startswith(("pagedllm-", "__editable__.pagedllm-",
                                    "__editable___pagedllm_"))):
            continue
        (site / name).symlink_to(entry)
    return site


def python(args: list[str], cwd: Path, *site: Path) -> subprocess.CompletedProcess:
    """``python ARGS`` in cwd: in the project's environment, or with ``-S`` and only the given
    folders (site) on PYTHONPATH."""
    env = {**os.environ, **OFFLINE}
    if site:
        env["PYTHONPATH"] = os.pathsep.join(map(str, site))
        args = ["-S", *args]
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=HANG_GUARD_S)


def probe(cwd: Path, *site: Path) -> dict:
    done = python(["-c", PROBE, str(TINY)], cwd, *site)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_as_outside(root: dict, outside: dict) -> None:
    """What the root sees under the name ``kernels`` is what is seen outside the checkout,
    except, when nothing is installed under that name, the namespace portion (the bound)."""
    assert root["tokens"] == outside["tokens"] and root["tokens"]
    for key in ("probe", "is_kernels_available", "metadata"):
        assert root.get(key) == outside.get(key), key
    if outside["spec"] is not None:  # installed: the very same package
        assert root["spec"] == outside["spec"] and root["import"] == outside["import"]
    else:
        assert outside["import"] == "ModuleNotFoundError: kernels"
        namespace = [str(ROOT / "kernels")]
        assert root["spec"] == {"origin": None, "locations": namespace}
        assert root["import"] == {"file": None, "path": namespace}


def test_the_folder_is_only_a_namespace_portion():
    """An ``__init__.py`` (or a ``kernels.py`` beside the folder) would make the checkout's
    ``kernels`` a regular package or module, found before site-packages: it would shadow
    Hugging Face's package, or make transformers import it when that package is absent."""
    assert not (ROOT / "kernels" / "__init__.py").exists()
    assert not [p.name for p in ROOT.iterdir() if p.name.startswith("kernels.")]


def test_with_hugging_faces_kernels_the_root_imports_that_package(tmp_path):
    root, outside = probe(ROOT), probe(tmp_path)
    assert_as_outside(root, outside)
    if HF_KERNELS is None:
        pytest.skip("Hugging Face's kernels is not installed here: the test without it covers this")
    installed = str(SITE / "kernels" / "__init__.py")
    assert root["probe"] == [True, HF_KERNELS] and root["metadata"] == HF_KERNELS
    assert root["spec"]["origin"] == installed and root["import"]["file"] == installed


def test_without_hugging_faces_kernels_the_root_reports_it_absent(tmp_path, without_hf_kernels):
    root, outside = probe(ROOT, without_hf_kernels), probe(tmp_path, without_hf_kernels)
    assert outside["spec"] is None  # the environment really lacks the package
    assert_as_outside(root, outside)
    assert root["probe"] == [False, "N/A"] and root["metadata"] == "PackageNotFoundError"
    assert root.get("is_kernels_available", False) is False


def test_a_bare_checkout_imports_its_kernels(tmp_path, without_hf_kernels):
    """PYTHONPATH=checkout, no editable install's finder: ``pagedllm.kernels`` is the folder
    (pagedllm/__init__.py searches the root), and the name ``kernels`` is left alone."""
    code = ("import sys\n"
            "import pagedllm.kernels.backend, pagedllm.kernels.paged_attention as p\n"
            "print(p.__file__, 'kernels' in sys.modules,\n"
            "      any('__editable__' in repr(finder) for finder in sys.meta_path))\n")
    done = python(["-c", code], tmp_path, ROOT, without_hf_kernels)
    assert done.returncode == 0, done.stderr[-6000:]
    assert done.stdout.split() == [str(ROOT / "kernels" / "paged_attention.py"), "False", "False"]


# -- lm-evaluation-harness from the repository root, as in the issue ------------------------------
@pytest.fixture(scope="module")
def server():
    """The tiny model behind the server (tests/serving's app), on loopback in a thread."""
    from pagedllm.optimized import LLM
    from pagedllm.serving.api_server import ServerThread
    from pagedllm.serving.default_model import default_model_dir
    from tests.serving.conftest import app_for

    with ServerThread(app_for(LLM(default_model_dir(), seed=0))) as running:
        yield running


def lm_eval(cwd: Path, site: Path, url: str, tasks: Path, out: Path) -> dict:
    """``python -m lm_eval --model local-completions`` on two examples of each local task;
    its results (the scores per task)."""
    from tests.serving.conftest import MODEL

    args = ["-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={TINY},max_retries=1,max_length=1024",
            "--tasks", "pagedllm_tiny_mc,pagedllm_tiny_gen", "--include_path", str(tasks),
            "--limit", "2", "--batch_size", "1", "--output_path", str(out)]
    done = python(args, cwd, site)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    (results,) = out.rglob("results_*.json")
    return json.loads(results.read_text())["results"]


def test_lm_eval_local_completions_from_the_root_without_hf_kernels(
        tmp_path, without_hf_kernels, server):
    pytest.importorskip("lm_eval")
    from tests.serving.test_lm_eval import task_configs

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for config in task_configs():  # the shipped tasks, their data files made absolute
        (tasks / f"{config['task']}.yaml").write_text(yaml.safe_dump(config))
    (tmp_path / "elsewhere").mkdir()
    root = lm_eval(ROOT, without_hf_kernels, server.url, tasks, tmp_path / "root")
    outside = lm_eval(tmp_path / "elsewhere", without_hf_kernels, server.url, tasks,
                      tmp_path / "outside")
    assert set(root) == {"pagedllm_tiny_mc", "pagedllm_tiny_gen"}
    assert root == outside
