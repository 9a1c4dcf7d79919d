"""Noise multiplier BDP needs vs classical DP-SGD at the same target, by clip norm and model state.

The largest SBA region (South), q = 128/n, 20 rounds x 1 epoch of steps, target 1 at delta 1e-5,
add/remove adjacency; BDP's pilot distances from 64 records at the initial model and at the model
after 5 non-private epochs. Usage: ``.venv/bin/python docs/results/scripts/bdp_noise.py``.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from flwr_app import task
from models.training import train_epochs
from simulations.engine import resolve
from strategies.accounting.bayesian_dp import calibrate_noise_for_bdp
from strategies.accounting.rdp import calibrate_noise_multiplier
from strategies.mechanisms.bdp_training import pilot_distances
from strategies.mechanisms.schedules import poisson_schedule

_, cfg = resolve({"data.name": "sba", "federation.partition": "region"})
dataset = task.load_federation(cfg)
site = max(dataset.sites, key=lambda s: len(s.train))
train = site.train
q, steps = poisson_schedule(len(train), batch_size=128, epochs=1)
total = 20 * steps
print(f"site {site.name}: n = {len(train)}, q = {q:.4f}, steps = {total}")
model = task.build_model(cfg, dataset)
for state in ("initial model", "after 5 epochs"):
    if state == "after 5 epochs":
        train_epochs(model, train.x, train.time, train.event, epochs=5, batch_size=128, lr=0.003, weight_decay=1e-4, seed=0)
    for clip in (0.1, 1.0, 5.0):
        d = pilot_distances(model, train.x, train.time, train.event, clip_norm=clip, seed=0, adjacency="add-remove")
        dp = calibrate_noise_multiplier(target_epsilon=1.0, target_delta=1e-5, sample_rate=q, steps=total)
        bdp = calibrate_noise_for_bdp(target_epsilon_mu=1.0, beta=1e-5, distances_pilot=d, sample_rate=q, steps=total, clip_norm=clip)
        print(f"{state:15s} C = {clip:4.1f}: share of records clipped {np.mean(d >= clip * (1 - 1e-6)):.2f}, "
              f"sigma DP {dp:.3f} (noise std {dp * clip:.3f}), sigma BDP {bdp:.3f} (noise std {bdp * clip:.3f}), ratio {bdp / dp:.2f}")
