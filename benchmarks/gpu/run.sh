#!/usr/bin/env bash
# Runs the GPU validation kit on a lent GPU machine, from the repository root, with $OUT set
# and benchmarks/gpu/carry/ carried (built here by prepare.sh). No network there: everything
# installs from the carried wheels, beside the image's torch, transformers and peft. Each
# stage has a hard timeout and the whole call ends within RUN_SECONDS (default 9 minutes);
# results land in $OUT as they come: preflight.txt (the machine, in the first seconds),
# ops.json (each DeepSpeed op's build), gpu_kit.json and gpu_kit.md (rewritten after every
# stage), stages.jsonl and run.log.
#
# Device call: carry ["benchmarks/gpu/carry"], timeout_s at least RUN_SECONDS + 30, command
#   RUN_SECONDS=480 bash benchmarks/gpu/run.sh
# HOST_MEMORY_GIB (default 120) is what the planner is told the host has: a Firecracker VM's
# MemTotal starts far below its 128 GiB and grows as memory is used.
set -uo pipefail

cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder results go to}"
CARRY=$PWD/benchmarks/gpu/carry
RUN_SECONDS=${RUN_SECONDS:-540}
START=$SECONDS
PY=${PYTHON:-python3}
LOG=$OUT/run.log
mkdir -p "$OUT"
exec > >(tee -a "$LOG") 2>&1

left() { echo $((RUN_SECONDS - (SECONDS - START))); }
stage() {  # stage NAME SECONDS COMMAND...: timed, bounded by its share and by what is left
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  (( limit > $(left) - 10 )) && limit=$(( $(left) - 10 ))
  (( limit > 0 )) || { echo "== $name: skipped, no time left"; return 1; }
  echo "== $name (at most ${limit} s)"
  timeout -k 5 "$limit" "$@"
  rc=$?
  echo "== $name: rc $rc in $((SECONDS - t0)) s"
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >> "$OUT/stages.jsonl"
  return $rc
}

[[ ${KIT_INSTALL:-1} == 0 || -d $CARRY/wheels ]] || { echo "no $CARRY: run benchmarks/gpu/prepare.sh here first and carry it"; exit 2; }

# ---------------------------------------------------------------- where it runs
# The swap files need a real disk: tmpfs would put the "NVMe" in RAM and refuses O_DIRECT,
# which DeepSpeed's async I/O opens its files with. The first candidate that takes both.
o_direct() {  # o_direct DIR: exit 0 when a file in DIR opens with O_DIRECT
  "$PY" -c "import os, sys; p = os.path.join(sys.argv[1], '.o_direct'); os.close(os.open(p, os.O_CREAT | os.O_WRONLY | os.O_DIRECT)); os.unlink(p)" "$1" 2>/dev/null
}
WORK=
for dir in ${KIT_WORK:-} /var/tmp/gpu-kit-work /tmp/gpu-kit-work "$PWD/.gpu-kit-work"; do
  mkdir -p "$dir" 2>/dev/null || continue
  if [[ $(stat -f -c %T "$dir") != tmpfs ]] && o_direct "$dir"; then WORK=$dir; break; fi
done

# ---------------------------------------------------------------- the CUDA build environment
unset DS_ACCELERATOR
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null | head -1)
export CUDA_HOME=${CUDA_HOME:-$( [[ -n $NVCC ]] && dirname "$(dirname "$(readlink -f "$NVCC")")")}
export CC=${CC:-$(command -v gcc)} CXX=${CXX:-$(command -v g++)}
# async_io's CUDA flavour links -lcuda -lcudart: libcuda.so is the driver's (its folder, or the
# toolkit's stubs for the link alone); libcudart.so the toolkit's
LIBCUDA_DIR=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF; exit}' | xargs -r dirname)
LINK_DIRS=
for dir in "$CUDA_HOME/lib64" "$CUDA_HOME/lib" "$CUDA_HOME/targets/x86_64-linux/lib" $LIBCUDA_DIR \
    /usr/local/nvidia/lib64 /usr/lib/x86_64-linux-gnu "$CUDA_HOME/lib64/stubs" \
    "$CUDA_HOME/targets/x86_64-linux/lib/stubs"; do
  [[ -d $dir ]] && LINK_DIRS=$LINK_DIRS:$dir
done

# DeepSpeed's async-I/O op: the unpacked libaio. has_function() reads CFLAGS/LDFLAGS; the JIT
# build's compiler and linker read CPATH/LIBRARY_PATH; the loader LD_LIBRARY_PATH.
AIO=$CARRY/libaio
export CFLAGS="-I$AIO/include" LDFLAGS="-L$AIO/lib" CPATH=$AIO/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$AIO/lib$LINK_DIRS${LIBRARY_PATH:+:$LIBRARY_PATH}
export LD_LIBRARY_PATH=$AIO/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# The image's own TORCH_CUDA_ARCH_LIST names architectures with a suffix (9.0a), which
# DeepSpeed 0.19.8's JIT build cannot parse (int('0a'): async_io failed to build on the first
# H200 run): the H200's plain 9.0, unless KIT_CUDA_ARCH says otherwise.
IMAGE_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${KIT_CUDA_ARCH:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/gpu-kit-torch-extensions}

