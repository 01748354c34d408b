# Two commands for a newcomer: `make demo` and `make test`. Both install what is missing first.
VENV := .venv
HACK := $(VENV)/bin/hack
PYTEST := $(VENV)/bin/python -m pytest

.PHONY: install test test-fast demo bench images images-check clean

# A fresh clone takes the pinned dependencies another checkout on this machine installed
# (scripts/venv_cache.sh), then the recipe confirms them and installs this checkout.
install:
	@bash scripts/venv_cache.sh restore
	@bash scripts/install.sh
	@bash scripts/venv_cache.sh save

# The whole suite, slow real-model and real-server tests included (that is what CI runs), in
# TEST_WORKERS pytest-xdist workers (0: one process). Each test module runs whole on one worker;
# tests/conftest.py says how the shared servers and the speed tests are kept apart.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadscope
test: install
	$(PYTEST) -q --durations=20 $(XDIST)

# Everything but the tests marked slow, for a quick loop while developing.
test-fast: install
	$(PYTEST) -q -m "not slow" $(XDIST)

demo: install
	$(HACK) demo

bench: install
	$(HACK) bench all

# Container images (docs/docker.md): the CPU image, built with docker where its engine runs,
# else with podman (installed here); IMAGE_ARGS= to build on python:3.11-slim-bookworm from a
# registry instead of the Debian base made here from Debian's archive.
IMAGE_ARGS ?= --local-base
images: install
	@bash scripts/install_containers.sh
	$(VENV)/bin/python docker/build_images.py cpu $(IMAGE_ARGS) --record artifacts/images/build.json

# As far as a machine without a GPU proves the images: the CPU image, its compose stack up and
# serving through the router with the requests on the dashboard, then down with nothing left;
# every supported GPU family built on the Debian stand-in base. Results: docs/bench/images-*.json.
images-check: images
	$(VENV)/bin/python docker/stack_check.py --record docs/bench/images-stack.json
	$(VENV)/bin/python docker/build_images.py --stand-in-base h100 a100 l4 a10g \
		--record docs/bench/images-gpu-standin.json

clean:
	rm -rf $(VENV) .pytest_cache
