#!/bin/sh
# Makes the certificates of a flotilla broker with the openssl CLI: a private CA, the broker's
# server certificate and client certificates (for mutual TLS), all ECDSA P-256, in DIR.
#
#   make-certs.sh DIR ca                        DIR/ca.crt, DIR/ca.key (keep ca.key offline)
#   make-certs.sh DIR server NAME SAN...        DIR/NAME.crt, DIR/NAME.key for the broker;
#                                               SAN like DNS:mqtt.example.com or IP:10.0.0.5
#   make-certs.sh DIR client NAME               DIR/NAME.crt, DIR/NAME.key; the common name is
#                                               NAME: the device id, or the user name
#
# Certificates are valid for DAYS days (default 825). The tests run this same script.
set -eu

usage() {
  echo "usage: $0 DIR ca | DIR server NAME SAN... | DIR client NAME" >&2
  exit 2
}
[ $# -ge 2 ] || usage
dir=$1
kind=$2
shift 2
days=${DAYS:-825}
mkdir -p "$dir"
cd "$dir"
umask 077

newkey() {
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null
}

sign() { # name extensions-file
  openssl req -new -key "$1.key" -subj "/CN=$1" -out "$1.csr"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial \
    -days "$days" -sha256 -extfile "$2" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$2"
  chmod 644 "$1.crt"
}

case "$kind" in
  ca)
    [ $# -eq 0 ] || usage
    newkey ca.key
    openssl req -x509 -new -key ca.key -sha256 -days "$days" -subj "/CN=flotilla broker CA" \
      -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
      -out ca.crt
    chmod 644 ca.crt
    ;;
  server)
    [ $# -ge 2 ] || usage
    name=$1
    shift
    san=$(echo "$@" | tr ' ' ',')
    newkey "$name.key"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=%s\n' \
      "$san" > "$name.ext"
    sign "$name" "$name.ext"
    ;;
  client)
    [ $# -eq 1 ] || usage
    name=$1
    newkey "$name.key"
    printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n' \
      > "$name.ext"
    sign "$name" "$name.ext"
    ;;
  *) usage ;;
esac
