#!/usr/bin/env bash
# The ring benchmark on one host's GPUs (issue: the sparse ring at the single-GPU rate), in one device call after
# scripts/gpu_fa4.sh's staging call (FA4's wheels travel in two parts):
#
#   call 1, carry .fa4carry/p1:  scripts/gpu_fa4.sh stage
#   call 2, carry .fa4carry/p2:  scripts/gpu_ring.sh          (results in $OUT)
#
# CP=4 at 128K tokens per GPU with the fa4 engine (128-token blocks) and the hierarchical 2 x 2 ring, then CP=2 on
# two of the GPUs; every run checks the ring against one device before it times anything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/gpu_fa4.sh install
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
TOKENS="${TOKENS:-128K}"
ITERS="${ITERS:-3}"
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
NGPU=$(nvidia-smi -L | wc -l)
common=(--tokens-per-gpu "$TOKENS" --block-size 128 --engine "${ENGINE:-auto}" --iters "$ITERS" --warmup 1)
if [ "$NGPU" -ge 4 ]; then
  torchrun --nproc_per_node 4 scripts/bench_ring.py "${common[@]}" --node-size 2 ${RING_EXTRA:-} \
    --json "$OUT/ring_cp4.json" 2>&1 | grep -v Warning | tee "$OUT/ring_cp4.log"
fi
CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc_per_node 2 scripts/bench_ring.py "${common[@]}" --skip-check \
  --json "$OUT/ring_cp2.json" 2>&1 | grep -v Warning | tee "$OUT/ring_cp2.log"
