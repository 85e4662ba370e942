#!/usr/bin/env bash
# Builds benchmarks/gpu/carry/: what the GPU machine lacks for the kit, to travel with one
# device call (no network there). Wheels for CPython 3.12 x86_64 of DeepSpeed (pure Python,
# ops built just in time there), pydantic and the other pure dependencies the runtime imports
# that the machine's image does not hold, our own package, and libaio unpacked from Debian
# packages (.so and header) for DeepSpeed's async-I/O op. The folder must stay under the
# device tool's 64 MiB for a carried tree; it is rebuilt only when its inputs change.
set -euo pipefail

cd "$(dirname "$0")/../.."
ROOT=$PWD
CARRY=benchmarks/gpu/carry
PY=${PYTHON:-$ROOT/.venv/bin/python}
LIMIT=$((64 << 20))

# Versions are the lock file's (one definition per fact); the image already has torch,
# transformers, peft, numpy, psutil, py-cpuinfo, msgpack, einops, ninja, tqdm, pyyaml, rich, typer;
# typing-extensions travels anyway: pydantic-core needs 4.14+ (typing_extensions.Sentinel).
PINNED=(deepspeed pydantic pydantic-core pydantic-settings annotated-types typing-inspection typing-extensions hjson python-dotenv)

pin() {
  local name=$1 line
  line=$(grep -iE "^${name//-/[-_]}==" requirements.lock | head -1)
  [[ -n $line ]] || { echo "prepare.sh: $name is not pinned in requirements.lock" >&2; exit 1; }
  echo "$line"
}

inputs_hash() {
  {
    cat "$0" pyproject.toml requirements.lock
    git ls-files -s runtime operator api
    git diff HEAD -- runtime operator api pyproject.toml
    git ls-files --others --exclude-standard runtime operator api | xargs -r cat
  } | sha256sum | cut -c1-16
}

HASH=$(inputs_hash)
if [[ -f $CARRY/.inputs && $(cat "$CARRY/.inputs") == "$HASH" ]]; then
  echo "carry is up to date ($HASH)"
else
  rm -rf "$CARRY"
  mkdir -p "$CARRY/wheels" "$CARRY/libaio"
  specs=()
  for name in "${PINNED[@]}"; do specs+=("$(pin "$name")"); done

  # pure Python: DeepSpeed's sdist builds with no ops (DS_BUILD_OPS=0), they are JIT-built there.
  # --no-cache-dir: pip's wheel cache holds this machine's cp311 build with its ops compiled in
  # (hack/setup.sh), which pip on the GPU machine's Python 3.12 refuses.
  deepspeed_spec=${specs[0]}
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation -w "$CARRY/wheels" "$deepspeed_spec" \
    || DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-cache-dir --no-deps -w "$CARRY/wheels" "$deepspeed_spec"
  "$PY" -m pip download -q --only-binary=:all: --no-deps --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$CARRY/wheels" "${specs[@]:1}"
  # our package (runtime, operator and api share one distribution)
  "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$CARRY/wheels" .
  rm -rf build ./*.egg-info runtime/*.egg-info operator/*.egg-info api/*.egg-info

  # libaio: the shared object and its header, unpacked (links resolved: a carried tree keeps
  # links only as links)
  debs=$(mktemp -d)
  (cd "$debs" && apt-get download -q libaio1t64 libaio-dev 2>/dev/null || apt-get download -q libaio1 libaio-dev)
  unpacked=$(mktemp -d)
  for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$unpacked"; done
  mkdir -p "$CARRY/libaio/include" "$CARRY/libaio/lib"
  cp -L "$unpacked"/usr/include/libaio.h "$CARRY/libaio/include/"
  cp -L "$unpacked"/usr/lib/x86_64-linux-gnu/libaio.so* "$CARRY/libaio/lib/"
  rm -rf "$debs" "$unpacked"
  echo "$HASH" > "$CARRY/.inputs"
fi

ls -1 "$CARRY/wheels" "$CARRY/libaio/lib"
# every wheel must install on CPython 3.12 x86_64: pure (py3-none-any) or tagged cp312
for wheel in "$CARRY"/wheels/*.whl; do
  case $(basename "$wheel") in
    *-py3-none-any.whl | *-cp312-cp312-*x86_64*.whl) ;;
    *) echo "prepare.sh: $(basename "$wheel") will not install on CPython 3.12 x86_64" >&2; exit 1 ;;
  esac
done
size=$(du -sb "$CARRY" | cut -f1)
echo "carry: $CARRY $((size / 1024)) KiB ($size bytes)"
if (( size >= LIMIT )); then
  echo "prepare.sh: $CARRY is $size bytes, at or over the device tool's 64 MiB" >&2
  exit 1
fi
