#!/usr/bin/env bash
# Training on packed long documents on one GPU that reaches no registry (issue #48, item 6): SmolLM2-135M continued
# with MTraining (recipes/smollm2-docs-mtraining.yaml: per-document sparse attention, FA4's block-sparse kernels)
# and with dense attention (smollm2-docs-dense.yaml: one FA4 varlen call per layer) on the same sequences of real
# documents (mtrain.data.docmix: the long mix, 41/31/19/9% of each sequence; or the short mix, 16 equal pieces),
# then `mtrain compare` per length. Needs FlashAttention-4 (scripts/gpu_fa4.sh), SmolLM2's GGUF
# (scripts/gpu_real_model.sh) and mosaicml-streaming's wheels (to write the packed folders), each over or near the
# 64 MiB a device call carries. Here, once (needs the package index):
#
#   scripts/gpu_fa4.sh split && scripts/gpu_real_model.sh split && scripts/gpu_train_docs.sh prepare
#
# then on the GPU machine, each call within ~30 s of the last (the machine keeps its disk only while warm):
#
#   call 1, carry [.fa4carry/p1, .whl-docs]:  scripts/gpu_train_docs.sh stage1   (FA4 part 1, the wheels)
#   call 2, carry [.fa4carry/p2]:             scripts/gpu_train_docs.sh stage2   (FA4 installed)
#   call 3, carry [.carry/p1]:                scripts/gpu_train_docs.sh stage3   (GGUF part 1)
#   call 4, carry [.carry/p2]:                LENGTHS="65536 131072" scripts/gpu_train_docs.sh run
#   call 5:                                   LENGTHS=262144 scripts/gpu_train_docs.sh run
#   call 6:                                   MIX=short LENGTHS=131072 scripts/gpu_train_docs.sh run
#
# `run` converts the GGUF (once), packs STEPS sequences per length (skipped when packed), trains dense then
# mtraining at each length (a finished run is skipped; a run stopped by its time box checkpoints and the next call
# resumes it), and writes into OUT compare-MIX-LEN.txt (`mtrain compare`: tokens/s median after warm-up, peak
# memory, loss), each run's metrics.jsonl, and rows.jsonl (the figures as result rows, `tools/train_rows.py`; COMMIT
# names the commit). Each launch is wrapped in `timeout -s TERM` of the seconds left before DEADLINE (seconds since
# the call began), shared among the runs still to go.
#
# Environment (defaults): LENGTHS ("65536 131072"), MIX (long), STEPS (22: 2 warm-up + 20 measured), KINDS ("dense
# mtraining"), DEADLINE (540), MODEL_DIR (/root/smollm2), PACKAGES (torch,transformers: installed packages whose
# source adds code repositories to the texts), TRAIN_ARGS (extra `mtrain train` arguments), OUT (results).
# A CPU smoke run: MODEL_DIR=models/smollm2-135m LENGTHS=1024 STEPS=3 PACKAGES= TRAIN_ARGS="--set
# model.dtype=float32 --set attention.engine=auto --set attention.block_size=64" scripts/gpu_train_docs.sh run
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR=${MODEL_DIR:-/root/smollm2}
LENGTHS=${LENGTHS:-65536 131072}
MIX=${MIX:-long}
STEPS=${STEPS:-22}
DEADLINE=${DEADLINE:-540}
PACKAGES=${PACKAGES-torch,transformers}
RESULTS=${OUT:-runs/docs-results}
PY=${PYTHON:-python}
export PYTHONPATH="/root/pylib:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
WHEELS=(mosaicml-streaming==0.13.0 zstd python-snappy==0.7.3 cramjam==2.14.0 brotli==1.2.1 catalogue==2.0.10
        xxhash==4.1.0)
mark() { echo "=== $(date +%T) +${SECONDS}s $*"; }

