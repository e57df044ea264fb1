#!/usr/bin/env bash
# Create the learner's ms-swift environment: a venv of its own (default .venv-swift), because
# ms-swift 4.6.0 caps transformers (<5.20) and peft (<0.21) below what the shared .venv has.
# Installs torch==2.13.0 first (the local wheel; a constraint keeps every later step from
# replacing it), then ./libs/common and ./services/learner[swift]. Safe to run again: it does
# nothing when the venv already imports everything the swift backend's CPU part needs.
#
#   SWIFT_VENV=path   where the venv goes (default .venv-swift at the repository root)
#   PYTHON=python3.11 the interpreter that creates it
#
# On a GPU cluster the same script builds the environment; Megatron-Core, Transformer Engine,
# flash-attn and apex are then installed into it for the CUDA version of the nodes (see
# services/learner/README.md, "swift backend").
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${SWIFT_VENV:-.venv-swift}
python=${PYTHON:-python3}
py="$venv/bin/python"
torch_pin=2.13.0
check='import swift, msgspec, ray, zmq, torch, transformers, peft, hpcrl_learner.backends.swift.convert
from swift.rl_core.data import GRPOBatch
from swift.rlhf_trainers.utils import collate_to_grpo_micro_batch
assert torch.__version__.split("+")[0] == "'$torch_pin'", torch.__version__'

if [ -x "$py" ] && "$py" -c "$check" >/dev/null 2>&1; then
  exit 0
fi

started=$(date +%s)
echo "creating $venv with ms-swift (a few minutes, about 2 GB)"
test -x "$py" || "$python" -m venv "$venv"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q "torch==$torch_pin"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_pin" >"$constraints"
# Editable, like the shared .venv, so a checkout's edits are what runs; the learner names
# libs/common by path, which installs a copy: make that editable again last.
"$py" -m pip install -q -c "$constraints" -e "./services/learner[swift]"
"$py" -m pip install -q --no-deps -e ./libs/common

installed=$("$py" -c "import torch; print(torch.__version__)")
case "$installed" in
  "$torch_pin"|"$torch_pin"+*) ;;
  *) echo "torch is $installed in $venv, expected $torch_pin" >&2; exit 1 ;;
esac
"$py" -c "$check"
"$py" -c "import swift, transformers, peft; print('ms-swift', swift.__version__, \
'transformers', transformers.__version__, 'peft', peft.__version__, 'ok')"
echo "$venv ready in $(( $(date +%s) - started )) s, $(du -sh "$venv" | cut -f1)"
