#!/usr/bin/env bash
# Install the system packages hpcrl needs on a Debian machine when they are missing, and make
# sure RabbitMQ answers on 127.0.0.1:5672. Safe to run again: it only acts on what is missing.
set -euo pipefail

packages=(gcc make binutils libopenblas-dev bubblewrap rabbitmq-server prometheus shellcheck python3-seccomp)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "installing system packages: ${missing[*]}"
  sudo_cmd=""; [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

exec "$(dirname "$0")/ensure-rabbitmq.sh"
