#!/usr/bin/env bash
# The fidelity study (issue #14) on a GPU machine that reaches no registry: continue pretraining SmolLM2-135M
# from 8K to 32K twice on the same packed tokens (recipes/smollm2-32k-mtraining.yaml and its dense twin), then
# evaluate the base model (YaRN x4 written into its config) and both results with eval/smollm2-32k.yaml, and
# compare. The GGUF travels in two parts as for the real-attention benchmark (scripts/gpu_real_model.sh):
#
#   scripts/gpu_real_model.sh split          # here, once: .carry/p1, .carry/p2
#   scripts/gpu_train_real.sh stage          # call 1, carry .carry/p1 .whl-study: part 1, the wheels, the texts
#   scripts/gpu_train_real.sh run            # call 2 (and more), carry .carry/p2: everything else
#
# The machine has no mosaicml-streaming (`mtrain pack`), wonderwords (the synthetic needles, RULER) nor wandb:
# bring the first two as CPython 3.12 wheels in WHEELS (.whl-study: mosaicml-streaming 0.13.0, zstd, python-snappy,
# cramjam, Brotli, catalogue, wonderwords; `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`),
# installed once into /root/pylib; without wandb the runs log to metrics.jsonl alone (logging.wandb=disabled).
#
# Every stage skips what is done (the checkpoint, the packed data, a finished run's final/, eval predictions
# cached per sample) and a killed training resumes from its last checkpoint: when a call runs out of time,
# call `run` again while the machine is still warm (about 30 s after a call; after that it starts bare).
# Results (metrics, eval results, the compare table and loss plot) are copied to OUT as they appear. Wrap each
# call in `timeout -s TERM N` (N well inside the call's limit): training checkpoints on SIGTERM and stops.
#
# Measured on one H200 (2026-11-24, docs/benchmarks-history.md "Continued pretraining, dense vs MTraining"):
# convert + pack 80 s; 200 steps at 32K take 5.2 min per run (mtraining and dense alike, ~1.3 s/step); eval at
# EVAL_ARGS="--samples 3" 4.5 min per model
# (198 generations, RULER decodes its full max_new_tokens), run for the three models side by side. The whole
# study was about 20 minutes of machine time then: calls of up to ~9 min after `stage`, each within the warm window
# of the last. The suite asks 20 NIAH prompts (10 until 2026-11-28) and 5 RULER samples per task and length, and EVALS runs
# up to five evaluations side by side. Measured on one H100 (2026-11-28, 10 NIAH prompts, STEPS=120): convert 58 s, pack
# 20 s, training 220 s (mtraining) and 210 s (dense), the evaluations ~5-7 min each with others beside them; plan on
# four calls after `stage`. On one H200 (2026-11-28, 20 NIAH prompts, STEPS=120, EVALS of four): convert 49 s, pack
# 17 s, training ~175 s (mtraining) and ~200 s (dense), the four evaluations side by side ~7 min: two calls after
# `stage`.
#
# Environment: MODEL_DIR (/root/smollm2), WHEELS (.whl-study), STEPS (200 training steps per run), SEQ (32768),
# EVALS (mtraining dense base mtraining-sparse dense-sparse: the evaluations, side by side; NAME-sparse is model NAME
# evaluated with MTraining's attention on every layer, with the mtraining run's settings (`mtrain eval
# --attention-from`; SPARSE_EVAL_ARGS adds `--sparse KEY=VALUE` items to those); the study's table, study.md, pairs
# each with dense's), KINDS (mtraining dense: the runs trained),
# OUT (results), STAGES (default "data train eval compare": any subset, in that order), TRAIN_ARGS / EVAL_ARGS (extra `mtrain
# train` / `mtrain eval` arguments, e.g. EVAL_ARGS="--lengths 4096,8192" for a shorter pass). A CPU smoke run of
# the whole chain: MODEL_DIR=models/smollm2-135m SEQ=2048 STEPS=2 TRAIN_ARGS="--set model.dtype=float32
# --set model.gradient_checkpointing=false" EVAL_ARGS="--lengths 2048 --samples 1 --tasks niah"
# scripts/gpu_train_real.sh run
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR=${MODEL_DIR:-/root/smollm2}
STEPS=${STEPS:-200}
SEQ=${SEQ:-32768}
RESULTS=${OUT:-runs/fidelity}
STAGES=${STAGES:-data train eval compare}
EVALS=${EVALS:-mtraining dense base mtraining-sparse dense-sparse}
PACKED=data/packed/smollm2-$SEQ
export PYTHONPATH="/root/pylib:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
MTRAIN="python -m mtrain"
has() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
keep() { mkdir -p "$RESULTS/$2" && cp "$1" "$RESULTS/$2/" 2>/dev/null || true; }  # a copy back under OUT
mark() { echo "=== $(date +%T) +${SECONDS}s $*"; }  # stage timings in the log
wheels() {  # the carried wheels, once per machine (they stay in /root/pylib while it is warm)
  local dir=${WHEELS:-.whl-study}
  if [ -d "$dir" ] && [ ! -f /root/pylib/.study-wheels ]; then
    python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/pylib "$dir"/*.whl
    touch /root/pylib/.study-wheels
  fi
}
texts() {  # the model-free data: synthetic long documents in the eval's needle formats (answered), and this
  # Python's prose: the stdlib docstrings for training, the reference documentation held out for perplexity
  [ -f data/synthetic/smollm2-long.jsonl ] || python -m mtrain.data.synthetic --out data/synthetic/smollm2-long.jsonl \
    --docs 600 --min-sentences 200 --max-sentences 2500 --facts 4 --retrieval 0.7 \
    --formats niah=0.5,ruler=0.3,passkey=0.2,repeat=0 --seed 3
  [ -f data/prose/train.jsonl ] || python -m mtrain.data.prose --train data/prose/train.jsonl \
    --heldout data/eval/prose-heldout
}

case "${1:-}" in
  stage)  # part 1 of the GGUF, the wheels and the texts; no GPU work
    mkdir -p /root/parts && cp .carry/p1/part.aa /root/parts/
    wheels
    texts
    mark staged ;;
  run)
    mkdir -p "$RESULTS"
    wheels
    MODEL_DIR=$MODEL_DIR scripts/gpu_real_model.sh convert
    mark converted
    # wandb is optional: without it the runs log to metrics.jsonl, which `mtrain compare` reads
    python -c "import wandb" 2>/dev/null || TRAIN_ARGS="--set logging.wandb=disabled ${TRAIN_ARGS:-}"
    if has data; then
      texts
      [ -f "$PACKED/index.json" ] || $MTRAIN pack data/smollm2-32k.yaml --tokenizer "$MODEL_DIR" --seq-len "$SEQ" \
        --total-tokens $((STEPS * SEQ)) --out "$PACKED" --no-progress
      mark packed
    fi
    if has train; then
      for kind in ${KINDS:-mtraining dense}; do  # the same data order, seed, steps and tokens
        run=runs/smollm2-32k-$kind
        [ -d "$run/final" ] || $MTRAIN train recipes/smollm2-32k-$kind.yaml --set model.path="$MODEL_DIR" \
          --set data.path="$PACKED" --set data.seq_len="$SEQ" --set train.max_steps="$STEPS" ${TRAIN_ARGS:-}
        keep "$run/metrics.jsonl" "$kind"
        mark "trained $kind"
      done
    fi
    if has eval; then
      base=/root/smollm2-yarn4  # the base model at 32K: YaRN x4 in its config, as the trained ones export it
      if [ ! -f "$base/config.json" ]; then
        cp -r "$MODEL_DIR" "$base"
        python - "$base/config.json" <<'PY'
import json, sys
path = sys.argv[1]
cfg = json.load(open(path))
theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": cfg["max_position_embeddings"]}
cfg["rope_parameters"] = {**yarn, "rope_theta": theta}  # transformers 5
cfg["rope_scaling"] = {**yarn, "type": "yarn"}  # older readers
cfg["max_position_embeddings"] *= 4
json.dump(cfg, open(path, "w"), indent=1)
PY
      fi
      # the three evaluations side by side on the one GPU (a 135M model's decoding leaves it mostly idle); each
      # logs to $RESULTS/eval-NAME.log and keeps its predictions, so a call cut short resumes where it stopped
      pids=()
      for name in $EVALS; do
        model=${name%-sparse}
        case $model in base) path=$base ;; *) path=runs/smollm2-32k-$model/final ;; esac
        # NAME-sparse: the model evaluated with MTraining's attention as the mtraining run trained with it (its
        # config.yaml: block size, recall, the quality check and recall escalation), every layer sparse
        attn=()
        [ "$name" = "$model" ] || attn=(--attention-from runs/smollm2-32k-mtraining --sparse sparse_policy=always ${SPARSE_EVAL_ARGS:-})
        out=runs/smollm2-32k-eval/$name
        ( $MTRAIN eval eval/smollm2-32k.yaml --model "$path" --out "$out" --no-progress "${attn[@]}" ${EVAL_ARGS:-} \
            > "$RESULTS/eval-$name.log" 2>&1 && keep "$out/results.json" "eval-$name" && mark "evaluated $name" ) &
        pids+=($!)
      done
      failed=0
      for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
      tail -n 5 "$RESULTS"/eval-*.log
      [ "$failed" = 0 ] || { echo "an evaluation failed: see $RESULTS/eval-*.log" >&2; exit 1; }
    fi
    if has compare; then
      $MTRAIN compare runs/smollm2-32k-mtraining runs/smollm2-32k-dense --plot "$RESULTS/loss.png" \
        | tee "$RESULTS/compare.txt"
      # the study's table: every evaluation with standard errors and counts, paired differences from dense's
      evals=()
      for name in $EVALS; do [ ! -d "runs/smollm2-32k-eval/$name/predictions" ] || evals+=(--eval "$name=runs/smollm2-32k-eval/$name"); done
      [ ${#evals[@]} = 0 ] || python -m mtrain.eval.study "${evals[@]}" --reference dense \
        --run dense=runs/smollm2-32k-dense --run mtraining=runs/smollm2-32k-mtraining --out "$RESULTS/study.md"
    fi ;;
  *)
    echo "usage: $0 stage | run   (see the header)" >&2; exit 2 ;;
esac
