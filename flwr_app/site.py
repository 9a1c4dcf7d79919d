"""One command for a partner site: check everything, say what will leave, run the SuperNode and its executor.

``python -m flwr_app.site start`` (installed as ``fedsurv-site start``)::

    fedsurv-site start --superlink HOST:PORT --ca ca.crt --key keys/hospital-a --data site.csv --policy policy.toml \\
        [--state-dir DIR] [--runtime-port 9094] [--dry-run]

checks, before anything connects, the SuperLink's address (``HOST:PORT``), the SuperNode's key (an OpenSSH
ECDSA private key, what Flower's SuperNode authentication reads, and its ``.pub`` beside it when there is one), the
CA certificate (PEM, parsing, valid today), the policy file and the data file (read with the site's own loader,
:func:`flwr_app.task.load_site_table`, under the policy's column roles: at least
:data:`~models.data.partition.MIN_SITE_RECORDS` records) and the site's ledger (verified against its head, created
for this data file). Each failure is one line naming the file or key and the fix; the command then exits with status
2 and starts nothing. Otherwise it prints what the site will share under which policy (the mechanisms' release
manifests), and starts ``flower-supernode`` with ``--isolation process`` and the ClientApp executor
(:func:`executor_command`), telemetry off, both in one process group of their own: SIGINT or SIGTERM stops both, an
executor that dies is restarted (at most :data:`MAX_RESTARTS` times in :data:`RESTART_WINDOW_S`), and the command
exits with the SuperNode. ``--dry-run`` stops after the first screen and prints the command it would run.

The policy file is TOML, one node-config key per line (lists allowed where the node config takes a
comma-separated list), the keys of :data:`POLICY_KEYS`: the site's name, its privacy policy
(:mod:`flwr_app.site_policy`: ``privacy-max-epsilon`` is required), its column roles (``data-time-col`` and
``data-event-col`` required) and ``max-test-share``. ``data-path`` and ``site-dir`` come from ``--data`` and
``--state-dir`` (default ``$XDG_STATE_HOME/fedsurv/<site-name>``); ``privacy-ledger`` defaults to
``<state dir>/ledger.jsonl``; relative paths are read from the policy file's folder.

``fedsurv-site status --policy policy.toml [--state-dir DIR]`` prints the site's ledger per run against its budget
and the last message the site recorded (its ledger, its kept test metrics, its error log).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import datetime
import difflib
import fnmatch
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from flwr_app import site_policy, site_store
from flwr_app.site_errors import LOG_FILE, MESSAGES_FILE, REQUIRED_ROLE_KEYS, ROLE_KEYS

__all__ = ["POLICY_KEYS", "SiteCheckFailed", "SitePlan", "check_site", "executor_command", "main", "read_policy",
           "supernode_command"]

#: Node-config keys whose value is a comma-separated list (a TOML list is joined).
LIST_KEYS = ("privacy-mechanisms", "data-feature-cols", "data-drop-cols", "data-categorical-cols", "data-event-values")
#: The keys a policy file may set.
POLICY_KEYS = ("site-name", *site_policy.KEYS, *ROLE_KEYS.values(), "max-test-share")
#: Keys the command sets from its own options, never from the policy file.
OPTION_KEYS = {"data-path": "--data", "site-dir": "--state-dir"}
#: Paths in a policy file, read relative to its folder.
PATH_KEYS = ("privacy-ledger",)
#: A metric name, to find the releases that travel as an evaluation reply's metrics (``evaluate/metrics.*``).
KEPT_PROBE = "c_index"
#: The file, in the site's directory, where a policy site keeps its test metrics (``flwr_app.client_app``'s, named
#: here so that ``status`` and the first screen import no ClientApp).
EVALUATION_FILE = "evaluation.jsonl"
#: An executor that exits is restarted at most this many times within :data:`RESTART_WINDOW_S` seconds.
MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0
#: Seconds the SuperNode and its executor get to exit after SIGTERM before SIGKILL.
STOP_WAIT_S = 20.0
#: The environment of the SuperNode and its executor: no call-outs to Flower's telemetry or update check.
QUIET_FLOWER = {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1"}


class SiteCheckFailed(ValueError):
    """One check before the site connects failed: the message is one line naming the file or key and the fix."""


@dataclasses.dataclass(frozen=True)
class SitePlan:
    """What ``start`` checked and will run: the node config, and what the first screen reports of each input."""

    superlink: str
    ca: Path
    key: Path
    node_config: dict[str, Any]
    policy: site_policy.SitePolicy
    facts: dict[str, str]
    runtime_port: int


# ------------------------------------------------------------------ the checks


def check_address(address: str) -> str:
    """``address`` when it is ``HOST:PORT`` (a name, an IPv4 address or a bracketed IPv6 address; port 1-65535),
    else :class:`SiteCheckFailed`."""
    host, _, port = address.rpartition(":")
    bracketed = re.fullmatch(r"\[[0-9A-Fa-f:.]+\]", host)
    named = re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?", host)
    if not (port.isdigit() and 1 <= int(port) <= 65535 and (bracketed or named)):
        raise SiteCheckFailed(f"--superlink {address!r} is not HOST:PORT: give the SuperLink's Fleet address from the "
                              "coordinator, e.g. --superlink superlink.example.org:9091 (an IPv6 address in brackets)")
    return address


def _read(path: Path, option: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise SiteCheckFailed(f"{option} {path}: cannot be read ({err.strerror or err}): give the path of the file, "
                              "readable by the user the site runs as") from None


def check_key(path: Path) -> str:
    """The SuperNode's key: an OpenSSH ECDSA private key (what Flower's SuperNode authentication loads), and the
    public key in ``<key>.pub`` when there is one must be its own. Returns the public key's SHA256 fingerprint."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    data = _read(path, "--key")
    fix = "give the private key deploy/make_supernode_keys.sh wrote (keys/<site>, not its .pub)"
    if b"CERTIFICATE-----" in data:
        raise SiteCheckFailed(f"--key {path}: is a certificate, not the SuperNode's private key; {fix}")
    try:
        key = serialization.load_ssh_private_key(data, password=None)
    except TypeError:
        raise SiteCheckFailed(f"--key {path}: is protected by a passphrase, which flower-supernode cannot enter; make "
                              "a key without one with deploy/make_supernode_keys.sh") from None
    except (ValueError, UnsupportedAlgorithm):
        kind = "a PEM private key, not in OpenSSH format" if b"PRIVATE KEY-----" in data else "not a private key"
        raise SiteCheckFailed(f"--key {path}: {kind}; {fix}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise SiteCheckFailed(f"--key {path}: a {type(key).__name__.removeprefix('_')} key, but Flower's SuperNode "
                              f"authentication needs an ECDSA key; {fix}")
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    pub = path.with_name(path.name + ".pub")
    if pub.exists() and _read(pub, "--key's public key").split()[:2] != public.split()[:2]:
        raise SiteCheckFailed(f"{pub}: is not the public key of --key {path}: send the coordinator the .pub written "
                              "with this key (ssh-keygen -y -f KEY prints it)")
    digest = base64.b64encode(hashlib.sha256(base64.b64decode(public.split()[1])).digest()).decode().rstrip("=")
    return f"{path} (ECDSA {key.curve.name}), public key SHA256:{digest}"


