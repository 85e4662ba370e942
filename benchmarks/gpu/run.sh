#!/usr/bin/env bash
# Runs the GPU validation kit on a lent GPU machine, from the repository root, with $OUT set
# and benchmarks/gpu/carry/ carried (built here by prepare.sh). No network there: everything
# installs from the carried wheels, beside the image's torch, transformers and peft. Each
# stage has a hard timeout and the whole call ends within RUN_SECONDS (default 9 minutes);
# results land in $OUT as they come (gpu_kit.json, gpu_kit.md, run.log).
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

[[ -d $CARRY/wheels ]] || { echo "no $CARRY: run benchmarks/gpu/prepare.sh here first and carry it"; exit 2; }

# Our pinned pure-Python wheels on top of the image's site-packages (no venv needed: the
# image's python holds torch; --no-deps keeps its numpy, psutil, rich... as they are).
SITE=/tmp/gpu-kit-site
stage install 90 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" "$CARRY"/wheels/*.whl || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

# DeepSpeed's async-I/O op: the unpacked libaio. has_function() reads CFLAGS/LDFLAGS; the JIT
# build's compiler and linker read CPATH/LIBRARY_PATH; the loader LD_LIBRARY_PATH.
AIO=$CARRY/libaio
export CFLAGS="-I$AIO/include" LDFLAGS="-L$AIO/lib" CPATH=$AIO/include${CPATH:+:$CPATH}
export LIBRARY_PATH=$AIO/lib${LIBRARY_PATH:+:$LIBRARY_PATH} LD_LIBRARY_PATH=$AIO/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/gpu-kit-torch-extensions}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch, transformers, deepspeed, pydantic, spillway_runtime; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__, 'pydantic', pydantic.__version__)"

# Built once here, timed; the kit's processes load them from TORCH_EXTENSIONS_DIR.
stage build_ops 200 "$PY" -c "
import time
from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
for builder in (CPUAdamBuilder(), AsyncIOBuilder()):
    t = time.time()
    ok = builder.is_compatible(verbose=True)
    builder.load(verbose=False)
    print(f'{builder.NAME}: compatible {ok}, built and loaded in {time.time() - t:.1f} s', flush=True)
"

budget=$(( $(left) - 25 ))
stage kit $((budget + 15)) "$PY" benchmarks/gpu/kit.py --budget-seconds "$budget" --out "$OUT" --work /tmp/gpu-kit-work "$@"
echo "== done in $((SECONDS - START)) s"
