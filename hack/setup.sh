#!/usr/bin/env bash
# Installs everything Spillway needs on a fresh Debian machine, idempotently:
# system packages (libaio-dev for DeepSpeed's async I/O, PostgreSQL for the DB tests,
# Chromium for the dashboard's browser tests),
# a virtual environment outside the repository with the pinned dependencies (so clones
# share the multi-GB torch install), this checkout's .venv on top of it, and DeepSpeed's
# CPU ops built once.
# A second run that finds everything in place takes a few seconds.
#   hack/setup.sh            everything
#   hack/setup.sh --demo     what `spillway run` on this machine needs (make demo): libaio and
#                            the Python environment, none of the test suite's servers and tools
#   hack/setup.sh --system   the system packages only (hack/test.sh starts the Go builds
#                            first, then the image build, which needs buildah)
#   hack/setup.sh --wheels   the system packages and the torch + DeepSpeed wheels only;
#                            prints the wheels' folder (hack/images mounts it)
#   hack/setup.sh --packages [--demo]   print the system packages it would need, install nothing
set -euo pipefail
cd "$(dirname "$0")/.."

SPILLWAY_CACHE=${SPILLWAY_CACHE:-$HOME/.cache/spillway}
VENV=${SPILLWAY_VENV:-$SPILLWAY_CACHE/venv}
PYTHON=${PYTHON:-python3}

log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }

print_packages=0 demo=0
while (($#)); do
  case $1 in
  --packages) print_packages=1; shift ;;
  --demo) demo=1; shift ;;
  *) break ;;
  esac
done
# libaio-dev: DeepSpeed's async I/O, the one system package a local run needs. The test suite
# and `make demo-cluster` need the rest: postgresql for the database tests; chromium for the
# dashboard's browser tests (driven by Playwright with this executable, nothing downloaded);
# the test cluster's real node (hack/cluster): containerd, runc, the CNI plugins, iptables
# (kube-proxy), socat (the API server's bridge out of the cluster's network namespace), and
# buildah + mmdebstrap to build its images with no registry (hack/images).
pkgs=(libaio-dev)
((demo)) || pkgs+=(postgresql chromium containerd runc containernetworking-plugins iptables conntrack ipset socat
  buildah mmdebstrap)
if ((print_packages)); then printf '%s\n' "${pkgs[@]}"; exit 0; fi
need_pkgs=()
for pkg in "${pkgs[@]}"; do
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
  "$VENV/bin/pip" install -q --upgrade pip
fi

# The wheels of the training image's slow layer (torch, DeepSpeed with its CPU ops compiled
# ahead of time, and what they need; docker/deepspeed.lock), made once and used twice: this
# environment installs from them and hack/images mounts them into the image build, so a
# fresh machine downloads torch once and compiles DeepSpeed's ops once (they were done
# twice, ~35 minutes of a cold `make test`). hack/images finds them with `--wheels`.
# fused_adam is the optimizer's step where it stays on the device (on a CPU node, the CPU):
# a pod has no compiler to JIT-compile it (recipe 1 lacked it; such a pod exited 1).
WHEELS_RECIPE=2  # bump to rebuild the wheels after changing how they are made
WHEELS="$SPILLWAY_CACHE/wheels-$( (echo "$WHEELS_RECIPE"; cat docker/deepspeed.lock) | sha256sum | cut -c1-16)"
make_wheels() {
  log "making the torch + DeepSpeed wheels (first time: downloads torch, compiles DeepSpeed's CPU ops, ~10 minutes)"
  exec 8>"$SPILLWAY_CACHE/.wheels.lock"
  flock 8
  if [ ! -d "$WHEELS" ]; then
    rm -rf "$SPILLWAY_CACHE"/.wheels.*/  # what a failed try left (we hold the lock)
    tmp=$(mktemp -d "$SPILLWAY_CACHE/.wheels.XXXXXX")
    # setuptools: torch needs one at run time (>=77), the Dockerfile pins its own.
    { grep -v '^deepspeed==' docker/deepspeed.lock; echo setuptools==84.2.1; echo wheel==0.45.1; } >"$tmp/binary.txt"
    "$VENV/bin/pip" download -q --no-deps --only-binary=:all: -d "$tmp" -r "$tmp/binary.txt"
    # DeepSpeed is an sdist: its ops are compiled against the torch installed beside it
    # (no build isolation), as the Dockerfile does, into a wheel of this Python's ABI
    # (cp311 on Debian 12: the image's python3 too). LDFLAGS: the ahead-of-time build of
    # the CPU accelerator's ops drops their link flags, so async_io would miss libaio.
    # --no-cache-dir: pip's wheel cache keys a build by the sdist alone, not DS_BUILD_*.
    "$VENV/bin/pip" install -q --no-index --find-links "$tmp" -r "$tmp/binary.txt"
    DS_ACCELERATOR=cpu LDFLAGS="-Wl,--no-as-needed -laio" DS_BUILD_AIO=1 DS_BUILD_CPU_ADAM=1 \
      DS_BUILD_FUSED_ADAM=1 DS_BUILD_UTILS=1 DS_BUILD_PIN_MEMORY=1 DS_BUILD_SHM_COMM=1 \
      "$VENV/bin/pip" wheel -q --no-cache-dir --no-deps --no-build-isolation -w "$tmp" "$(grep '^deepspeed==' docker/deepspeed.lock)"
    rm "$tmp/binary.txt"
    chmod 755 "$tmp"
    mv "$tmp" "$WHEELS"
  fi
  exec 8>&-
}
[ -d "$WHEELS" ] || make_wheels >&2
if [ "${1:-}" = "--wheels" ]; then echo "$WHEELS"; exit 0; fi

# The shared environment holds the pinned dependencies only (several GB, reused by every
# checkout); re-install when the pins change. torch and DeepSpeed come from the wheels.
deps_stamp="$VENV/.spillway-deps-$( (cat requirements.lock; basename "$WHEELS") | sha256sum | cut -c1-16)"
if [ ! -f "$deps_stamp" ]; then
  log "installing pinned Python dependencies"
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" -r docker/deepspeed.lock setuptools==84.2.1
  # The same DeepSpeed version from wheels made another way (other ops compiled in) is not
  # an upgrade to pip: replace it.
  "$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" --force-reinstall --no-deps \
    "$(grep '^deepspeed==' docker/deepspeed.lock)"
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
  log "building DeepSpeed CPU ops (cpu_adam, fused_adam, async_io, shm comm): first time only, ~5-10 minutes"
  DS_ACCELERATOR=cpu "$VENV/bin/python" - <<'PY'
from deepspeed.accelerator import get_accelerator
accelerator = get_accelerator()
for name in ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder", "ShareMemCommBuilder", "PinMemoryBuilder"):
    builder = accelerator.create_op_builder(name)
    if builder is None:
        continue
    builder.load()
    print(f"built {name}")
PY
  touch "$ops_stamp"
fi
log "ready: $PROJECT_VENV (dependencies from $VENV)"