def check_ca(path: Path) -> str:
    """The CA certificate (or bundle) that verifies the SuperLink: PEM certificates that parse and are valid today."""
    from cryptography import x509

    data = _read(path, "--ca")
    try:
        certificates = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise SiteCheckFailed(f"--ca {path}: not a PEM certificate: give the ca.crt the coordinator sent (made by "
                              "deploy/make_certificates.sh)") from None
    now = datetime.datetime.now(datetime.timezone.utc)
    for cert in certificates:
        if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
            raise SiteCheckFailed(f"--ca {path}: the certificate {cert.subject.rfc4514_string()} is valid from "
                                  f"{cert.not_valid_before_utc:%Y-%m-%d} to {cert.not_valid_after_utc:%Y-%m-%d}, not "
                                  "today: ask the coordinator for the current ca.crt")
    first = certificates[0]
    return f"{path}: {first.subject.rfc4514_string()}, valid until {first.not_valid_after_utc:%Y-%m-%d}"


def read_policy(path: Path, data: Path | None, state_dir: Path | None) -> tuple[dict[str, Any], site_policy.SitePolicy]:
    """The site's node config from its policy file, ``--data`` (``None``: no ``data-path``) and ``--state-dir``, and
    the policy it sets (:meth:`~flwr_app.site_policy.SitePolicy.from_node_config`); :class:`SiteCheckFailed` naming
    the file and the key."""
    try:
        table = tomllib.loads(_read(path, "--policy").decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise SiteCheckFailed(f"--policy {path}: not a TOML file ({err}): write one key = value per line") from None
    for key, value in table.items():
        if key in OPTION_KEYS:
            raise SiteCheckFailed(f"--policy {path}: {key} is set by the command's {OPTION_KEYS[key]} option: remove "
                                  "it from the policy file")
        if key not in POLICY_KEYS:
            near = difflib.get_close_matches(key, POLICY_KEYS, n=1)
            raise SiteCheckFailed(f"--policy {path}: unknown key {key!r}"
                                  + (f" (did you mean {near[0]!r}?)" if near else "")
                                  + f": a site's policy takes {', '.join(POLICY_KEYS)}")
        if isinstance(value, list) and key in LIST_KEYS and all(isinstance(item, str) for item in value):
            table[key] = ",".join(value)
        elif not isinstance(value, str | int | float | bool):
            raise SiteCheckFailed(f"--policy {path}: {key} = {value!r} must be a string or a number"
                                  + (" (or a list of strings)" if key in LIST_KEYS else ""))
    missing = [key for key in ("site-name", "privacy-max-epsilon", *REQUIRED_ROLE_KEYS) if key not in table]
    if missing:
        raise SiteCheckFailed(f"--policy {path}: no {', '.join(missing)}: a partner site's policy names the site, its "
                              "lifetime budget and its time and event columns, e.g. site-name = \"hospital-a\", "
                              "privacy-max-epsilon = 1.0, data-time-col = \"time\", data-event-col = \"event\"")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(table["site-name"])):
        raise SiteCheckFailed(f"--policy {path}: site-name = {table['site-name']!r} must be letters, digits, '.', '_' "
                              "or '-' (it names the site's directory and its lines in the run's ledger)")
    for key in PATH_KEYS:
        if key in table:
            table[key] = str((path.parent / Path(str(table[key])).expanduser()).resolve())
    site_dir = (state_dir or _default_state_dir(str(table["site-name"]))).expanduser().resolve()
    config = {**table, **({} if data is None else {"data-path": str(data.expanduser().resolve())}),
              "site-dir": str(site_dir)}
    config.setdefault("privacy-ledger", str(site_dir / "ledger.jsonl"))
    try:
        policy = site_policy.SitePolicy.from_node_config(config)
        _test_share(config)
    except ValueError as err:
        raise SiteCheckFailed(f"--policy {path}: {str(err).replace('node config ', '')}") from None
    assert policy is not None  # privacy-max-epsilon and privacy-ledger are both set
    return config, policy


