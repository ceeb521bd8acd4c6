#!/bin/sh
# Makes the certificates of a flotilla NATS cluster with the openssl CLI: a private CA in a
# directory of its own, and each node's certificate signed from there, ECDSA P-256. A node's
# certificate serves MQTT clients and the other nodes, and proves the node to the other nodes
# when it dials their routes (mutual TLS), so it is good for both server and client use.
#
#   make-certs.sh CA_DIR ca                       CA_DIR/ca.crt, CA_DIR/ca.key: keep CA_DIR
#                                                 (and ca.key) offline
#   make-certs.sh --out DIR CA_DIR node SAN...    DIR/node.crt, DIR/node.key and DIR/ca.crt,
#                                                 what goes to /etc/nats-flotilla/tls/ on one
#                                                 node; SAN like DNS:nats-1.example.net
#                                                 (the name in the routes and the clients'
#                                                 broker lists) or IP:10.0.0.5
#
# Clients check the node against ca.crt (the agent's and the coordinator's [broker.tls]
# ca_file). Certificates are valid for DAYS days (default 825). The tests run this script.
set -eu

usage() {
  echo "usage: $0 CA_DIR ca | --out DIR CA_DIR node SAN..." >&2
  exit 2
}
out=
if [ "${1:-}" = --out ]; then
  [ $# -ge 2 ] || usage
  out=$2
  shift 2
fi
[ $# -ge 2 ] || usage
ca_dir=$1
kind=$2
shift 2
days=${DAYS:-825}
umask 077
mkdir -p "$ca_dir"
ca_dir=$(cd "$ca_dir" && pwd)

newkey() {
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

case "$kind" in
  ca)
    [ $# -eq 0 ] && [ -z "$out" ] || usage
    newkey "$ca_dir/ca.key"
    openssl req -x509 -new -key "$ca_dir/ca.key" -sha256 -days "$days" \
      -subj "/CN=flotilla NATS cluster CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out "$ca_dir/ca.crt"
    chmod 644 "$ca_dir/ca.crt"
    ;;
  node)
    [ $# -ge 1 ] && [ -n "$out" ] || usage
    [ -f "$ca_dir/ca.key" ] || { echo "$0: no CA in $ca_dir (make it with: $0 $ca_dir ca)" >&2; exit 1; }
    mkdir -p "$out"
    out=$(cd "$out" && pwd)
    [ "$out" != "$ca_dir" ] || { echo "$0: --out must not be the CA's directory" >&2; exit 1; }
    san=$(echo "$@" | tr ' ' ',')
    newkey "$out/node.key"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=%s\n' \
      "$san" > "$out/node.ext"
    openssl req -new -key "$out/node.key" -subj "/CN=${1#*:}" -out "$out/node.csr"
    openssl x509 -req -in "$out/node.csr" -CA "$ca_dir/ca.crt" -CAkey "$ca_dir/ca.key" \
      -CAserial "$ca_dir/ca.srl" -CAcreateserial \
      -days "$days" -sha256 -extfile "$out/node.ext" -out "$out/node.crt" 2>/dev/null
    rm -f "$out/node.csr" "$out/node.ext"
    chmod 644 "$out/node.crt"
    cp "$ca_dir/ca.crt" "$out/ca.crt"
    chmod 644 "$out/ca.crt"
    ;;
  *) usage ;;
esac
