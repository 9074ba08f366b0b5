#!/usr/bin/env bash
# The ring benchmark on one host's GPUs (issue: the sparse ring at the single-GPU rate), in one device call after
# scripts/gpu_fa4.sh's staging call (FA4's wheels travel in two parts):
#
#   call 1, carry .fa4carry/p1:  scripts/gpu_fa4.sh stage
#   call 2, carry .fa4carry/p2:  scripts/gpu_ring.sh          (results in $OUT)
#
# CP=4 at 128K tokens per GPU with the fa4 engine (128-token blocks) and the hierarchical 2 x 2 ring, then CP=2 on
# two of the GPUs; every run checks the ring against one device before it times anything. CP4=0 / CP2=0 skip a run;
# LIMIT (seconds, 400) bounds each run; the logs in $OUT keep every line (the terminal drops warnings).
# MODEL=DIR adds the ring on a real model's captured q/k/v (mtrain bench ring --model, MODEL_TOKENS per GPU, 64K).
# EMULATE="2 4 8" adds, on any one GPU, rank 0 of each CP size alone with its transfers as local fills (the rank's
# compute at that CP size against CP=1 in the same run: a bound on the real ring; EMU_EXTRA for its flags).
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
if [ "$NGPU" -ge 4 ] && [ "${CP4:-1}" = 1 ]; then
  timeout -k 15 "${LIMIT:-400}" torchrun --nproc_per_node 4 -m mtrain.bench.ring "${common[@]}" --node-size 2 ${RING_EXTRA:-} \
    --json "$OUT/ring_cp4.json" 2>&1 | tee "$OUT/ring_cp4.log" | grep -v Warning \
    || echo "CP=4 run: exit status $? (124: stopped at LIMIT)"
fi
if [ "${CP2:-1}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 "${LIMIT:-400}" torchrun --nproc_per_node 2 -m mtrain.bench.ring "${common[@]}" --skip-check ${CP2_EXTRA:-} \
    --json "$OUT/ring_cp2.json" 2>&1 | tee "$OUT/ring_cp2.log" | grep -v Warning \
    || echo "CP=2 run: exit status $? (124: stopped at LIMIT)"
fi
for n in ${EMULATE:-}; do  # one GPU: rank 0 of a CP=n group alone, transfers as local fills (--emulate-cp)
  timeout -k 15 "${LIMIT:-400}" python3 -m mtrain.bench.ring --emulate-cp "$n" "${common[@]}" ${EMU_EXTRA:-} \
    --json "$OUT/ring_emulated_cp$n.json" 2>&1 | tee "$OUT/ring_emulated_cp$n.log" | grep -v Warning \
    || echo "emulated CP=$n run: exit status $? (124: stopped at LIMIT)"
done
if [ -n "${MODEL:-}" ]; then  # the real model's captured q/k/v (an HF folder, e.g. gpu_e2e4.sh's /root/smollm2)
  torchrun --nproc_per_node "$(( NGPU < 4 ? NGPU : 4 ))" -m mtrain.bench.ring --model "$MODEL" \
    --tokens-per-gpu "${MODEL_TOKENS:-64K}" --block-size 128 --engine "${ENGINE:-auto}" --iters 2 --warmup 1 \
    ${MODEL_EXTRA:-} --json "$OUT/ring_model.json" 2>&1 | tee "$OUT/ring_model.log" | grep -v Warning
fi
