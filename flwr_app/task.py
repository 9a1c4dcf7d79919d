"""Binds a typed :class:`ExperimentConfig` to the data and model code.

The ServerApp, the ClientApp, the centralised baseline and the benchmark all build their data
and model here, so that every path trains exactly the same network on exactly the same split.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flwr_app.config import PROJECT_ROOT, ExperimentConfig
from models.data import FederatedDataset, Preprocessor, RawTable, SurvivalArrays, build_federated_dataset, load_table
from models.metrics import calibration_table, evaluate_survival
from models.survival import SurvivalModel, build_survival_model, make_time_grid
from models.training import train_epochs
from strategies.accounting.rdp import SiteAccountant, calibrate_noise_multiplier, epsilon_gaussian_rounds
from strategies.mechanisms.adaptive_dp import AUDIT_RDP_ORDERS
from strategies.mechanisms.bdp import train_epochs_bdp
from strategies.mechanisms.dp_sgd import poisson_schedule, train_epochs_dp
from strategies.mechanisms.nbafl import WEIGHT_PERTURBATION, layer_parameters, release_weights, select_layer

DEFAULT_DATA_DIR = PROJECT_ROOT.parent / "shared" / "data"


def resolve_data_dir(data_dir: str) -> str:
    """Folder holding the bundled CSV data sets.

    ``data.dir`` if set, else ``$FEDSURV_DATA_DIR``, else ``../shared/data`` beside the project.
    """
    return str(Path(data_dir or os.environ.get("FEDSURV_DATA_DIR", "") or DEFAULT_DATA_DIR).resolve())


@functools.lru_cache(maxsize=4)
def _federation(
    name: str, seed: int, num_sites: int, partition: str, dirichlet_alpha: float, test_fraction: float,
    path: str, data_dir: str, time_col: str, event_col: str, feature_cols: tuple[str, ...],
    min_site_records: int, horizon_months: int, oot_start: str,
) -> FederatedDataset:
    return build_federated_dataset(
        name=name, seed=seed, num_sites=num_sites, partition=partition, dirichlet_alpha=dirichlet_alpha,
        test_fraction=test_fraction, path=path, data_dir=data_dir, time_col=time_col, event_col=event_col,
        feature_cols=feature_cols, min_site_records=min_site_records, sba_horizon_months=horizon_months,
        oot_start=oot_start,
    )


def load_federation(cfg: ExperimentConfig) -> FederatedDataset:
    """The federated data set of a run (deterministic in ``cfg.seed``; memoised per process).

    The cache holds immutable arrays only, so a process that serves several simulated sites
    (a Ray actor) loads and preprocesses the data once instead of once per message.
    """
    data, federation = cfg.data, cfg.federation
    return _federation(
        data.name, cfg.seed, federation.num_sites, federation.partition, federation.dirichlet_alpha,
        data.test_fraction, data.path, resolve_data_dir(data.dir), data.time_col, data.event_col,
        data.feature_cols, federation.min_site_records, data.horizon_months, data.oot_start,
    )


def build_model(cfg: ExperimentConfig, dataset: FederatedDataset) -> SurvivalModel:
    """The run's survival model, with its time grid fitted on the pooled training times.

    The grid (discrete-time intervals for the hazard model, the Breslow grid for Cox models) is
    shared by all sites, like the model architecture.
    """
    train = dataset.pooled("train")
    cuts = make_time_grid(
        train.time, train.event, num_durations=cfg.model.num_durations, scheme=cfg.model.time_grid
    )
    return build_network(cfg, in_features=dataset.in_features, cuts=cuts,
                         time_scale=(float(np.mean(train.time)), float(np.std(train.time))))


def build_network(
    cfg: ExperimentConfig, *, in_features: int, cuts: np.ndarray, time_scale: tuple[float, float],
) -> SurvivalModel:
    """The run's survival model for ``in_features`` inputs on the time grid ``cuts``.

    ``time_scale`` is the mean and standard deviation of the training times (CoxTime's time input).
    """
    return build_survival_model(
        cfg.model.name,
        in_features=in_features,
        cuts=cuts,
        hidden=cfg.model.hidden,
        dropout=cfg.model.dropout,
        activation=cfg.model.activation,
        penalty=cfg.model.penalty,
        time_scale=time_scale,
        seed=cfg.seed,
    )


@dataclass(frozen=True)
class SiteSpec:
    """What a deployment's server sends every site before training: the shared preprocessing
    (fitted from the sites' summed feature statistics), the time grid (from their summed time
    histograms) and the training times' mean and standard deviation (from their summed sums)."""

    preprocessor: Preprocessor
    cuts: np.ndarray
    time_scale: tuple[float, float]

    def to_json(self) -> str:
        return json.dumps({"preprocessor": self.preprocessor.to_dict(), "cuts": self.cuts.tolist(),
                           "time_scale": list(self.time_scale)})

    @classmethod
    def from_json(cls, text: str) -> SiteSpec:
        payload = json.loads(text)
        return cls(Preprocessor.from_dict(payload["preprocessor"]), np.asarray(payload["cuts"], dtype=np.float64),
                   (float(payload["time_scale"][0]), float(payload["time_scale"][1])))


def model_from_spec(cfg: ExperimentConfig, spec: SiteSpec) -> SurvivalModel:
    """The run's survival model in a deployment (the same network at the server and every site)."""
    return build_network(cfg, in_features=len(spec.preprocessor.feature_names), cuts=spec.cuts,
                         time_scale=spec.time_scale)


def load_site_table(cfg: ExperimentConfig, path: str) -> RawTable:
    """A deployed site's own file (CSV or Parquet), validated like ``data.name = "csv"``.

    Outcome columns ``data.time_col`` and ``data.event_col`` ("" = ``time``, ``event``), features
    ``data.feature_cols`` ("" = every other column); errors name the file, the column and the rows.
    """
    return load_table("csv", path=path, time_col=cfg.data.time_col, event_col=cfg.data.event_col,
                      feature_cols=cfg.data.feature_cols)


def train_local(model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, *, seed: int) -> dict[str, float]:
    """``cfg.train.local_epochs`` epochs of the model's own loss on ``data``."""
    torch.set_num_threads(cfg.train.num_threads)
    return train_epochs(
        model, data.x, data.time, data.event,
        epochs=cfg.train.local_epochs, batch_size=cfg.train.batch_size, lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay, seed=seed,
    )


def train_local_dp(
    model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, *, seed: int, state: dict | None,
) -> tuple[dict[str, float], dict]:
    """One round of record-level DP-SGD at a site; ``state`` carries σ and the accountant.

    The noise multiplier is calibrated once, before the site's first step, for its whole
    participation: Poisson rate ``q = B/n_k`` and ``rounds × round(local_epochs/q)`` steps must
    together spend at most ``privacy.epsilon`` at ``privacy.delta`` (opacus
    ``get_noise_multiplier``). The caller keeps ``state`` between rounds (the ClientApp in
    ``context.state``), so one accountant sees every step.

    Returns
    -------
    metrics
        ``train_loss`` and the site's privacy position: cumulative ``epsilon``,
        ``noise_multiplier``, ``sample_rate``, ``clip_norm`` and cumulative ``steps``.
    state
        JSON-serialisable: ``noise_multiplier``, ``accountant`` (``SiteAccountant.state_dict()``)
        and ``steps``.
    """
    torch.set_num_threads(cfg.train.num_threads)
    sample_rate, steps = poisson_schedule(len(data), batch_size=cfg.train.batch_size, epochs=cfg.train.local_epochs)
    state = dict(state or {})
    if "noise_multiplier" not in state:
        state["noise_multiplier"] = calibrate_noise_multiplier(
            target_epsilon=cfg.privacy.epsilon, target_delta=cfg.privacy.delta, sample_rate=sample_rate,
            steps=steps * cfg.federation.rounds, accountant=cfg.privacy.accountant,
        )
    noise_multiplier = float(state["noise_multiplier"])
    stats = train_epochs_dp(
        model, data.x, data.time, data.event, epochs=cfg.train.local_epochs, batch_size=cfg.train.batch_size,
        lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, seed=seed,
        noise_multiplier=noise_multiplier, clip_norm=cfg.privacy.clip_norm,
    )
    accountant = (SiteAccountant.from_state_dict(state["accountant"]) if "accountant" in state
                  else SiteAccountant(cfg.privacy.accountant))
    accountant.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate, num_steps=int(stats["num_steps"]))
    state.update(accountant=accountant.state_dict(), steps=accountant.spent_steps)
    metrics = {
        "train_loss": float(stats["loss"]),
        "epsilon": accountant.epsilon(cfg.privacy.delta),
        "noise_multiplier": noise_multiplier,
        "sample_rate": sample_rate,
        "clip_norm": cfg.privacy.clip_norm,
        "steps": accountant.spent_steps,
    }
    return metrics, state