def _test_share(node_config: Mapping[str, Any]) -> float:
    """The site's ``max-test-share`` as the site reads it (:func:`flwr_app.deployment.max_test_share`)."""
    from flwr_app.deployment import max_test_share  # torch and Flower: imported when a command reads a policy

    return max_test_share(node_config)


def _default_state_dir(site: str) -> Path:
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "fedsurv" / site


def check_data(node_config: Mapping[str, Any], policy_path: Path) -> str:
    """The site's file read as the site reads it for a run (:func:`flwr_app.task.load_site_table`, under the policy's
    column roles), with at least :data:`~models.data.partition.MIN_SITE_RECORDS` records; errors name the policy's
    keys."""
    from flwr_app import task
    from flwr_app.config import resolve
    from models.data.partition import MIN_SITE_RECORDS
    from strategies.config import ConfigError

    roles = {run_key: node_config[node_key] for run_key, node_key in ROLE_KEYS.items() if node_key in node_config}
    path = str(node_config["data-path"])
    try:
        _, cfg = resolve({"data.name": "site_files", "evaluation.server_side": False, "baseline.centralized": False,
                          **roles})
        table = task.load_site_table(cfg, path, notes=False)
    except (ConfigError, ValueError, OSError) as err:
        text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
        named = [node_key for run_key, node_key in ROLE_KEYS.items() if run_key in text]
        for run_key, node_key in ROLE_KEYS.items():
            text = text.replace(run_key, f"{policy_path.name}'s {node_key}")
        if named:
            text += f": correct the file's header or {', '.join(named)} in {policy_path.name}"
        raise SiteCheckFailed(f"--data {text}" if path in text else f"--data {path}: {text}") from None
    if len(table) < MIN_SITE_RECORDS:
        raise SiteCheckFailed(f"--data {path}: {len(table)} records, fewer than the {MIN_SITE_RECORDS} a site needs to "
                              "train and be tested on: give the site's whole file")
    features = list(map(str, table.features.columns))
    return (f"{path}: {len(table)} records, {int(table.event.sum())} events; outcome {cfg.data.time_col} (time), "
            f"{cfg.data.event_col} (event); {len(features)} features: {', '.join(features)}")


