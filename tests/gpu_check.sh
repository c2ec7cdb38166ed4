#!/usr/bin/env bash
# The checks a session runs when it is lent a GPU (the `device` tool; see README, GPU numbers): versions,
# the suite on CUDA, the training step with its profile, the kernel benchmark. Each step has its own
# time limit (seconds, from the environment) so that one slow step leaves the others their output.
#   bash tests/gpu_check.sh                      # writes env.txt, pytest.txt, bench_step.txt, bench_kernel.txt to $OUT
#   SUITE_S=0 KERNEL_ARGS="--doc_len=512" bash tests/gpu_check.sh   # a step with limit 0 is skipped
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 POPE_FAILLOG="$OUT/failures.txt"
PY=${PY:-python3}
step() {  # step NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S seconds, output to $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  [ "$limit" -gt 0 ] || return 0
  echo "== $name (limit ${limit} s): $*" | tee "$OUT/$name.txt"
  local t0=$SECONDS
  timeout "$limit" "$@" >>"$OUT/$name.txt" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$OUT/$name.txt"
  tail -n "${TAIL:-25}" "$OUT/$name.txt"
}
{
  nvidia-smi -L 2>&1
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA')"
  echo "commit ${COMMIT:-unknown}, $(nproc) CPU cores"
} 2>&1 | tee "$OUT/env.txt"
step pytest "${SUITE_S:-120}" $PY -m pytest -q -rfE -n "${WORKERS:-14}" -p no:cacheprovider ${PYTEST_ARGS:-tests}
step bench_step "${STEP_S:-100}" $PY bench.py --only=step --profile ${STEP_ARGS:-}
step bench_kernel "${KERNEL_S:-90}" $PY bench_kernel.py ${KERNEL_ARGS:-}
step bench_decode "${DECODE_S:-0}" $PY bench.py --only=decode ${DECODE_ARGS:-}
# a short train.py run per encoding (TRAIN_ARGS, e.g. --attn_mask_type=block_causal --max_iters=40), compiled as on
# any GPU, with its end-of-run sample (the compiled decoding step)
step train_pope "${TRAIN_S:-0}" $PY train.py ${TRAIN_ARGS:-} --pos_encoding=pope --out_dir=/tmp/out-gpu-pope
step train_rope "${TRAIN_S:-0}" $PY train.py ${TRAIN_ARGS:-} --pos_encoding=rope --out_dir=/tmp/out-gpu-rope
