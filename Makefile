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

# Peers whose pins fight the main .venv each get a venv of their own, .venv-NAME, built by
# scripts/setup_peer_env.sh from scripts/peer_envs/NAME.txt; that file's header names the peer's
# pytest marker and test files, so a new peer needs no edit here.
PEERS        := $(basename $(notdir $(wildcard scripts/peer_envs/*.txt)))
peer_field    = $(shell sed -n 's/^# $(2): *//p' scripts/peer_envs/$(1).txt | head -n 1)
NOT_PEERS    := $(foreach p,$(PEERS),and not $(call peer_field,$(p),marker))

# CI's slice: tests marked slow (soak-size, the other samplers' functional runs) are excluded;
# run them with `make test-slow`.
# The peer venvs are built (mostly downloads), one after another, while the main suite runs; their
# output follows the suite's, then each peer's tests run in its venv.
test: $(STAMP)
	$(BIN)/ruff check kvckpt integrations reference tools tests benchmarks
	bash scripts/setup_fuse.sh
	bash scripts/setup_reflink.sh
	( built=0; for p in $(PEERS); do bash scripts/setup_peer_env.sh $$p > $(VENV)/peer-$$p-setup.out 2>&1 || built=1; \
	  done; exit $$built ) & setup=$$!; \
	$(BIN)/python -m pytest -q -m "not slow $(NOT_PEERS)" $(PYTEST_ARGS); suite=$$?; \
	wait $$setup; built=$$?; for p in $(PEERS); do cat $(VENV)/peer-$$p-setup.out; done; \
	test $$suite = 0 && test $$built = 0
	rc=0; $(foreach p,$(PEERS),.venv-$(p)/bin/python -m pytest -q -m "$(call peer_field,$(p),marker) and not slow" \
	  $(call peer_field,$(p),tests) $(PYTEST_ARGS) || rc=1;) exit $$rc

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m "slow $(NOT_PEERS)" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

clean:
	rm -rf $(VENV) $(addprefix .venv-,$(PEERS)) .pytest_cache .ruff_cache .hypothesis
