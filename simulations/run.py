"""One experiment: ``python -m simulations.run [key=value ...]`` (Hydra overrides).

Examples
--------
``python -m simulations.run``                                   5-site FedAvg, hazard MLP, FLCHAIN
``python -m simulations.run model=cox_mlp federation.rounds=30``
``python -m simulations.run data=sba federation.partition=region``
``python -m simulations.run data=csv data.path=/abs/site.csv data.time_col=t data.event_col=e``

The run goes through Flower's simulation engine (Ray) with the ServerApp and ClientApp of
``flwr_app``; with ``baseline.centralized=true`` (default) the same model is also trained on the
pooled training data and reported beside the federated result.
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flwr_app.config import ConfigError
from models.data import DataValidationError
from simulations.engine import run_simulation
from simulations.hydra_config import flatten


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    """Run the experiment; return the test C-index (Hydra sweepers may optimise it)."""
    flat = flatten(cfg)
    if not flat["output.dir"] and not flat["resume.from"]:  # a resumed run continues in its own directory
        flat["output.dir"] = HydraConfig.get().runtime.output_dir
    try:
        summary = run_simulation(flat)
    except (ConfigError, DataValidationError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    return summary["test"].get("c_index")


if __name__ == "__main__":
    main()