def train_local_bdp(
    model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, *, seed: int, state: dict | None,
) -> tuple[dict[str, float], dict]:
    """One round of Bayesian-DP training at a site (``strategies.mechanisms.bdp``).

    The budget is ``ε_μ = privacy.epsilon`` with ``β = privacy.delta``; neighbours per
    ``privacy.adjacency``.
    """
    torch.set_num_threads(cfg.train.num_threads)
    return train_epochs_bdp(
        model, data.x, data.time, data.event, epochs=cfg.train.local_epochs, batch_size=cfg.train.batch_size,
        lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, seed=seed, clip_norm=cfg.privacy.clip_norm,
        target_epsilon_mu=cfg.privacy.epsilon, beta=cfg.privacy.delta, rounds=cfg.federation.rounds, state=state,
        adjacency=cfg.privacy.adjacency,
    )


def smallest_site_records(cfg: ExperimentConfig) -> int:
    """``m`` of NbAFL's sensitivity ``2C/m``: ``privacy.min_site_records``, or if 0 the smallest
    site's number of training records in this (simulated) federation."""
    if cfg.privacy.min_site_records > 0:
        return cfg.privacy.min_site_records
    return min(len(site.train) for site in load_federation(cfg).sites)


def train_local_perturbed(
    model: SurvivalModel, data: SurvivalArrays, cfg: ExperimentConfig, *, seed: int, state: dict | None,
) -> tuple[dict[str, float], dict]:
    """One round at a site of ``nbafl``, ``ls_adp`` or ``row_dp``: train, clip, perturb the weights.

    Local training is the plain one (:func:`train_local`; ROW-DP also records the selected
    layer's weights after every step); then :func:`strategies.mechanisms.nbafl.release_weights`
    clips and perturbs ``model.net`` in place. LS-ADP's metric ``p`` is the model's loss on the
    site's whole training part (eval mode). ``L`` (exposures) is ``federation.rounds``: every
    site may upload in every round.

    The privacy spent so far composes each round's release, a Gaussian mechanism with noise
    multiplier ``z_r`` relative to ``Δs_U``: by RDP, one Gaussian with ``1/z² = Σ_r 1/z_r²``;
    by the paper's formula (linear composition), ``Σ_r c/z_r``. ``state`` carries both sums.

    Returns
    -------
    metrics
        ``train_loss``; ``epsilon`` (RDP, cumulative), ``epsilon_audited_formula`` (the
        paper's formula at the smallest noise, cumulative), ``epsilon_nominal`` (the paper's
        average budget, the target), ``noise_multiplier`` (this round's), ``noise_min``,
        ``noise_max``, ``weight_norm``, ``clip_norm``, ``steps`` (uploads so far),
        ``min_site_records``, ``selected_layer``.
    state
        ``inverse_square_sum``, ``formula_sum`` and ``steps``.
    """
    torch.set_num_threads(cfg.train.num_threads)
    privacy = cfg.privacy
    public_state = {key: value.detach().clone() for key, value in model.net.state_dict().items()}
    generator = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, 1]).generate_state(1)[0]))
    selected, iterates = -1, []
    on_step = None
    if cfg.strategy == "row_dp":
        selected = select_layer(model.net, generator)
        params = layer_parameters(model.net)[selected]

        def on_step() -> None:
            iterates.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())

    stats = train_epochs(
        model, data.x, data.time, data.event, epochs=cfg.train.local_epochs, batch_size=cfg.train.batch_size,
        lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, seed=seed, on_step=on_step,
    )
    x_t = torch.as_tensor(np.asarray(data.x, dtype=np.float32))
    time_t = torch.as_tensor(np.asarray(data.time, dtype=np.float64))
    event_t = torch.as_tensor(np.asarray(data.event, dtype=np.float32))

    def site_loss(net: torch.nn.Module) -> float:
        net.eval()
        return float(model.loss(x_t, time_t, event_t, generator=torch.Generator().manual_seed(seed)))

    min_records = smallest_site_records(cfg)
    release = release_weights(
        model.net, method=cfg.strategy, allocation=privacy.allocation, epsilon=privacy.epsilon,
        delta=privacy.delta, clip_norm=privacy.clip_norm, min_site_records=min_records,
        exposures=cfg.federation.rounds, generator=generator, public_state=public_state,
        evaluate=site_loss if cfg.strategy == "ls_adp" else None,
        iterates=torch.stack(iterates) if iterates else None, selected_layer=selected,
        dispersion_measure=privacy.dispersion, uniform_mix=privacy.uniform_mix,
    )
    state = dict(state or {"inverse_square_sum": 0.0, "formula_sum": 0.0, "steps": 0})
    state["inverse_square_sum"] += 1.0 / release.noise_multiplier**2
    state["formula_sum"] += release.epsilon_audited_formula / cfg.federation.rounds
    state["steps"] += 1
    metrics = {
        "train_loss": float(stats["loss"]),
        "epsilon": 0.0 if state["inverse_square_sum"] == 0.0 else epsilon_gaussian_rounds(  # 0: nothing released
            noise_multiplier=state["inverse_square_sum"] ** -0.5, rounds=1, delta=privacy.delta,
            orders=list(AUDIT_RDP_ORDERS)),
        "epsilon_audited_formula": state["formula_sum"],
        "epsilon_nominal": release.epsilon_nominal,
        "noise_multiplier": release.noise_multiplier,
        "noise_min": release.noise_min,
        "noise_max": release.noise_max,
        "weight_norm": release.weight_norm,
        "clip_norm": privacy.clip_norm,
        "steps": state["steps"],
        "min_site_records": min_records,
        "selected_layer": release.selected_layer,
    }
    return metrics, state


