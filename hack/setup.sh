#!/usr/bin/env bash
# Installs everything Spillway needs on a fresh Debian machine, idempotently:
# system packages (libaio-dev for DeepSpeed's async I/O, PostgreSQL for the DB tests,
# Chromium for the dashboard's browser tests),
# a virtual environment outside the repository with the pinned dependencies (so clones
# share the multi-GB torch install), this checkout's .venv on top of it, and DeepSpeed's
# CPU ops built once.
# A second run that finds everything in place takes a few seconds.
#   hack/setup.sh            everything
#   hack/setup.sh --system   the system packages only (hack/test.sh starts the image
#                            build, which needs buildah, before the Python set-up)
set -euo pipefail
cd "$(dirname "$0")/.."

SPILLWAY_CACHE=${SPILLWAY_CACHE:-$HOME/.cache/spillway}
VENV=${SPILLWAY_VENV:-$SPILLWAY_CACHE/venv}
PYTHON=${PYTHON:-python3}

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

need_pkgs=()
# libaio-dev: DeepSpeed's async I/O; postgresql: the database tests; chromium: the
# dashboard's browser tests (driven by Playwright with this executable, nothing downloaded);
# the test cluster's real node (hack/cluster): containerd, runc, the CNI plugins, iptables
# (kube-proxy), socat (the API server's bridge out of the cluster's network namespace), and
# buildah + mmdebstrap to build its images with no registry (hack/images).
for pkg in libaio-dev postgresql chromium containerd runc containernetworking-plugins iptables \
  conntrack socat buildah mmdebstrap; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_pkgs+=("$pkg")
done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  log "installing system packages: ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi

if [ "${1:-}" = "--system" ]; then exit 0; fi

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "Python 3.11 or newer is required (found $("$PYTHON" --version))" >&2; exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtual environment $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi

# The shared environment holds the pinned dependencies only (several GB, reused by every
# checkout); re-install when the pins change.
deps_stamp="$VENV/.spillway-deps-$(sha256sum requirements.lock | cut -c1-16)"
if [ ! -f "$deps_stamp" ]; then
  log "installing pinned Python dependencies (first time: several GB for torch)"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q -r requirements.lock
  rm -f "$VENV"/.spillway-deps-*
  touch "$deps_stamp"
fi

# This checkout's own environment (.venv, seconds to make): the shared dependencies plus
# this checkout's packages, so several clones never fight over one editable install.
PROJECT_VENV="$(pwd)/.venv"
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ ! -x "$PROJECT_VENV/bin/python" ]; then
  "$PYTHON" -m venv --without-pip "$PROJECT_VENV"
fi
shared_site=$(site_of "$VENV")
project_site=$(site_of "$PROJECT_VENV")
cat > "$project_site/spillway_checkout.pth" <<PTH
$(pwd)/runtime
$(pwd)/operator
$(pwd)/api
import site; site.addsitedir("$shared_site")
PTH
cat > "$PROJECT_VENV/bin/spillway" <<SH
#!$PROJECT_VENV/bin/python
import sys
from spillway_api.cli import main
sys.exit(main())
SH
chmod +x "$PROJECT_VENV/bin/spillway"

# DeepSpeed JIT-compiles its CPU Adam and async I/O ops on first use (several minutes
# on 2 cores); build them here, once, so that no test or run pays for it.
ops_stamp="$SPILLWAY_CACHE/.ds-ops-$(grep -E '^(deepspeed|torch)==' requirements.lock | sha256sum | cut -c1-16)"
if [ ! -f "$ops_stamp" ]; then
  log "building DeepSpeed CPU ops (cpu_adam, async_io, shm comm): first time only, ~5-10 minutes"
  DS_ACCELERATOR=cpu "$VENV/bin/python" - <<'PY'
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
for name in ("CPUAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder", "PinMemoryBuilder"):
    builder = accelerator.create_op_builder(name)
    if builder is None:
        continue
    builder.load()
    print(f"built {name}")
PY
  touch "$ops_stamp"
fi
log "ready: $PROJECT_VENV (dependencies from $VENV)"
