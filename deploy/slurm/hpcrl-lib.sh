# shellcheck shell=bash
# Functions shared by the hpcrl Slurm batch scripts (sourced, never run).
#
# Settings and credentials come from files, never from the command line: whatever is on a
# command line (sbatch's, srun's or a service's) is visible to every user of the node in `ps`.
#
#   $HPCRL_ENV_DIR/common.env   optional: settings every role shares (HPCRL_CONFIG, the CA
#                               file, the namespace, ...)
#   $HPCRL_ENV_DIR/<role>.env   the role's broker user and its password file:
#                                 HPCRL__BROKER__URL=amqps://hpcrl-benchmarker@broker.example.org:5671/hpcrl-exp1
#                                 HPCRL__BROKER__PASSWORD_FILE=/home/me/.config/hpcrl/hpcrl-benchmarker.password
#
# HPCRL_ENV_DIR defaults to ~/.config/hpcrl. Every file named there (env files, password
# file, TLS key) must belong to the job's user and be readable by nobody else (chmod 600):
# the job refuses to start otherwise. The files are read as KEY=VALUE lines (comments and
# blank lines allowed, optional quotes), not executed, so the same files serve systemd's
# EnvironmentFile=.
#
# HPCRL_VENV is the virtual environment holding the hpcrl-* commands (default ~/hpcrl/venv).
# HPCRL_SITE_SETUP, if set, is a script sourced first (module loads, proxies): your own code.

hpcrl_log() { printf '%s hpcrl[%s]: %s\n' "$(date '+%F %T')" "${SLURM_JOB_ID:-local}" "$*" >&2; }
hpcrl_die() { hpcrl_log "error: $*"; exit "${HPCRL_DIE_STATUS:-1}"; }