def _ledger_head(node_config: Mapping[str, Any], ledger: Path) -> Path:
    """Where the site keeps its ledger's head (:func:`flwr_app.site_store.ledger_head`, without creating the
    directory: a dry run creates nothing)."""
    return Path(str(node_config["site-dir"])) / f"{ledger.name}.head"


def check_ledger(node_config: Mapping[str, Any], policy: site_policy.SitePolicy) -> str:
    """The ledger the site will charge: absent (a new budget), or verified against its head and created for this data
    file (what the site checks at every message); the filter's ε so far."""
    head = _ledger_head(node_config, policy.ledger)
    try:
        records = site_store.read_verified(policy.ledger, head).records
    except FileNotFoundError:
        return f"{policy.ledger}: new (nothing spent)"
    except ValueError as err:
        raise SiteCheckFailed(str(err)) from None
    header = records[0] if records else {}
    if policy.order is not None and header.get("order") not in (None, policy.order):
        raise SiteCheckFailed(f"privacy-ledger {policy.ledger}: created with Rényi order {header['order']:g}, fixed "
                              f"for its lifetime, but the policy sets privacy-rdp-order = {policy.order:g}: remove "
                              "privacy-rdp-order from the policy")
    data = Path(str(node_config["data-path"]))
    if header.get("data_sha256") not in (None, hashlib.sha256(data.read_bytes()).hexdigest()):
        raise SiteCheckFailed(f"privacy-ledger {policy.ledger}: holds the budget of another data file "
                              f"({header.get('data_path')}), not of --data {data}: name one ledger per data set")
    spent = next((float(line["epsilon"]) for line in reversed(records) if "epsilon" in line), 0.0)
    return f"{policy.ledger}: epsilon {spent:.4f} of {policy.max_epsilon:g} spent"


def check_site(args: argparse.Namespace) -> SitePlan:
    """Every check of ``start`` (:class:`SiteCheckFailed` listing each failure on its own line); the plan."""
    facts, failures = {}, []
    for name, check, value in (("superlink", check_address, args.superlink), ("key", check_key, args.key),
                               ("ca", check_ca, args.ca)):
        try:
            facts[name] = check(value)
        except SiteCheckFailed as err:
            failures.append(str(err))
    try:
        node_config, policy = read_policy(args.policy, args.data, args.state_dir)
        facts["data"] = check_data(node_config, args.policy)
        facts["ledger"] = check_ledger(node_config, policy)
    except SiteCheckFailed as err:
        failures.append(str(err))
    if failures:
        raise SiteCheckFailed("\n".join(failures))
    return SitePlan(args.superlink, args.ca.expanduser().resolve(), args.key.expanduser().resolve(), node_config,
                    policy, facts, args.runtime_port)


