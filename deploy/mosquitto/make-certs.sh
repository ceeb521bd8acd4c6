#!/bin/sh
# Makes the certificates of a flotilla broker with the openssl CLI: a private CA in a directory
# of its own, and the broker's server certificate and client certificates (for mutual TLS)
# signed from there, all ECDSA P-256.
#
#   make-certs.sh CA_DIR ca                     CA_DIR/ca.crt, CA_DIR/ca.key: CA_DIR is the
#                                               CA's alone; keep it (and ca.key) offline
#   make-certs.sh [--out DIR] CA_DIR server NAME SAN...
#                                               DIR/NAME.crt, DIR/NAME.key for the broker, and
#                                               DIR/ca.crt; SAN like DNS:mqtt.example.com or
#                                               IP:10.0.0.5
#   make-certs.sh [--out DIR] CA_DIR client NAME
#                                               DIR/NAME.crt, DIR/NAME.key, DIR/ca.crt; the
#                                               common name is NAME: the device id, or the
#                                               user name
#
# DIR is what goes to the broker or the device: it never holds the CA's key. Without --out the
# certificate and key are written into CA_DIR (what the tests do, with a throwaway CA).
# Certificates are valid for DAYS days (default 825). The tests run this same script.
set -eu

usage() {
  echo "usage: $0 CA_DIR ca | [--out DIR] CA_DIR server NAME SAN... | [--out DIR] CA_DIR client NAME" >&2
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
[ -n "$out" ] || out=$ca_dir
mkdir -p "$out"
out=$(cd "$out" && pwd)

newkey() {
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

sign() { # name extensions-file
  [ -f "$ca_dir/ca.key" ] || { echo "$0: no CA in $ca_dir (make it with: $0 $ca_dir ca)" >&2; exit 1; }
  openssl req -new -key "$out/$1.key" -subj "/CN=$1" -out "$out/$1.csr"
  openssl x509 -req -in "$out/$1.csr" -CA "$ca_dir/ca.crt" -CAkey "$ca_dir/ca.key" \
    -CAserial "$ca_dir/ca.srl" -CAcreateserial \
    -days "$days" -sha256 -extfile "$2" -out "$out/$1.crt" 2>/dev/null
  rm -f "$out/$1.csr" "$2"
  chmod 644 "$out/$1.crt"
  if [ "$out" != "$ca_dir" ]; then
    cp "$ca_dir/ca.crt" "$out/ca.crt"
    chmod 644 "$out/ca.crt"
  fi
}

case "$kind" in
  ca)
    [ $# -eq 0 ] && [ "$out" = "$ca_dir" ] || usage
    newkey "$ca_dir/ca.key"
    openssl req -x509 -new -key "$ca_dir/ca.key" -sha256 -days "$days" -subj "/CN=flotilla broker CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out "$ca_dir/ca.crt"
    chmod 644 "$ca_dir/ca.crt"
    ;;
  server)
    [ $# -ge 2 ] || usage
    name=$1
    shift
    san=$(echo "$@" | tr ' ' ',')
    newkey "$out/$name.key"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' \
      "$san" > "$out/$name.ext"
    sign "$name" "$out/$name.ext"
    ;;
  client)
    [ $# -eq 1 ] || usage
    name=$1
    newkey "$out/$name.key"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n' \
      > "$out/$name.ext"
    sign "$name" "$out/$name.ext"
    ;;
  *) usage ;;
esac