# hpcrl_check_private FILE: FILE exists, is ours and has no group/other permission bits.
hpcrl_check_private() {
  local file=$1 mode owner
  [[ -f $file ]] || { hpcrl_log "error: $file does not exist"; return 1; }
  mode=$(stat -L -c '%a' -- "$file") owner=$(stat -L -c '%u' -- "$file")
  if [[ $owner != "$(id -u)" ]]; then
    hpcrl_log "error: $file belongs to uid $owner, not to this job's user ($(id -u))"
    return 1
  fi
  if (( (8#$mode & 8#077) != 0 )); then
    hpcrl_log "error: $file has mode $mode; other users may read it: chmod 600 $file"
    return 1
  fi
}

# hpcrl_load_env_file FILE: export its KEY=VALUE lines (no shell expansion, nothing run).
hpcrl_load_env_file() {
  local file=$1 line key value number=0
  hpcrl_check_private "$file" || return 1
  while IFS= read -r line || [[ -n $line ]]; do
    number=$((number + 1))
    line=${line#"${line%%[![:space:]]*}"}
    [[ -z $line || $line == '#'* || $line == ';'* ]] && continue
    if [[ ! $line =~ ^(export[[:space:]]+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]]; then
      hpcrl_log "error: $file:$number is not KEY=VALUE"
      return 1
    fi
    key=${BASH_REMATCH[2]} value=${BASH_REMATCH[3]}
    if [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]]; then
      value=${BASH_REMATCH[1]}
    fi
    export "$key=$value"
  done <"$file"
}

# hpcrl_url_has_password URL: true when the URL carries user:password@.
hpcrl_url_has_password() {
  [[ $1 =~ ^[A-Za-z][A-Za-z0-9+.-]*://[^/@]*:[^/@]+@ ]]
}

# hpcrl_role_env ROLE: load common.env and ROLE.env, then check the broker credentials.
# Call it in the subshell that runs the role's process (roles differ in user and password).
hpcrl_role_env() {
  local role=$1 dir=${HPCRL_ENV_DIR:-$HOME/.config/hpcrl} file
  if [[ -f $dir/common.env ]]; then
    hpcrl_load_env_file "$dir/common.env" || return 1
  fi
  hpcrl_load_env_file "$dir/$role.env" || return 1
  if [[ -z ${HPCRL__BROKER__URL:-} ]]; then
    hpcrl_log "error: $dir/$role.env must set HPCRL__BROKER__URL (without a password)"
    return 1
  fi
  if hpcrl_url_has_password "$HPCRL__BROKER__URL"; then
    hpcrl_log "error: HPCRL__BROKER__URL in $dir/$role.env carries a password;" \
      "put it in a file named by HPCRL__BROKER__PASSWORD_FILE instead"
    return 1
  fi
  if [[ -z ${HPCRL__BROKER__PASSWORD_FILE:-} ]]; then
    hpcrl_log "error: $dir/$role.env must set HPCRL__BROKER__PASSWORD_FILE"
    return 1
  fi
  for file in "$HPCRL__BROKER__PASSWORD_FILE" ${HPCRL__BROKER__TLS_KEY_FILE:+"$HPCRL__BROKER__TLS_KEY_FILE"}; do
    hpcrl_check_private "$file" || return 1
  done
  if [[ -n ${HPCRL__BROKER__TLS_CA_FILE:-} && ! -r $HPCRL__BROKER__TLS_CA_FILE ]]; then
    hpcrl_log "error: HPCRL__BROKER__TLS_CA_FILE=$HPCRL__BROKER__TLS_CA_FILE is not readable"
    return 1
  fi
  hpcrl_config_has_no_password || return 1
  hpcrl_log "$role: broker ${HPCRL__BROKER__URL} (password from $HPCRL__BROKER__PASSWORD_FILE)"
}

# The experiment TOML is shared and often world-readable: it must not hold a password either.
hpcrl_config_has_no_password() {
  [[ -n ${HPCRL_CONFIG:-} ]] || return 0
  [[ -r $HPCRL_CONFIG ]] || { hpcrl_log "error: HPCRL_CONFIG=$HPCRL_CONFIG is not readable"; return 1; }
  "$HPCRL_VENV/bin/python" - <<'PY' || return 1
import os, sys, tomllib
from urllib.parse import urlsplit
path = os.environ["HPCRL_CONFIG"]
with open(path, "rb") as handle:
    url = tomllib.load(handle).get("broker", {}).get("url", "")
if isinstance(url, str) and urlsplit(url).password:
    sys.exit(f"error: broker.url in {path} carries a password; use broker.password_file")
PY
}

# hpcrl_setup: what every script does first.
hpcrl_setup() {
  umask 077
  if [[ -n ${HPCRL_SITE_SETUP:-} ]]; then
    # shellcheck source=/dev/null
    source "$HPCRL_SITE_SETUP"
  fi
  HPCRL_VENV=${HPCRL_VENV:-$HOME/hpcrl/venv}
  export HPCRL_VENV
  [[ -x $HPCRL_VENV/bin/python ]] || hpcrl_die "no Python in HPCRL_VENV=$HPCRL_VENV"
  if [[ -n ${HPCRL_CONFIG:-} ]]; then export HPCRL_CONFIG; fi
  HPCRL_LOG_DIR=${HPCRL_LOG_DIR:-${SLURM_SUBMIT_DIR:-$PWD}/logs/${SLURM_JOB_ID:-local}}
  mkdir -p "$HPCRL_LOG_DIR"
  HPCRL_CHILDREN=()
  HPCRL_SD_FILES=()
  trap hpcrl_stop_children TERM INT
  trap hpcrl_cleanup EXIT
}

# hpcrl_supervise NAME COMMAND...: run COMMAND, restart it when it fails (at most
# $HPCRL_MAX_RESTARTS times, default 5, after $HPCRL_RESTART_PAUSE seconds, default 10,
# times the number of restarts so far), stop it on SIGTERM/SIGINT.
# Exit status 0 (a finished scheduler, a clean stop), 2 (bad settings) and 3 (host refused,
# e.g. no AVX-512) are final. Meant to run in the background: hpcrl_supervise ... &
hpcrl_supervise() {
  local name=$1 child=0 stopping=0 restarts=0 rc pause
  shift
  trap 'stopping=1; if ((child > 0)); then kill -TERM "$child" 2>/dev/null; fi' TERM INT
  trap - EXIT
  while true; do
    "$@" &
    child=$!
    while true; do
      rc=0
      wait "$child" || rc=$?
      kill -0 "$child" 2>/dev/null || break
    done
    child=0
    if ((stopping)); then
      hpcrl_log "$name stopped (status $rc)"
      return 0
    fi
    if ((rc == 0 || rc == 2 || rc == 3)); then
      hpcrl_log "$name exited with status $rc; not restarting it"
      return "$rc"
    fi
    restarts=$((restarts + 1))
    if ((restarts > ${HPCRL_MAX_RESTARTS:-5})); then
      hpcrl_log "$name failed $restarts times; giving up (status $rc)"
      return "$rc"
    fi
    pause=$((restarts * ${HPCRL_RESTART_PAUSE:-10}))
    hpcrl_log "$name exited with status $rc; restart $restarts in ${pause} s"
    sleep "$pause" &
    wait $! || true
    if ((stopping)); then return 0; fi
  done
}

# hpcrl_start NAME COMMAND...: supervise COMMAND in the background, log to $HPCRL_LOG_DIR/NAME.log.
hpcrl_start() {
  local name=$1
  shift
  hpcrl_supervise "$name" "$@" >>"$HPCRL_LOG_DIR/$name.log" 2>&1 &
  HPCRL_CHILDREN+=("$!")
  hpcrl_log "started $name (pid $!, log $HPCRL_LOG_DIR/$name.log)"
}

# hpcrl_wait_children: wait for every started process; the job's status is the worst one.
hpcrl_wait_children() {
  local pid rc status=0
  for pid in "${HPCRL_CHILDREN[@]}"; do
    while true; do
      rc=0
      wait "$pid" || rc=$?
      kill -0 "$pid" 2>/dev/null || break
    done
    if ((rc > status)); then status=$rc; fi
  done
  return "$status"
}

hpcrl_stop_children() {
  local pid
  hpcrl_log "stopping: SIGTERM to ${#HPCRL_CHILDREN[@]} supervised process(es)"
  for pid in "${HPCRL_CHILDREN[@]}"; do
    kill -TERM "$pid" 2>/dev/null || true
  done
}

# hpcrl_announce JOB PORT: with $HPCRL_PROMETHEUS_SD_DIR set (a directory Prometheus reads,
# e.g. on the shared filesystem), write a file_sd target file for this replica; removed at exit.
hpcrl_announce() {
  local job=$1 port=$2 dir=${HPCRL_PROMETHEUS_SD_DIR:-} file
  [[ -n $dir ]] || return 0
  mkdir -p "$dir"
  file="$dir/$job-$(hostname -s)-$port.json"
  printf '[{"targets": ["%s:%s"], "labels": {"slurm_job": "%s"}}]\n' \
    "$(hostname -f)" "$port" "${SLURM_JOB_ID:-local}" >"$file.tmp"
  chmod 644 "$file.tmp"
  mv -f "$file.tmp" "$file"
  HPCRL_SD_FILES+=("$file")
}

hpcrl_cleanup() {
  local file
  for file in "${HPCRL_SD_FILES[@]}"; do
    rm -f "$file"
  done
}