def evaluate(
    model: SurvivalModel, test: SurvivalArrays, train: SurvivalArrays, *, concordance_td: bool = True,
) -> dict[str, float]:
    """Test metrics of ``model``; the IPCW censoring distribution comes from ``train``."""
    times, surv = model.predict_survival(test.x)
    return evaluate_survival(
        times, surv, time=test.time, event=test.event, train_time=train.time, train_event=train.event,
        risk=model.risk_score(test.x), concordance_td=concordance_td,
    )


def calibration(model: SurvivalModel, dataset: FederatedDataset) -> dict[str, list[dict[str, float]]]:
    """Mean predicted survival vs Kaplan–Meier (95% CI) on the pooled test split and each site's.

    Horizons: the quartiles of the pooled training event times.
    """
    train = dataset.pooled("train")
    horizons = np.quantile(train.time[train.event == 1], [0.25, 0.5, 0.75])
    parts = [("pooled test", dataset.pooled("test"))] + [(site.name, site.test) for site in dataset.sites]
    tables = {}
    for name, part in parts:
        times, surv = model.predict_survival(part.x)
        table = calibration_table(times, surv, time=part.time, event=part.event, horizons=horizons)
        tables[name] = table.to_dict("records")
    return tables


def round_seed(seed: int, server_round: int, site_index: int) -> int:
    """The training seed of one site in one round (independent streams per site and round)."""
    return int(np.random.SeedSequence([seed, server_round, site_index]).generate_state(1)[0])


