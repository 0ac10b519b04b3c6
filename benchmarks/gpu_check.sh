#!/usr/bin/env bash
# The GPU check: what a person with a GPU runs (under 8 minutes on one H200) to see that peat_jax
# holds there. It runs `peat check` of every bundled kernel (ffi_matmul builds its CUDA version
# with nvcc: $NVCC, PATH or /usr/local/cuda/bin; ffi_matmul_tile_bug must exit 1) and of jax's own
# Pallas GPU attention, a playback of jax's Pallas GPU layer norm in the language workload, the
# core, analyzer, profiler and (GPU) scale benchmarks (each prints its one JSON line), a golden run
# on the GPU compared with the same run on its CPU (`peat compare`, with a replay of the divergence
# on the GPU), runtime injection there, and `peat demo` on the vision and the language workload.
# The most telling steps come first, so that a run cut short still says the most.
# Ends with one JSON line: each step's exit status and seconds, the jax version and the device.
#
#   bash benchmarks/gpu_check.sh            # PYTHON=... to choose the interpreter
#   PEAT_GPU_OUT=DIR keeps the run directories and logs in DIR (default: a temporary folder)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${PEAT_GPU_OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
STEPS=()

step() {  # step NAME LIMIT_S CMD...: run, print its output, record rc and seconds
  local name=$1 limit=$2; shift 2
  local t0 rc
  echo "=== $name"
  t0=$EPOCHREALTIME
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  STEPS+=("$(awk -v n="$name" -v rc="$rc" -v a="$t0" -v b="$EPOCHREALTIME" \
    'BEGIN { printf "\"%s\": {\"rc\": %d, \"s\": %.1f}", n, rc, b - a }')")
}

"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee "$OUT/devices.log"
for k in pallas_matmul blocked_matmul xla_matmul ffi_matmul pallas_softmax pallas_layer_norm pallas_attention; do
  step "check_$k" 60 "$PY" -m peat_jax check "$k"
done
# the CUDA build of the FFI matmul with its seeded tile bug: expected rc 1 (fails: tile_boundary)
step check_ffi_matmul_tile_bug 60 "$PY" -m peat_jax check ffi_matmul_tile_bug
# kernels nobody here wrote, compiled: jax's own Pallas GPU attention against XLA's (check_kernel),
# and jax's Pallas GPU layer norm at every nn.LayerNorm of the language workload (playback)
QKV=2x256x4x64,2x256x4x64,2x256x4x64
step check_jax_pallas_mha 120 "$PY" -m peat_jax check benchmarks/gpu_kernels.py:causal_mha \
  --reference benchmarks/gpu_kernels.py:causal_attention --shapes "$QKV" --json
step golden_language 90 "$PY" -m peat_jax profile language --steps 6 --checkpoint-every 3 \
  --out "$OUT/golden-language"
step playback_jax_pallas_layer_norm 120 "$PY" -m peat_jax playback "$OUT/golden-language" \
  --kernel benchmarks/gpu_kernels.py:layer_norm --sites flax.linen.LayerNorm --json
for b in bench_core bench_analyze; do
  step "$b" 240 "$PY" "benchmarks/$b.py"
done
# issue 15: a golden run on this GPU against the same run on its CPU (site statistics every
# step): the first site, step and phase that differ beyond noise, and replayed on the GPU
step golden_gpu 120 "$PY" -m peat_jax profile vision --steps 10 --checkpoint-every 5 \
  --stats-every 1 --out "$OUT/golden-gpu"
step golden_cpu 180 env JAX_PLATFORMS=cpu "$PY" -m peat_jax profile vision --steps 10 \
  --checkpoint-every 5 --stats-every 1 --out "$OUT/golden-cpu"
step compare_cpu_gpu 120 "$PY" -m peat_jax compare "$OUT/golden-cpu" "$OUT/golden-gpu" --json
step compare_gpu_cpu_replay 120 "$PY" -m peat_jax compare "$OUT/golden-gpu" "$OUT/golden-cpu" \
  --replay --json
# runtime injection on the GPU through its default switch (the host's choice between the plain
# step's executable and the injected one)
step runtime_gpu 120 "$PY" -m peat_jax runtime "$OUT/golden-gpu" --fault "wrong_scale(2.0)" --every 4 \
  --offset 2 --json
step demo_vision 120 "$PY" -m peat_jax demo --out "$OUT/demo-vision"
step bench_profiler 240 "$PY" benchmarks/bench_profiler.py
# playback cells per second on the language workload at size="large" with the Pallas matmul
step bench_scale_gpu 240 "$PY" benchmarks/bench_scale.py --gpu
step demo_language 150 "$PY" -m peat_jax demo --workload language --steps 20 --out "$OUT/demo-language"

DEVICE=$("$PY" -c "import jax; d = jax.devices()[0]; print(d.platform + ': ' + d.device_kind)" 2>/dev/null)
JAXV=$("$PY" -c "import jax; print(jax.__version__)" 2>/dev/null)
(IFS=,; echo "{\"gpu_check\": {${STEPS[*]}}, \"jax\": \"$JAXV\", \"device\": \"$DEVICE\", \"out\": \"$OUT\"}")
