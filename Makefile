# make demo   set up .venv on first use, then run a 5-site FedAvg simulation on FLCHAIN
# make test   set up .venv on first use, then run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test benchmark clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/python -m simulations.run $(ARGS)

test: $(VENV)/.installed
	$(BIN)/python -m pytest $(ARGS)

benchmark: $(VENV)/.installed
	$(BIN)/python benchmarks/flower_overhead.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