#: Private training, by strategy name: ``(model, data, cfg, *, seed, state)``; ``state`` is kept
#: by the site between rounds.
PRIVATE_TRAINING = {"dp_sgd": train_local_dp, "bdp": train_local_bdp,
                    **{name: train_local_perturbed for name in WEIGHT_PERTURBATION}}


def train_centralized(cfg: ExperimentConfig, dataset: FederatedDataset) -> dict[str, object]:
    """The centralised baseline: the same model, initialisation and optimiser on the pooled data.

    It makes ``federation.rounds × train.local_epochs`` passes over the pooled training part — as
    many as every record gets in the federation — and is evaluated on the same test split.

    For the record-level DP strategies (``dp_sgd``, ``bdp``) the baseline runs the same mechanism
    on the pooled data, as one site holding every record for all rounds, with the same target
    ``(ε, δ)``, clip norm and (for ``bdp``) adjacency; its spent ε is returned under
    ``"privacy"``. For the other strategies it is trained without DP (client-level DP has no
    centralised counterpart; the weight-perturbation strategies' paper compares with the no-DP
    Cox-MLP).
    """
    model = build_model(cfg, dataset)
    train = dataset.pooled("train")
    epochs = cfg.federation.rounds * cfg.train.local_epochs
    torch.set_num_threads(cfg.train.num_threads)
    privacy: dict[str, object] | str = "none (no DP)"
    if cfg.strategy in ("dp_sgd", "bdp"):
        state = None
        for server_round in range(1, cfg.federation.rounds + 1):
            metrics, state = PRIVATE_TRAINING[cfg.strategy](
                model, train, cfg, seed=round_seed(cfg.seed, server_round, dataset.num_sites), state=state)
        privacy = {"mechanism": cfg.strategy, **{key: float(value) for key, value in metrics.items()
                                                 if key != "train_loss"}}
    else:
        train_epochs(
            model, train.x, train.time, train.event, epochs=epochs, batch_size=cfg.train.batch_size,
            lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, seed=cfg.seed,
        )
    if model.needs_baseline:
        model.set_baseline(*model.breslow_aggregates(train.x, train.time, train.event))
    result: dict[str, object] = {"epochs": epochs, "privacy": privacy,
                                 "test": evaluate(model, dataset.pooled("test"), train)}
    if any(site.oot is not None and len(site.oot) for site in dataset.sites):
        result["oot"] = evaluate(model, dataset.pooled("oot"), train)
    return result