# ------------------------------------------------------------------ what the site will share


def _manifests(node_config: Mapping[str, Any], policy: site_policy.SitePolicy) -> list[tuple[str, Any]]:
    """The release manifest of each mechanism the site accepts, for a deployed run under its column roles at the
    policy's whole budget (what a manifest lists depends on the mechanism and the deployment, not on the budget)."""
    from flwr_app.config import resolve
    from strategies.mechanisms.registry import horizontal_mechanism

    roles = {run_key: node_config[node_key] for run_key, node_key in ROLE_KEYS.items() if node_key in node_config}
    out = []
    for name in policy.mechanisms:
        _, cfg = resolve({"data.name": "site_files", "evaluation.server_side": False, "baseline.centralized": False,
                          "strategy.name": name, "privacy.epsilon": policy.max_epsilon,
                          "privacy.delta": policy.delta, **roles})
        out.append((name, horizontal_mechanism(name).manifest(cfg)))
    return out


def _kept(release: Any) -> bool:
    """Whether a policy site keeps ``release``: the values that travel as an evaluation reply's metrics (a site with
    a privacy policy keeps its test metrics and replies with a mark only)."""
    return any(fnmatch.fnmatchcase(f"evaluate/metrics.{KEPT_PROBE}", pattern) for pattern in release.wire)


def releases_by_message(manifests: Sequence[tuple[str, Any]]) -> dict[str, list[str]]:
    """What leaves the site, by message, from the ``(mechanism, manifest)`` pairs of the mechanisms it accepts: each
    value, with ``*`` when the run's ε does not cover it and the mechanisms where not all send it; the values a policy
    site keeps (:func:`_kept`) are left out."""
    seen: dict[str, dict[str, tuple[bool, list[str]]]] = {}
    for name, manifest in manifests:
        for release in manifest.releases:
            if not _kept(release):
                seen.setdefault(release.message, {}).setdefault(release.value, (release.covered, []))[1].append(name)
    return {message: [f"{value}{'' if covered else '*'}" + ("" if len(names) == len(manifests) else
                                                          f" ({', '.join(names)})")
                      for value, (covered, names) in values.items()]
            for message, values in seen.items()}


def first_screen(plan: SitePlan) -> str:
    """What ``start`` prints before it connects: the site, its inputs, its policy and what each message releases."""
    policy, config = plan.policy, plan.node_config
    lines = [f"fedsurv site '{config['site-name']}': every check passed",
             f"  SuperLink  {plan.facts['superlink']} (TLS, verified with --ca)",
             f"  key        {plan.facts['key']} (the coordinator registers the .pub)",
             f"  CA         {plan.facts['ca']}",
             f"  data       {plan.facts['data']}",
             f"  policy     epsilon {policy.max_epsilon:g} at delta {policy.delta:g} for this data set's lifetime "
             f"(one record, add/remove); mechanisms {', '.join(policy.mechanisms)}; noise multiplier >= "
             f"{policy.min_noise:g}; distributed_dp counts on {policy.min_honest_sites} honest site(s), itself "
             f"included; test share <= {_test_share(config):g}",
             f"  ledger     {plan.facts['ledger']}",
             f"  state      {config['site-dir']} (the site's secret, ledger head, privacy states, site.log: back it "
             "up, keep it private)",
             "What leaves the site, by message (from the mechanisms' release manifests; * = not covered by epsilon):"]
    manifests = _manifests(config, policy)
    releases = releases_by_message(manifests)
    width = max(map(len, releases))
    order = ["set-up", "set-up, train", "train", "secure aggregation", "recalibration"]
    for message in sorted(releases, key=lambda name: order.index(name) if name in order else len(order)):
        lines.append(f"  {message:<{width}}  {', '.join(releases[message])}")
    kept = {release.value for _, manifest in manifests for release in manifest.releases if _kept(release)}
    lines.append(f"  {'kept':<{width}}  {', '.join(sorted(kept))}: at the site ({EVALUATION_FILE} in its state "
                 "directory); its reply carries a mark only")
    notes = {release.value: release.detail for _, manifest in manifests for release in manifest.uncovered}
    lines += [f"  * {value}: {detail}" for value, detail in notes.items()]
    lines.append("Refused before anything leaves: any other strategy, an exact set-up, a run above the budget, a "
                 "larger delta or lower noise than the policy's, column roles other than the policy's.")
    return "\n".join(lines)


