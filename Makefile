# make demo        set up .venv on first use, then run a 5-site FedAvg simulation on FLCHAIN (ARGS: Hydra overrides)
# make test        set up .venv on first use, then run the test suite (ARGS: pytest options)
#                  without an NVIDIA GPU (no working nvidia-smi) that install takes torch's CPU build
#                  from TORCH_INDEX (PyTorch's CPU index), not the CUDA build (gigabytes); TORCH_INDEX=
#                  (empty) keeps PyPI's build; PIP_ARGS: further options of that install
# make flwr        the same app through Flower's CLI: `flwr run . local` with a local SuperLink
#                  (RUN_CONFIG="key=value ...", SITES=<number of sites>); make flwr-stop stops that SuperLink
# source .venv/bin/activate; flwr run . --stream --federation-config "num-supernodes=5"
#                  the same from the activated environment (its activate script sets FLWR_ENV's variables;
#                  one simulated SuperNode per site: Flower's default is 2)
PYTHON ?= python3
PIP_ARGS ?=
# auto: PyTorch's CPU index when no NVIDIA GPU answers nvidia-smi; a URL: that index; empty: none
TORCH_INDEX ?= auto
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
VENV := .venv
BIN := $(VENV)/bin
SITES ?= 5
RUN_CONFIG ?=
FLWR_HOME ?= $(CURDIR)/.flwr_home
LOCAL_SUPERLINK_PORT ?= 39091

# `flwr run` starts the local SuperLink (and it, its helpers) by name from PATH, so the venv's bin goes
# first; with runtime dependency installation left on, the SuperLink would `uv sync` the whole stack
# (torch with CUDA included) into a second environment for every run: this venv already has it.
# RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0: the setting Ray's FutureWarning asks for (the sites use no GPU).
FLWR_SETTINGS := FLWR_HOME="$(FLWR_HOME)" FLWR_TELEMETRY_ENABLED=0 \
	FLWR_DISABLE_UPDATE_CHECK=1 FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 \
	FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=$(LOCAL_SUPERLINK_PORT) RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0
FLWR_ENV := PATH="$(abspath $(BIN)):$$PATH" $(FLWR_SETTINGS)

.PHONY: demo test flwr flwr-stop benchmark clean

# torch>=2.13,<2.14 is met by the CPU index's 2.13.0+cpu; an index that cannot be reached (an offline
# mirror) is left out, since pip would otherwise retry it for every package.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	@index="$(TORCH_INDEX)"; \
	if [ "$$index" = auto ]; then \
		if nvidia-smi -L >/dev/null 2>&1; then index=; \
		else index="$(CPU_TORCH_INDEX)"; echo "no NVIDIA GPU: torch's CPU build from $$index (TORCH_INDEX= installs PyPI's CUDA build)"; fi; \
	fi; \
	if [ -n "$$index" ] && ! $(BIN)/python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=10)" "$$index" 2>/dev/null; then \
		echo "$$index cannot be reached: torch comes from pip's configured indexes"; index=; \
	fi; \
	set -x; $(BIN)/pip install --quiet -e '.[test]' $${index:+--extra-index-url "$$index"} $(PIP_ARGS)
	touch $@

# `source .venv/bin/activate` exports FLWR_SETTINGS, so that `flwr run .` from the activated
# environment uses this project's local SuperLink (the one of `make flwr`) and this environment's
# packages, as `make flwr` does; FLWR_HOME's config.toml names that SuperLink the default connection
# (both written again when this Makefile changes). The number of simulated SuperNodes is not written
# there: Flower 1.41 deprecates `options.` in a connection (it warns on every `flwr run`) for
# `flwr run --federation-config "num-supernodes=N"`, which `make flwr` passes.
$(VENV)/.flwr-env: Makefile $(VENV)/.installed
	@sed -i.bak '/^# fedsurv-flwr-begin/,/^# fedsurv-flwr-end/d' $(BIN)/activate && rm -f $(BIN)/activate.bak
	@printf '%s\n' "# fedsurv-flwr-begin (Makefile): flwr run . from this environment" \
		'export $(FLWR_SETTINGS)' "# fedsurv-flwr-end" >> $(BIN)/activate
	@mkdir -p "$(FLWR_HOME)" && printf '%s\n' "# Written by make (Makefile): flwr run . uses this project's local SuperLink" \
		'[superlink]' 'default = "local"' '' '[superlink.local]' 'address = ":local:"' > "$(FLWR_HOME)/config.toml"
	@touch $@

demo: $(VENV)/.installed $(VENV)/.flwr-env
	$(BIN)/python -m simulations.run $(ARGS)

test: $(VENV)/.installed $(VENV)/.flwr-env
	$(BIN)/python -m pytest $(ARGS)

# The run config, the data file and output.dir are checked first (a ServerApp's error would reach the
# user as Flower's traceback, after the SuperLink started): a problem is one line and exit status 2.
flwr: $(VENV)/.installed $(VENV)/.flwr-env
	@$(BIN)/python -m flwr_app.config --check-run "$(RUN_CONFIG)"
	$(FLWR_ENV) $(BIN)/flwr run . local --stream --run-config "$(RUN_CONFIG)" \
		--federation-config "num-supernodes=$(SITES) client-resources-num-cpus=1"
	@# `flwr run --stream` exits 0 even when the run failed: fail unless the last run completed.
	@$(FLWR_ENV) $(BIN)/flwr ls local --format json | $(BIN)/python -c "$$LAST_RUN_COMPLETED"

# Stops the SuperLink that `make flwr` started: the process listening on the local SuperLink's
# port whose log is in this FLWR_HOME, by its PID (another user's SuperLink is left alone).
flwr-stop:
	@$(BIN)/python -c "$$STOP_LOCAL_SUPERLINK" "$(FLWR_HOME)" $(LOCAL_SUPERLINK_PORT)

benchmark: $(VENV)/.installed
	$(BIN)/python benchmarks/flower_overhead.py $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache

define LAST_RUN_COMPLETED
import json, sys
runs = sorted(json.load(sys.stdin)["runs"], key=lambda run: run["pending-at"])
status = runs[-1]["status"] if runs else "no run"
print(f"flwr run: {status}")
sys.exit(status != "finished:completed")
endef
export LAST_RUN_COMPLETED

define STOP_LOCAL_SUPERLINK
import sys, psutil
home, port = sys.argv[1], int(sys.argv[2])
pids = {c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid}
ours = [psutil.Process(pid) for pid in pids if f"{home}/local-superlink/" in " ".join(psutil.Process(pid).cmdline())]
for process in ours:
    process.terminate()
    try:
        process.wait(timeout=30)
    except psutil.TimeoutExpired:
        process.kill()
    print(f"stopped the local SuperLink of {home} (PID {process.pid})")
if not ours:
    print(f"no local SuperLink of {home} listens on port {port}")
endef
export STOP_LOCAL_SUPERLINK