# ---------------------------------------------------------------- preflight, first seconds
{
  echo "date: $(date -u +%FT%TZ)"
  echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
  echo "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>&1 | head -2)"
  echo "nvcc: ${NVCC:-none} $( [[ -n $NVCC ]] && "$NVCC" --version | tail -1)"
  echo "CUDA_HOME: $CUDA_HOME; TORCH_CUDA_ARCH_LIST: $TORCH_CUDA_ARCH_LIST (the image's: ${IMAGE_ARCH_LIST:-unset})"
  echo "libcuda (ldconfig): $(ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libcudart\.so' | tr -s ' \t' ' ' | tr '\n' ';')"
  echo "libcuda.so files: $(ls "$CUDA_HOME"/lib64/stubs/libcuda.so "$CUDA_HOME"/targets/x86_64-linux/lib/stubs/libcuda.so /usr/local/nvidia/lib64/libcuda.so* 2>/dev/null | tr '\n' ' ')"
  echo "libcudart.so files: $(ls "$CUDA_HOME"/lib64/libcudart.so* "$CUDA_HOME"/targets/x86_64-linux/lib/libcudart.so* 2>/dev/null | tr '\n' ' ')"
  echo "LIBRARY_PATH: $LIBRARY_PATH"
  echo "CC: $CC ($($CC --version 2>/dev/null | head -1)); CXX: $CXX"
  echo "ulimit -l: $(ulimit -l); nproc: $(nproc)"
  echo "meminfo: $(grep -E 'MemTotal|MemAvailable' /proc/meminfo | tr -s ' ' | tr '\n' ';')"
  echo "work: ${WORK:-none (no disk folder took O_DIRECT)}; $(df -hT "${WORK:-/tmp}" | tail -1)"
  for dir in /tmp /var/tmp "$PWD"; do echo "fs $dir: $(stat -f -c %T "$dir") o_direct $(o_direct "$dir" && echo yes || echo no)"; done
} | tee "$OUT/preflight.txt"
[[ -n $WORK ]] || echo "no work folder takes O_DIRECT: the NVMe rows will fail"
WORK=${WORK:-/tmp/gpu-kit-work}

# Our pinned pure-Python wheels on top of the image's site-packages (no venv needed: the
# image's python holds torch; --no-deps keeps its numpy, psutil, rich... as they are).
# KIT_INSTALL=0 uses the interpreter's own packages (the CPU dry run in the test suite).
SITE=/tmp/gpu-kit-site
if [[ ${KIT_INSTALL:-1} != 0 ]]; then
  stage install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$CARRY"/wheels/*.whl || exit 1
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

stage imports 60 "$PY" -c "import torch, transformers, deepspeed, pydantic, spillway_runtime.local; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.version.cuda, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'pydantic', pydantic.__version__)" \
  | tee -a "$OUT/preflight.txt" || { echo "the imports failed: nothing else can run"; exit 1; }

# Each op built alone, timed, its result in ops.json: a failed CPUAdam does not skip AsyncIO,
# and the kit skips (with the reason) what needs an op that did not build.
stage build_ops 240 "$PY" - "$OUT/ops.json" <<'EOF'
import json, os, sys, time, traceback
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder

results = {}
for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
    started = time.time()
    try:
        compatible = builder.is_compatible(verbose=True)
        builder.load(verbose=False)
        results[builder.NAME] = {"ok": True, "compatible": compatible, "seconds": round(time.time() - started, 1)}
    except BaseException as error:  # a failed build (SystemExit, RuntimeError, ...) is a result
        results[builder.NAME] = {"ok": False, "seconds": round(time.time() - started, 1),
                                 "error": "".join(traceback.format_exception(error))[-3000:]}
    print(builder.NAME, json.dumps(results[builder.NAME])[:3000], flush=True)
    tmp = sys.argv[1] + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(results, fh, indent=2)
    os.replace(tmp, sys.argv[1])
EOF

budget=$(( $(left) - 25 ))
stage kit $((budget + 15)) "$PY" benchmarks/gpu/kit.py --budget-seconds "$budget" --out "$OUT" --work "$WORK" \
  --ops "$OUT/ops.json" --host-memory-gib "${HOST_MEMORY_GIB:-120}" "$@"
echo "== done in $((SECONDS - START)) s"
