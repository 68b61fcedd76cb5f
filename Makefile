# Two entry points (README "Quick start"): `make demo` and `make test` (`make test-fast`: the
# pure-Python and single-process tests only, < 2 min; see tests/conftest.py).
# Both build the virtualenvs they need (cached outside the clone, keyed by requirements hash).
SHELL := /bin/bash
PYTEST_ARGS ?=

# `make example`: SmolLM2-135M-Instruct learns two-term arithmetic (async GRPO, ~40 min on 2 cores);
# EXAMPLE_ARGS: overrides of the training run, e.g. EXAMPLE_ARGS="trainer.num_steps=5".
EXAMPLE_ARGS ?=

.PHONY: demo example example-lora test test-real test-tools test-cp test-reshard test-families-serve test-slurm-nodes test-heavy test-resume-inflight test-fast test-mcore-latest test-failover-load envs learner-env learner-latest-env sglang-env

learner-env:
	@tools/env/make_venv.sh learner

learner-latest-env:
	@tools/env/make_venv.sh learner-latest

sglang-env:
	@tools/env/make_venv.sh sglang

envs: learner-env sglang-env

demo:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  $$L/bin/python -m areal_mega.cli demo --learner-python $$L/bin/python --sglang-python $$S/bin/python

example:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  $$L/bin/python -m areal_mega.demo.example --learner-python $$L/bin/python --sglang-python $$S/bin/python $(EXAMPLE_ARGS)

# The example with LoRA instead of full fine-tuning (configs/grpo_smollm2_lora.yaml; docs/lora.md).
example-lora:
	@$(MAKE) --no-print-directory example EXAMPLE_ARGS="--config configs/grpo_smollm2_lora.yaml --workdir runs/smollm2-lora $(EXAMPLE_ARGS)"

test:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE --durations=30 -m "not real_model and not tools_heavy and not cp_heavy and not reshard_sglang and not families_serve and not slurm_nodes and not heavy" $(PYTEST_ARGS)

# The checks on the real pretrained model (SmolLM2-135M: layouts vs HF, TP3 weight sync; ~5-10 min),
# kept out of `make test` to hold the CI run under its 40 minutes.
test-real:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -m real_model $(PYTEST_ARGS)

# The smoke runs of the tools/ scripts that need real SGLang servers and the trainer
# (bench_judge, bench_async through bench_simulator; minutes on 2 cores): kept out of make test.
test-tools:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -m tools_heavy $(PYTEST_ARGS)

# Context parallelism, every layout (CP2, CP2xTP2, CP2xPP2, CP2xEP2 MoE vs CP1; critic, recompute,
# routing replay; tests/dist/cp_layouts.py) and the CP2 trainer with a real SGLang server, checkpoint
# and resume (~10 min on 2 cores): make test runs the cheap subset.
test-cp:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -m cp_heavy \
	  tests/test_context_parallel.py tests/test_trainer_e2e.py $(PYTEST_ARGS)

# weight_sync.mode reshard into real TP2 SGLang CPU servers (one at a time; 3-5 min per server start
# under load): the TP2 x PP2 and EP2 MoE learners, log-probs / greedy vs HF, bytes per engine rank;
# a TP2 server spanning two nodes (test_weight_sync_two_nodes.py); DeepSeek-V3 MLA (_reshard_mla.py).
test-reshard:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -s -m reshard_sglang $(PYTEST_ARGS)

# The MoE families served (Mixtral, Qwen2-MoE, DeepSeek-V3, GLM-4.5): one real SGLang CPU server
# per family, synced from an EP2 learner, greedy = HF (tests/test_families_serve.py; 1-4 min each).
# gpt-oss: TP2/PP2/EP2 exactness, conversion, the sync stream through SGLang's own loader (tests/test_gpt_oss.py, ~2 min).
# DeepSeek-V3.2 / GLM-5 (tests/test_dsa.py, ~2 min): TP2 / PP2 / EP2 = HF and SGLang's own loader.
test-families-serve:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -s -m families_serve $(PYTEST_ARGS)

# A TP2 SGLang server spanning two virtual nodes of the local Slurm cluster (SGLang --nnodes), placed
# by the launcher's plan, synced (broadcast, reshard) from a megatron learner in the same job, greedy = HF;
# a killed node restarts the whole server
# (tests/test_slurm_two_node_server.py; three TP2 server starts, ~1 min each here, 3-5 under load).
test-slurm-nodes:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -s -m slurm_nodes $(PYTEST_ARGS)

# Slow checks whose mechanism make test covers more cheaply (pytest -m heavy; ~14 min): the failover of
# a lone server and the broadcast-mode failover, a real SGLang server tree dying with its SIGKILLed parent, the async PPO (critic) and
# PP2xVPP2 trainer runs (their engine-level exactness stays in make test), and the real trainer on the
# 4-node Slurm cluster (make test keeps that sbatch script's placement and rank-death paths).
test-heavy:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -m heavy $(PYTEST_ARGS)

# kill -9 of the real trainer + SGLang with long completions in flight (single- and three-turn): the
# checkpoint's saved tokens are trained, not generated again; and a real server SIGKILLed mid-request
# (client.segment_tokens) keeps its segments (docs/resume.md; marker heavy; ~5 min on 2 cores).
test-resume-inflight:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python -m pytest -q -rfE -s tests/test_trainer_resume.py tests/test_inference_segments_sglang.py -k "in_flight or sigkilled or snapshot" $(PYTEST_ARGS)

# No process starts in this tier (no SGLang either): --audit-processes fails it if one does.
test-fast:
	@L=$$(tools/env/make_venv.sh learner) && \
	  $$L/bin/python -m pytest -q -rfE -m "not slow" --audit-processes $(PYTEST_ARGS)

# The learner exactness tests on the newest megatron-core and transformers (tools/env/learner-latest.txt,
# its own venv; docs/environments.md#two-learner-tiers). No SGLang needed; 103 tests.
MCORE_LATEST_TESTS = tests/test_compat.py tests/test_megatron_model_plan.py tests/test_megatron_model.py \
  tests/test_megatron_moe.py tests/test_engine.py tests/test_engine_sp.py tests/test_critic.py \
  tests/test_minibatches.py tests/test_checkpoint.py
test-mcore-latest:
	@L=$$(tools/env/make_venv.sh learner-latest) && \
	  $$L/bin/python -m pytest -q -rfE --durations=30 $(MCORE_LATEST_TESTS) $(PYTEST_ARGS)

# The failover test beside a CPU-saturating job (tools/cpu_load.py: one busy process per core,
# stopped when the test ends, 30 min at most): a busy, live server must never leave the rotation.
test-failover-load:
	@L=$$(tools/env/make_venv.sh learner) && S=$$(tools/env/make_venv.sh sglang) && \
	  AREAL_MEGA_SGLANG_PYTHON=$$S/bin/python $$L/bin/python tools/cpu_load.py --seconds 1800 -- \
	  $$L/bin/python -m pytest -q -rfE tests/test_trainer_failover.py -k "test_server_killed_mid_run and 2" $(PYTEST_ARGS)
