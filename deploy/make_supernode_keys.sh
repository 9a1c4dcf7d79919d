#!/usr/bin/env bash
# Create a SuperNode authentication key pair per site (ECDSA on NIST P-384, OpenSSH format).
#
# Usage: deploy/make_supernode_keys.sh OUT_DIR SITE [SITE ...]
#
# Writes OUT_DIR/SITE (private key: stays at the site, flower-supernode --auth-supernode-private-key)
# and OUT_DIR/SITE.pub (public key: sent to the coordinating site, `flwr supernode register`).
# Each site should run this itself so that its private key never leaves it.
# Existing keys are never overwritten: the script stops instead.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 OUT_DIR SITE [SITE ...]" >&2
    exit 2
fi
out_dir=$1
shift
mkdir -p "$out_dir"
chmod 700 "$out_dir"
for site in "$@"; do
    if [[ -e "$out_dir/$site" || -e "$out_dir/$site.pub" ]]; then
        echo "$0: a key for site '$site' exists in $out_dir; refusing to overwrite it" >&2
        exit 1
    fi
    ssh-keygen -q -t ecdsa -b 384 -N "" -C "$site" -f "$out_dir/$site"
    echo "site $site: private key $out_dir/$site, public key $out_dir/$site.pub"
done
