#!/bin/bash
# Install the hpcrl systemd units on this host (run as root from the repository checkout):
#
#   deploy/systemd/install.sh                 units, helper, /etc/hpcrl skeleton, user hpcrl
#   DESTDIR=/tmp/root deploy/systemd/install.sh   the same files under another root only
#                                             (no user, no daemon-reload: for packaging/tests)
#
# It installs files and nothing else: the Python environment (/opt/hpcrl/venv), the
# experiment TOML, the password files and enabling units are the operator's steps
# (deploy/README.md, "systemd"). Existing env files are never overwritten.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=${DESTDIR:-}
units=(hpcrl-benchmarker@.service hpcrl-generator.service hpcrl-learner.service hpcrl-scheduler.service)

install -d -m 0755 "$root/etc/systemd/system" "$root/opt/hpcrl/libexec" "$root/etc/hpcrl"
install -d -m 0700 "$root/etc/hpcrl/credentials"
for unit in "${units[@]}"; do
  install -m 0644 "$here/$unit" "$root/etc/systemd/system/$unit"
done
install -m 0755 "$here/hpcrl-benchmarker-instance" "$root/opt/hpcrl/libexec/hpcrl-benchmarker-instance"

# Env files: root-only (they name the broker user and files; systemd reads them as root).
if [[ ! -e $root/etc/hpcrl/common.env ]]; then
  install -m 0600 "$here/common.env.example" "$root/etc/hpcrl/common.env"
fi
for service in scheduler generator learner benchmarker; do
  if [[ ! -e $root/etc/hpcrl/$service.env ]]; then
    sed "s/hpcrl-benchmarker@/hpcrl-$service@/" "$here/service.env.example" >"$root/etc/hpcrl/$service.env"
    chmod 0600 "$root/etc/hpcrl/$service.env"
  fi
done

if [[ -z $root ]]; then
  if ! id hpcrl >/dev/null 2>&1; then
    useradd --system --home-dir /var/lib/hpcrl --no-create-home --shell /usr/sbin/nologin hpcrl
  fi
  systemctl daemon-reload
fi
echo "installed: ${units[*]} and /opt/hpcrl/libexec/hpcrl-benchmarker-instance under ${root:-/}"
echo "next: /opt/hpcrl/venv, /etc/hpcrl/experiment.toml, /etc/hpcrl/*.env," \
  "/etc/hpcrl/credentials/hpcrl-<role>.password (0600), then systemctl enable --now ..."
