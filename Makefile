# Two commands for a newcomer: `make demo` and `make test`. Both install what is missing first.
VENV := .venv
HACK := $(VENV)/bin/hack
PYTEST := $(VENV)/bin/python -m pytest

.PHONY: install test test-fast demo bench clean

install:
	@bash scripts/install.sh

# The whole suite, slow real-model and real-server tests included (that is what CI runs).
test: install
	$(PYTEST) -q --durations=20

# Everything but the tests marked slow, for a quick loop while developing.
test-fast: install
	$(PYTEST) -q -m "not slow"

demo: install
	$(HACK) demo

bench: install
	$(HACK) bench all

clean:
	rm -rf $(VENV) .pytest_cache
