#!/usr/bin/env bash
# Create a certificate authority and the SuperLink's TLS certificate (run once, at the coordinating site).
#
# Usage: deploy/make_certificates.sh OUT_DIR SUPERLINK_HOST [MORE_HOSTS ...]
#
# Writes into OUT_DIR (created, mode 700):
#   ca.key, ca.crt          the CA (keep ca.key offline; give ca.crt to every site and to whoever runs `flwr`)
#   server.key, server.crt  the SuperLink's key and certificate (flower-superlink --ssl-keyfile/--ssl-certfile)
# The certificate names every host given as a subjectAltName (IP addresses as IP:, names as DNS:);
# include 127.0.0.1 or localhost if processes on the SuperLink's own machine connect to it that way.
# Existing files are never overwritten: the script stops instead.
set -euo pipefail

if [[ $# -lt 2 ]]; then
    echo "usage: $0 OUT_DIR SUPERLINK_HOST [MORE_HOSTS ...]" >&2
    exit 2
fi
out_dir=$1
shift
for name in ca.key ca.crt server.key server.crt; do
    if [[ -e "$out_dir/$name" ]]; then
        echo "$0: $out_dir/$name exists; refusing to overwrite it" >&2
        exit 1
    fi
done
mkdir -p "$out_dir"
chmod 700 "$out_dir"

san=""
for host in "$@"; do
    if [[ $host =~ ^[0-9.]+$ || $host == *:* ]]; then
        san+="${san:+,}IP:$host"
    else
        san+="${san:+,}DNS:$host"
    fi
done

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha384 -days 365 -nodes \
    -keyout "$out_dir/ca.key" -out "$out_dir/ca.crt" -subj "/CN=fedsurv federation CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-384 -sha384 -nodes \
    -keyout "$out_dir/server.key" -out "$out_dir/server.csr" -subj "/CN=$1" 2>/dev/null
openssl x509 -req -in "$out_dir/server.csr" -CA "$out_dir/ca.crt" -CAkey "$out_dir/ca.key" -CAcreateserial \
    -out "$out_dir/server.crt" -days 365 -sha384 \
    -extfile <(printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' "$san") \
    2>/dev/null
rm -f "$out_dir/server.csr" "$out_dir/ca.srl"
chmod 600 "$out_dir/ca.key" "$out_dir/server.key"
echo "CA certificate:       $out_dir/ca.crt"
echo "SuperLink certificate: $out_dir/server.crt (subjectAltName $san)"