# ------------------------------------------------------------------ the processes


def _node_config_value(key: str, value: Any) -> str:
    """``value`` as Flower's ``--node-config`` parses it (TOML: a quoted string, a number or a boolean)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if not any(mark in text for mark in '"\\\n'):
        return f'"{text}"'
    if not any(mark in text for mark in "'\n"):
        return f"'{text}'"
    raise SiteCheckFailed(f"{key} = {text!r}: a node-config value holds no line break, and no single quote together "
                          "with a double quote or a backslash: rename the file or folder")


def node_config_arg(node_config: Mapping[str, Any]) -> str:
    """The node config as ``flower-supernode --node-config`` takes it: space-separated ``key=value`` pairs."""
    return " ".join(f"{key}={_node_config_value(key, value)}" for key, value in node_config.items())


def _flower_command(name: str) -> str:
    """The environment's own ``name`` (beside this Python), else the one on ``PATH``."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else (shutil.which(name) or name)


def supernode_command(plan: SitePlan) -> list[str]:
    """``flower-supernode`` for the plan: TLS with the CA, authentication with the site's key, the node config, and
    ``--isolation process`` (the ClientApp executor is the command's own, :func:`executor_command`)."""
    return [_flower_command("flower-supernode"), "--superlink", plan.superlink, "--root-certificates", str(plan.ca),
            "--auth-supernode-private-key", str(plan.key), "--isolation", "process", "--host", "127.0.0.1",
            "--port", str(plan.runtime_port), "--node-config", node_config_arg(plan.node_config)]


def executor_command(runtime_address: str, parent_pid: int | str) -> list[str]:
    """The ClientApp executor, the warm :mod:`flwr_app.executor` (``flower-superexec``'s options: replacing it with
    ``flower-superexec`` is this one line), serving the SuperNode's tasks through its local runtime API (no TLS on
    127.0.0.1) and exiting with the SuperNode (``--parent-pid``)."""
    return [sys.executable, "-m", "flwr_app.executor", "--insecure", "--runtime-api-address", runtime_address,
            "--parent-pid", str(parent_pid)]


def _spawn(command: Sequence[str], group: int) -> subprocess.Popen:
    """``command`` with Flower's call-outs off, in process group ``group`` (0: a new one, led by it)."""
    return subprocess.Popen(list(command), env={**os.environ, **QUIET_FLOWER}, stdin=subprocess.DEVNULL,
                            process_group=group)


