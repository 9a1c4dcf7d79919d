"""Privacy ledger: what each site spent, under which mechanism and assumptions.

Every run writes one. Entries are per site and per round; the run's headline ε for record-level
DP over disjoint sites is the **maximum** over sites (parallel composition), never a mean.
Strategies without a privacy mechanism still write entries (mechanism ``"none"``, ε ``None``), so
that a reader of any run's outputs sees explicitly that nothing was protected.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LedgerEntry:
    """One site's privacy position after one round.

    ``epsilon`` is cumulative (everything the site has released so far), ``None`` when no
    mechanism bounds it; ``accountant`` names what computed it (``dp-accounting-pld``,
    ``opacus-prv``, ``opacus-rdp``, …). ``epsilon_rdp``: the Rényi-DP figure of the same releases
    (opacus' RDP and its conversion at ``delta``), beside a headline from a tighter accountant,
    equal to ``epsilon`` where the headline is itself RDP; ``None`` in ledgers written before it
    existed and for mechanisms that do not give it. For Bayesian DP it is the average-case ``ε_μ`` and
    ``epsilon_classical`` is the worst-case ε of the same (σ, q, steps). ``prior``: the site's
    releases before training composed into ``epsilon`` (the private set-up's Gaussian releases,
    as ``(noise multiplier, sample rate, steps)``), so that the figure can be recomputed from the
    entry alone. ``epsilon_filter``: for a deployed site with its own privacy policy, its Rényi
    filter's ε (at the site's own δ) once the run's releases so far are charged, from the filter
    it announced at set-up; ``None`` for the other sites.
    """

    round: int
    site: str
    mechanism: str
    unit: str
    adjacency: str
    accountant: str
    epsilon: float | None
    delta: float | None
    noise_multiplier: float | None = None
    clip_norm: float | None = None
    sample_rate: float | None = None
    steps: int | None = None
    epsilon_classical: float | None = None
    epsilon_rdp: float | None = None
    epsilon_nominal: float | None = None
    epsilon_audited_formula: float | None = None
    epsilon_filter: float | None = None
    assumptions: tuple[str, ...] = ()
    prior: tuple[tuple[float, float, int], ...] = ()


@dataclass
class PrivacyLedger:
    """Append-only ledger, mirrored line by line to ``path`` (JSON Lines) when given."""

    path: Path | None = None
    entries: list[LedgerEntry] = field(default_factory=list)

    @classmethod
    def resume(cls, path: Path, *, last_round: int) -> PrivacyLedger:
        """The ledger at ``path`` up to ``last_round``, to be continued by a resumed run.

        Entries of later rounds (written before a crash that came before those rounds' checkpoint)
        are dropped from the file too (rewritten atomically): the resumed run runs those rounds
        again with the same seeds and records them again.
        """
        kept = [entry for entry in cls.read(path).entries if entry.round <= last_round]
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(json.dumps(asdict(entry)) + "\n" for entry in kept), encoding="utf-8")
        tmp.replace(path)
        return cls(path, kept)

    @classmethod
    def read(cls, path: Path) -> PrivacyLedger:
        """The entries of the ledger file at ``path`` (none if there is no file), not to be continued."""
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        return cls(None, [LedgerEntry(**{**fields, "assumptions": tuple(fields["assumptions"]),
                                         "prior": tuple(tuple(entry) for entry in fields.get("prior", ()))})
                          for fields in map(json.loads, lines)])

    def record(self, *entries: LedgerEntry) -> None:
        """Append ``entries`` (and write them to disk at once, in one append, so a crash loses nothing)."""
        self.entries.extend(entries)
        if self.path is not None and entries:
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write("".join(json.dumps(asdict(entry)) + "\n" for entry in entries))

    def headline(self) -> dict[str, object]:
        """The run's privacy claim: the worst (largest) cumulative ε over sites.

        Returns ``{"epsilon": None, ...}`` when no entry carries an ε (no DP mechanism ran).
        """
        latest = self._latest()
        worst = self.worst()
        if worst is None:
            return {"epsilon": None, "delta": None, "unit": "none", "accountant": "none", "site": None}
        headline = {"epsilon": worst.epsilon, "delta": worst.delta, "unit": worst.unit,
                    "accountant": worst.accountant, "site": worst.site}
        for key in ("epsilon_rdp", "epsilon_classical", "epsilon_nominal", "epsilon_audited_formula"):
            values = [getattr(entry, key) for entry in latest.values() if getattr(entry, key) is not None]
            if values:
                headline[key] = max(values)  # the worst site
        return headline

    def worst(self) -> LedgerEntry | None:
        """The latest entry of the site that spent most (the first with no ε bound, if any); ``None`` if empty."""
        latest = self._latest()
        if not latest:
            return None
        unbounded = [entry for entry in latest.values() if entry.epsilon is None]
        return unbounded[0] if unbounded else max(latest.values(), key=lambda entry: entry.epsilon)

    def _latest(self) -> dict[str, LedgerEntry]:
        """Every site's entry of its latest round."""
        latest: dict[str, LedgerEntry] = {}
        for entry in self.entries:
            if entry.site not in latest or entry.round >= latest[entry.site].round:
                latest[entry.site] = entry
        return latest
