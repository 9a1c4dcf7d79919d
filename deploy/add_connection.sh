#!/usr/bin/env bash
# Add a TLS connection to a deployed SuperLink to the Flower CLI's configuration.
#
# Usage: deploy/add_connection.sh NAME SUPERLINK_ADDRESS CA_CERT
#
# Appends a [superlink.NAME] table (address, root-certificates) to $FLWR_HOME/config.toml
# (default FLWR_HOME: ~/.flwr), so that `flwr run . NAME`, `flwr ls NAME` and
# `flwr supernode register KEY.pub NAME` reach the SuperLink's Control API over TLS.
# SUPERLINK_ADDRESS is host:port, the host being one named in the SuperLink's certificate.
set -euo pipefail

if [[ $# -ne 3 ]]; then
    echo "usage: $0 NAME SUPERLINK_ADDRESS CA_CERT" >&2
    exit 2
fi
name=$1
address=$2
ca_cert=$(realpath "$3")
if [[ ! -f "$ca_cert" ]]; then
    echo "$0: CA certificate $ca_cert not found" >&2
    exit 1
fi
flwr_home=${FLWR_HOME:-$HOME/.flwr}
config=$flwr_home/config.toml
mkdir -p "$flwr_home"
if [[ -f "$config" ]] && grep -q "^\[superlink\.$name\]" "$config"; then
    echo "$0: $config already has a connection '$name'; edit or remove it first" >&2
    exit 1
fi
if [[ ! -f "$config" ]]; then
    printf '[superlink]\ndefault = "%s"\n' "$name" > "$config"
fi
printf '\n[superlink.%s]\naddress = "%s"\nroot-certificates = "%s"\n' "$name" "$address" "$ca_cert" >> "$config"
echo "connection '$name' -> $address (CA $ca_cert) added to $config"
