# The two commands of the README. Each builds what it needs on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvckpt-installed

.PHONY: demo test test-slow bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kvckpt demo $(ARGS)

# CI's slice: tests marked slow (soak-size, the other samplers' functional runs) are excluded;
# run them with `make test-slow`.
# .venv-vllm is built (mostly downloads) while the main suite runs; its output follows the suite's.
test: $(STAMP)
	$(BIN)/ruff check kvckpt integrations tools tests benchmarks
	bash scripts/setup_fuse.sh
	bash scripts/setup_vllm_env.sh > $(VENV)/vllm-setup.out 2>&1 & setup=$$!; \
	$(BIN)/python -m pytest -q -m "not vllm and not slow" $(PYTEST_ARGS); suite=$$?; \
	wait $$setup; built=$$?; cat $(VENV)/vllm-setup.out; test $$suite = 0 && test $$built = 0
	.venv-vllm/bin/python -m pytest -q -m "vllm and not slow" tests/test_worker.py tests/test_trainer.py $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow and not vllm" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .ruff_cache .hypothesis