case "${1:-}" in
  prepare)  # here: mosaicml-streaming and the codecs it imports, as CPython 3.12 wheels (the GPU machine's Python)
    mkdir -p .whl-docs
    for wheel in "${WHEELS[@]}"; do
      ${PIP:-.venv/bin/python -m pip} download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl-docs "$wheel"
    done
    ls -la .whl-docs ;;
  stage1)
    scripts/gpu_fa4.sh stage
    $PY -m pip install -q --no-index --no-deps --no-compile --target /root/pylib .whl-docs/*.whl
    mark "staged FA4 part 1 and the wheels" ;;
  stage2)
    scripts/gpu_fa4.sh install
    mark "installed FA4" ;;
  stage3)  # the GGUF's part 1 kept where `convert` looks for it (no gate, cost fit or profile here)
    CHECK=0 EST=0 PROFILE=0 OUT="$RESULTS" scripts/gpu_real_model.sh stage
    mark "staged the GGUF's part 1" ;;
  run)
    mkdir -p "$RESULTS"
    [ -f "$MODEL_DIR/config.json" ] || MODEL_DIR=$MODEL_DIR scripts/gpu_real_model.sh convert
    mark "model in $MODEL_DIR"
    $PY -c "import wandb" 2>/dev/null || TRAIN_ARGS="--set logging.wandb=disabled ${TRAIN_ARGS:-}"
    runs=()
    for seq in $LENGTHS; do
      k=$((seq / 1024))k
      data=data/packed/docs-$MIX-$k
      $PY -m mtrain.data.docmix --tokenizer "$MODEL_DIR" --seq-len "$seq" --samples "$STEPS" --mix "$MIX" \
        --packages "$PACKAGES" --out "$data"
      cp "$data/mix.json" "$RESULTS/mix-$MIX-$k.json"
      for kind in ${KINDS:-dense mtraining}; do runs+=("$seq:$kind"); done
    done
    mark packed
    left=${#runs[@]}
    for item in "${runs[@]}"; do
      seq=${item%%:*} kind=${item#*:} k=$((${item%%:*} / 1024))k
      out=runs/smollm2-docs-$MIX-$k-$kind
      box=$(( (DEADLINE - SECONDS) / left )); left=$((left - 1))
      if [ -d "$out/final" ]; then mark "$out done"; continue; fi
      if [ "$box" -lt 30 ]; then mark "no time left for $out"; continue; fi
      # shellcheck disable=SC2086
      timeout -s TERM -k 30 "$box" $PY -m mtrain train "recipes/smollm2-docs-$kind.yaml" --set model.path="$MODEL_DIR" \
        --set data.path="data/packed/docs-$MIX-$k" --set data.seq_len="$seq" \
        --set model.rope_scaling.factor="$(awk "BEGIN { f = $seq / 8192; print (f < 1 ? 1 : f) }")" \
        --set train.output_dir="$out" \
        --set train.max_steps="$STEPS" ${TRAIN_ARGS:-} > "$RESULTS/train-$MIX-$k-$kind.log" 2>&1 \
        || echo "$out: exit $? (time box ${box}s; 124 = stopped by it: the next call resumes the run)"
      tail -n 3 "$RESULTS/train-$MIX-$k-$kind.log"
      [ ! -f "$out/metrics.jsonl" ] || cp "$out/metrics.jsonl" "$RESULTS/metrics-$MIX-$k-$kind.jsonl"
      mark "trained $out"
    done
    for seq in $LENGTHS; do
      k=$((seq / 1024))k
      a=runs/smollm2-docs-$MIX-$k-mtraining b=runs/smollm2-docs-$MIX-$k-dense
      if [ -f "$a/metrics.jsonl" ] && [ -f "$b/metrics.jsonl" ]; then
        $PY -m mtrain compare "$a" "$b" --plot "$RESULTS/loss-$MIX-$k.png" --throughput-plot "$RESULTS/speed-$MIX-$k.png" \
          | tee "$RESULTS/compare-$MIX-$k.txt"
        # the figures as result rows (benchmarks/results.jsonl's format): copy them there with the run's date
        $PY -m tools.train_rows --measure train_docs.smollm2 --label "$k.$MIX" --mtraining "$a/metrics.jsonl" \
          --dense "$b/metrics.jsonl" --gpu "${GPU_LABEL:-1x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)}" \
          --versions "$($PY -c 'import torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}")')" \
          --commit "${COMMIT:-}" --command "MIX=$MIX LENGTHS=$seq scripts/gpu_train_docs.sh run" \
          --note "SmolLM2-135M, $STEPS steps of $k tokens ($MIX mix), mtraining vs the dense kind" --out "$RESULTS/rows.jsonl"
      fi
    done ;;
  *)
    echo "usage: $0 prepare | stage1 | stage2 | stage3 | run   (see the header)" >&2; exit 2 ;;
esac
