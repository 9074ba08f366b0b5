#!/usr/bin/env bash
# A context-parallel (CP = 2) run of the real trainer: two processes share every sequence.
# Synthetic long corpus -> `mtrain pack` at SEQ tokens -> `accelerate launch --num_processes 2 recipes/train.py`
# with parallel.cp_size=2 and a random Qwen2.5-shaped model; prints a summary of runs/.../metrics.jsonl.
#
#   scripts/gpu_train_cp2.sh                                  # 2 GPUs: Qwen2.5-0.5B shape, 128K tokens, mtraining
#   DS=configs/deepspeed/zero2.json scripts/gpu_train_cp2.sh  # the same under DeepSpeed ZeRO-2
#   CPU=1 SHAPE=tiny SEQ=4096 STEPS=3 scripts/gpu_train_cp2.sh   # smoke test: 2 gloo processes on a CPU
#
# Environment: SEQ (tokens per sequence, both ranks together), STEPS, SHAPE (a key of SHAPES in
# mtrain/bench/train.py), KIND (attention.kind), MAX_LINES (sparse budget: max_vertical = max_slash),
# DS (a DeepSpeed JSON, or empty), RUN_DIR (run folder), WORK (data + model config folder), PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

SEQ=${SEQ:-131072}
STEPS=${STEPS:-6}
SHAPE=${SHAPE:-qwen2.5-0.5b}
KIND=${KIND:-mtraining}
MAX_LINES=${MAX_LINES:-32}
DS=${DS:-}
CPU=${CPU:-0}
WORK=${WORK:-data/cache/cp2-$SHAPE-$SEQ}
RUN_DIR=${RUN_DIR:-runs/cp2-$SHAPE-$SEQ-$KIND}
PYTHON=${PYTHON:-python3}
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false

t0=$(date +%s)
mkdir -p "$WORK"
# 1. data: synthetic documents of ~10K-120K tokens (tiny tokenizer), packed into at least 3 samples of SEQ
if [ ! -f "$WORK/packed/manifest.json" ]; then
    docs=$(( SEQ * 4 / 60000 + 4 ))
    "$PYTHON" -m mtrain.data.synthetic --out "$WORK/corpus.jsonl" --docs "$docs" \
        --min-sentences 1000 --max-sentences 12000 --seed 0
    rm -rf "$WORK/packed"
    "$PYTHON" -m mtrain pack --source "$WORK/corpus.jsonl:jsonl" --tokenizer mtrain/assets/tiny-tokenizer \
        --seq-len "$SEQ" --out "$WORK/packed" --no-progress
fi

# 2. a random model of the chosen shape (config.json only: the trainer initialises the weights)
DTYPE=bfloat16
[ "$CPU" = 1 ] && DTYPE=float32
"$PYTHON" - "$SHAPE" "$SEQ" "$WORK/model" <<'EOF'
import sys
from transformers import Qwen2Config
from mtrain.bench import train as bench
shape, seq, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
Qwen2Config(**bench.SHAPES[shape], max_position_embeddings=max(seq, 32768), rope_theta=1e6).save_pretrained(out)
EOF

# 3. the recipe
cat > "$WORK/recipe.yaml" <<EOF
# written by scripts/gpu_train_cp2.sh
model:
  config: $WORK/model/config.json
  tokenizer: mtrain/assets/tiny-tokenizer
  dtype: $DTYPE
  gradient_checkpointing: true
data:
  path: $WORK/packed
  seq_len: $SEQ
  document_masking: true
attention:
  kind: $KIND
  max_vertical: $MAX_LINES
  max_slash: $MAX_LINES
parallel:
  cp_size: 2
  layout: block-stripe
optim:
  lr: 1.0e-4
  warmup_steps: 1
logging:
  wandb: disabled
train:
  output_dir: $RUN_DIR
  max_steps: $STEPS
  save_every: $STEPS
  export: false
  loss_chunk: 8192
  deepspeed: ${DS:-null}
EOF
rm -rf "$RUN_DIR"   # a benchmark starts fresh (the trainer would otherwise resume)
prep=$(( $(date +%s) - t0 ))

# 4. train: 2 processes, one CP group
# --multi_gpu selects accelerate's torchrun launcher, which also starts 2 processes on a CPU (with MULTI_CPU
# configs accelerate starts one); the trainer picks gloo there itself.
launch=(--multi_gpu --num_machines 1 --num_processes 2 --mixed_precision no --dynamo_backend no)
[ "$CPU" = 1 ] && [ -n "$DS" ] && export DS_ACCELERATOR=cpu
[ -n "$DS" ] && launch=(--use_deepspeed --deepspeed_config_file "$DS" --num_machines 1 --num_processes 2)
t1=$(date +%s)
"$PYTHON" -m accelerate.commands.launch "${launch[@]}" recipes/train.py "$WORK/recipe.yaml"
train_s=$(( $(date +%s) - t1 ))

# 5. summary
"$PYTHON" - "$RUN_DIR/metrics.jsonl" "$prep" "$train_s" "$SHAPE" "$SEQ" "$KIND" "${DS:-none}" <<'EOF'
import json, statistics, sys
path, prep, train_s, shape, seq, kind, ds = sys.argv[1:]
rows = [json.loads(line) for line in open(path)]
cols = ["step", "loss", "grad_norm", "tokens_per_s", "tflops", "peak_mem_gb", "attention_density",
        "imbalance_worker", "imbalance_step"]
print(f"\nCP=2 run: {shape} shape, {seq} tokens per sequence ({int(seq) // 2} per rank), attention {kind}, "
      f"DeepSpeed {ds}; data + config {prep} s, launch + training {train_s} s")
print(" ".join(f"{c:>16}" for c in cols))
for r in rows:
    print(" ".join(f"{r[c]:>16.4g}" if isinstance(r.get(c), float) else f"{str(r.get(c, '-')):>16}" for c in cols))
steady = rows[1:] or rows  # the first step compiles and autotunes kernels
tps = statistics.median(r["tokens_per_s"] for r in steady)
print(f"median over steps {steady[0]['step']}..{steady[-1]['step']}: {tps:.0f} tokens/s for both ranks "
      f"({tps / 2:.0f} per rank), {statistics.median(r['tflops'] for r in steady):.1f} model TFLOP/s per rank; "
      f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}")
EOF
