# The fork's entry points. `make demo` and `make test` build everything they need.
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
# Inputs of the fork wheel: rebuilt and reinstalled when any of them changes.
SOURCES := $(shell git ls-files -co --exclude-standard pyproject.toml upstream.lock patches python build_backend 2>/dev/null)

.PHONY: venv demo test test-model test-tp bench bench-hooks bench-deadline bench-rl bench-serving bench-transfer bench-recovery wheel system-deps clean

venv: $(VENV)/.fork-installed

demo: venv
	$(VPY) -m testing.demo $(ARGS)

test: venv system-deps
	$(VPY) -m pytest -ra --durations=25 --timeout=1200 test/srt

# The models' long runs (test/srt/model): random examples for MODEL_SECONDS (default 1800 s) each, the lifecycle model
# then the pair model, printing steps; `make test` runs their deterministic tiers.
test-model: venv
	MODEL_PROFILE=long $(VPY) -m pytest -ra -s --timeout=0 test/srt/model/test_lifecycle_model.py test/srt/model/test_pair_model.py

# Every end-to-end scenario on every multi-rank topology (TP 2 + TP 2, prefill TP 2 +
# decode TP 1); `make test` runs the pick of them not marked tp_matrix. docs/multi-rank.md: how long.
test-tp: venv
	$(VPY) -m pytest -ra --durations=50 --timeout=1800 -m tp test/srt

# Release gate: the fork vs stock upstream on CPU, judged on CPU time, then the cost of
# each hook in process (~8 min on the shared box; not part of `make test`).
# ARGS: --rounds N, --requests N, --write-readme (see bench/README.md).
bench: venv
	$(VPY) -m bench.release_gate $(ARGS)
# The hook micro-benchmark alone (< 2 min, no servers).
bench-hooks: venv
	$(VPY) -m bench.hook_cost $(ARGS)
bench-deadline: venv
	$(VPY) bench/transfer_deadline_bench.py
# RL step calls (pause/release/resume/update/continue) timed, fork vs upstream (~10 min).
bench-rl: venv
	$(VPY) -m bench.rl_step $(ARGS)
# Upstream's own client (python -m sglang.benchmark.serving: streaming, random 128 in / 32 out, concurrency
# 1, 4, 16) against a 1P1D of the fork and one of stock upstream, rounds alternated, then the lone request's
# cost in ms (~10 min). ARGS: --rounds N, --concurrency ..., --lone N, --write-readme (bench/README.md).
bench-serving: venv
	$(VPY) -m bench.serving $(ARGS)
# KV moved prefill -> decode over mooncake TCP between test hosts, fork vs upstream, against raw TCP
# (~3 min; root). ARGS: --rate MBIT, --paced, --repeats N, --sides ..., --limits-only POLLS, --write-readme (bench/README.md).
bench-transfer: venv
	$(VPY) -m bench.transfer $(ARGS)

# What recovery adds to a request's latency, per cause, against a calm request, with the detection time split out
# (1P1D on CPU, recovery on, the test fault switch on prefill; ~3 min). ARGS: --requests N, --write-readme (bench/README.md).
bench-recovery: venv
	$(VPY) -m bench.recovery $(ARGS)

wheel:
	$(PYTHON) -m pip wheel --no-deps --wheel-dir dist .

# mooncake's engine.so links libibverbs.so.1 even when it only speaks TCP; the tests check the
# alert rules with promtool (Debian's prometheus package; its daemon is not started here).
system-deps:
	@missing=""; \
	ldconfig -p | grep -q 'libibverbs\.so\.1 ' || missing="$$missing libibverbs1"; \
	command -v promtool >/dev/null || missing="$$missing prometheus"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	  else echo "missing system packages:$$missing: run 'sudo apt-get install$$missing'" >&2; exit 1; fi; \
	fi

$(VENV)/.deps-installed: requirements/cpu.txt requirements/test.txt
	@$(MAKE) --no-print-directory system-deps
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-deps \
	    -r requirements/cpu.txt -r requirements/test.txt
	touch $@

$(VENV)/.fork-installed: $(VENV)/.deps-installed $(SOURCES)
	$(VPY) -m pip install --quiet --disable-pip-version-check --no-deps --force-reinstall .
	touch $@

clean:
	rm -rf $(VENV) dist .cache
