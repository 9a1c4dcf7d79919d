"""ServerApp: the run's entry point. It reads the run config, creates the output directory, and runs
the server program (:func:`flwr_app.server_program.run_program`) of the strategy's kind: a
horizontal federation (:func:`flwr_app.horizontal_server.run_horizontal`, which hands Cox
regression, ``model.name = "coxph"``, to :mod:`flwr_app.cox_server` after the same set-up), split
learning (:func:`flwr_app.vertical_server.run_vertical`) or ``private_split``
(:func:`flwr_app.private_split_server.run_private_split`).
"""

from __future__ import annotations

import time

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from flwr_app import runlog, vertical_task
from flwr_app.config import ConfigError, parse_run_config
from flwr_app.horizontal_server import run_horizontal
from flwr_app.outputs import RunOutputs
from flwr_app.private_split_server import run_private_split
from flwr_app.server_program import poll_replies_often, wait_for_sites
from flwr_app.vertical_server import FlowerSplitTransport, run_vertical
from strategies.horizontal import holds_test_part
from strategies.mechanisms.private_split import PrivateSplitDP
from strategies.mechanisms.registry import get_mechanism

app = ServerApp()


@app.main()
@runlog.logged
def main(grid: Grid, context: Context) -> None:
    """Run the configured strategy over the federation's sites and write the run's outputs."""
    cfg = parse_run_config(context.run_config)
    mechanism = get_mechanism(cfg.strategy)
    if mechanism.vertical and not holds_test_part(cfg.data):
        raise ConfigError(f"run config: data.test_fraction = 0 needs a horizontal strategy; {cfg.strategy!r} (split "
                          "learning) predicts and scores the label holder's test records: set data.test_fraction "
                          "in (0, 1)")
    poll_replies_often(grid)
    outputs = RunOutputs.create(cfg)
    runlog.attach(outputs.directory)
    if not cfg.resume_from:  # a resumed run keeps the config.json of the run it continues (checked equal)
        outputs.write_config(cfg, context.run_config)
    started = time.perf_counter()
    if mechanism.vertical:
        table = vertical_task.load_table(cfg)
        modalities = vertical_task.modality_names(cfg.data.deployed, cfg.split.modalities, table)
        wait_for_sites(grid, len(modalities), simulated=False)  # its sites may deploy
        run = run_private_split if isinstance(mechanism, PrivateSplitDP) else run_vertical
        transport = FlowerSplitTransport(grid, timeout=cfg.federation.timeout_s, deployed=cfg.data.deployed)
        run(cfg, transport, outputs, table=table, started=started)
        return
    run_horizontal(cfg, grid, outputs, started=started)