def _stop(group: int, processes: Sequence[subprocess.Popen]) -> None:
    """SIGTERM to the process group, :data:`STOP_WAIT_S` for ``processes`` to exit, then SIGKILL to what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)
    for process in processes:
        process.wait()


def _watch(supernode: subprocess.Popen, runtime: str, requested: list[int],
           processes: list[subprocess.Popen]) -> int | None:
    """Keep an executor beside ``supernode`` (each one started is appended to ``processes``) until the SuperNode
    exits or a stop is ``requested``; ``None`` then, or 1 when the executor exited more than :data:`MAX_RESTARTS`
    times in :data:`RESTART_WINDOW_S`."""
    restarts: list[float] = []
    processes.append(_spawn(executor_command(runtime, supernode.pid), supernode.pid))
    while not requested and supernode.poll() is None:
        time.sleep(0.2)
        executor = processes[-1]
        if executor.poll() is None or supernode.poll() is not None:
            continue
        now = time.monotonic()
        restarts = [start for start in restarts if now - start < RESTART_WINDOW_S]
        if len(restarts) >= MAX_RESTARTS:
            print(f"fedsurv-site: the ClientApp executor exited {MAX_RESTARTS + 1} times in {RESTART_WINDOW_S:g} s "
                  f"(last status {executor.returncode}): stopping the site; its output above says why",
                  file=sys.stderr, flush=True)
            return 1
        restarts.append(now)
        print(f"fedsurv-site: the ClientApp executor exited (status {executor.returncode}); restarting it",
              file=sys.stderr, flush=True)
        processes.append(_spawn(executor_command(runtime, supernode.pid), supernode.pid))
    return None


def supervise(plan: SitePlan) -> int:
    """Run the SuperNode and its executor in one new process group until the SuperNode exits or SIGINT/SIGTERM
    arrives, then stop both (:func:`_stop`); an executor that dies is restarted (:func:`_watch`). Returns the
    SuperNode's exit status (0 after a requested stop; 1 when the executor kept dying)."""
    requested: list[int] = []
    handlers = {sig: signal.signal(sig, lambda signum, _: requested.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    processes: list[subprocess.Popen] = []
    try:
        processes.append(_spawn(supernode_command(plan), 0))
        status = _watch(processes[0], f"127.0.0.1:{plan.runtime_port}", requested, processes)
    finally:
        if processes:
            _stop(processes[0].pid, processes)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    supernode = processes[0]
    if status is None:
        status = 0 if requested else supernode.returncode
        print(f"fedsurv-site: {'stopped on request' if requested else 'flower-supernode exited'} (status "
              f"{supernode.returncode})", file=sys.stderr, flush=True)
    return status


# ------------------------------------------------------------------ status


def ledger_runs(records: Sequence[Mapping[str, Any]]) -> list[str]:
    """One row per run of the site's ledger: releases, refusals, the RDP it charged, the filter's ε after its last
    line, and when it last wrote."""
    runs: dict[Any, dict[str, Any]] = {}
    for line in records:
        if line.get("kind") in ("release", "refusal"):
            row = runs.setdefault(line["run"], {"release": 0, "refusal": 0, "rdp": 0.0})
            row[line["kind"]] += 1
            row["rdp"] += float(line.get("rdp", 0.0))
            row["epsilon"], row["time"] = line["epsilon"], line["time"]
    rows = ["run | releases | refusals | RDP charged | epsilon after | last line",
            "--- | --- | --- | --- | --- | ---"]
    rows += [f"{run} | {row['release']} | {row['refusal']} | {row['rdp']:.4g} | {row['epsilon']:.4f} | {row['time']}"
             for run, row in runs.items()]
    return rows


def _jsonl_last(path: Path) -> dict[str, Any] | None:
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def _log_last(path: Path) -> tuple[str, str] | None:
    """The last error in the site's log (:data:`flwr_app.site_errors.LOG_FILE`): its time and what it says."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return None
    found = None
    for match in re.finditer(r"^(\S+) site '.*?' run (\d+) message (\S+): (\S+?):", text, re.MULTILINE):
        told = re.search(r"^the server was told: (.*)$", text[match.end():], re.MULTILINE)
        found = (match[1], f"run {match[2]} {match[3]}: failed ({match[4]}); the server was told: "
                           f"{told[1] if told else '?'} [{path}]")
    return found


def last_message(site_dir: Path, records: Sequence[Mapping[str, Any]]) -> str:
    """The latest message the site recorded: one it handled (:data:`~flwr_app.site_errors.MESSAGES_FILE`), a charged
    release or refusal (its ledger), test metrics kept (:data:`EVALUATION_FILE`) or an error (its log)."""
    found = []
    if (handled := _jsonl_last(site_dir / MESSAGES_FILE)) is not None:
        found.append((handled["time"], f"run {handled['run']} round {handled['round']} {handled['type']}: "
                                       f"{handled['outcome']} [{site_dir / MESSAGES_FILE}]"))
    lines = [line for line in records if line.get("kind") in ("release", "refusal")]
    if lines:
        line = lines[-1]
        what = f"released {line['values']}" if line["kind"] == "release" else f"refused: {line['reason']}"
        found.append((line["time"], f"run {line['run']} round {line['round']} {line['message']}: {what} [ledger]"))
    if (kept := _jsonl_last(site_dir / EVALUATION_FILE)) is not None:
        found.append((kept["time"], f"run {kept['run']} round {kept['round']} evaluate: test metrics kept at the site "
                                    f"({kept.get('test_records')} test records) [{site_dir / EVALUATION_FILE}]"))
    if (error := _log_last(site_dir / LOG_FILE)) is not None:
        found.append(error)
    return " ".join(max(found)) if found else "none recorded yet"


def status(policy_path: Path, state_dir: Path | None) -> int:
    """Print the site's ledger per run against its budget, and the last message it recorded; 2 when the ledger does
    not verify (one line)."""
    node_config, policy = read_policy(policy_path, None, state_dir)
    site_dir = Path(str(node_config["site-dir"]))
    head = _ledger_head(node_config, policy.ledger)
    try:
        records = site_store.read_verified(policy.ledger, head).records
    except FileNotFoundError:
        records = []
    except ValueError as err:
        print(f"fedsurv-site: {err}", file=sys.stderr)
        return 2
    spent = next((float(line["epsilon"]) for line in reversed(records) if "epsilon" in line), 0.0)
    order = f", Rényi filter of order {records[0]['order']:g}" if records else ""
    verified = ", verified against its head" if records else ": none yet"
    print(f"site '{node_config['site-name']}': epsilon {spent:.4f} of {policy.max_epsilon:g} spent at delta "
          f"{policy.delta:g}{order} (ledger {policy.ledger}{verified})")
    if records:
        print("\n".join(ledger_runs(records)))
    print(f"last message recorded: {last_message(site_dir, records)}")
    print("(the site records charged releases, refusals, kept test metrics and errors; a message that releases "
          "nothing it charges, such as its name or a secure-aggregation key stage, is in the SuperNode's log only)")
    return 0


# ------------------------------------------------------------------ the command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedsurv-site", description="Run a partner site of a fedsurv federation "
                                     "(docs/deployment.md).")
    commands = parser.add_subparsers(dest="command", required=True)
    start = commands.add_parser("start", help="check the site's files, print what it shares, run its SuperNode")
    start.add_argument("--superlink", required=True, help="the SuperLink's Fleet address, HOST:PORT")
    start.add_argument("--ca", required=True, type=Path, help="the federation's CA certificate (ca.crt)")
    start.add_argument("--key", required=True, type=Path, help="the site's SuperNode private key "
                                                               "(deploy/make_supernode_keys.sh)")
    start.add_argument("--data", required=True, type=Path, help="the site's data file (CSV or Parquet)")
    start.add_argument("--policy", required=True, type=Path, help="the site's policy file (TOML)")
    start.add_argument("--state-dir", type=Path, help="the site's own directory (default "
                                                      "$XDG_STATE_HOME/fedsurv/<site-name>)")
    start.add_argument("--runtime-port", type=int, default=9094, help="the SuperNode's local runtime API port on "
                                                                      "127.0.0.1 (one per SuperNode on a machine)")
    start.add_argument("--dry-run", action="store_true", help="check and print, start nothing")
    show = commands.add_parser("status", help="the site's ledger and the last message it recorded")
    show.add_argument("--policy", required=True, type=Path)
    show.add_argument("--state-dir", type=Path)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``fedsurv-site start|status``: see the module's docstring. Exit status 2 when a check fails (one line each)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "status":
            return status(args.policy, args.state_dir)
        plan = check_site(args)
        screen, command = first_screen(plan), supernode_command(plan)
    except SiteCheckFailed as err:
        for line in str(err).splitlines():
            print(f"fedsurv-site: {line}", file=sys.stderr)
        return 2
    print(screen)
    executor = executor_command(f"127.0.0.1:{plan.runtime_port}", "<SuperNode pid>")
    print(f"{'Would run' if args.dry_run else 'Running'} (FLWR_TELEMETRY_ENABLED=0):\n  {shlex.join(command)}\n  "
          f"{shlex.join(executor)}", flush=True)
    return 0 if args.dry_run else supervise(plan)


if __name__ == "__main__":
    raise SystemExit(main())
