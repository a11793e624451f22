#!/usr/bin/env bash
# Makes a CA and the certificates of a fedpo fleet for mutual TLS, with openssl.
#
#   security/make-certs.sh OUT_DIR [DEVICE_ID ...]
#
# OUT_DIR gets ca.pem/ca.key, broker.pem/broker.key (for the broker: localhost,
# 127.0.0.1 and $BROKER_HOST if set), aggregator.pem/.key, one ID.pem/ID.key per
# device, and the aggregator's plan-signing key: signing.key (Ed25519, for
# `fedpo-aggregator --signing-key`) and signing.pub (its public key in hex, for
# `fedpo-device run --trust-key`). A client certificate's common name is its MQTT identity: with
# `use_identity_as_username true` Mosquitto's ACL sees it as the user name, so a device can
# publish only under its own topics (security/acl). Keys are ECDSA P-256; leaf
# certificates carry a subjectAltName and the extended key usage rustls checks.
# Existing files are kept, so the script can add devices to a fleet later.
set -euo pipefail
out="${1:?usage: security/make-certs.sh OUT_DIR [DEVICE_ID ...]}"
shift
mkdir -p "$out"
cd "$out"
days=825

key() { [ -f "$1.key" ] || openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; chmod 600 "$1.key"; }

if [ ! -f ca.pem ]; then
    key ca
    openssl req -x509 -new -key ca.key -out ca.pem -days 3650 -subj "/CN=fedpo fleet CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

# leaf NAME EKU SAN
leaf() {
    local name="$1" eku="$2" san="$3"
    [ -f "$name.pem" ] && return
    key "$name"
    openssl req -new -key "$name.key" -subj "/CN=$name" -out "$name.csr" 2>/dev/null
    printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
        "$eku" "$san" > "$name.ext"
    openssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days "$days" \
        -extfile "$name.ext" -out "$name.pem" 2>/dev/null
    rm -f "$name.csr" "$name.ext"
}

broker_san="DNS:localhost,IP:127.0.0.1"
[ -n "${BROKER_HOST:-}" ] && broker_san="$broker_san,DNS:$BROKER_HOST"
leaf broker serverAuth "$broker_san"
leaf aggregator clientAuth "DNS:aggregator"
if [ ! -f signing.key ]; then
    openssl genpkey -algorithm ed25519 -out signing.key 2>/dev/null
    chmod 600 signing.key
fi
# The raw 32-byte public key is the last 32 bytes of its DER SubjectPublicKeyInfo.
openssl pkey -in signing.key -pubout -outform DER 2>/dev/null | tail -c 32 | od -An -v -tx1 | tr -d ' \n' > signing.pub
echo >> signing.pub

for id in "$@"; do
    case "$id" in
        aggregator|broker|ca|*/*|*+*|*#*|"") echo "make-certs.sh: $id cannot be a device id" >&2; exit 2 ;;
    esac
    leaf "$id" clientAuth "DNS:$id"
done
echo "in $(pwd): ca.pem, broker.pem, aggregator.pem${*:+, }$(printf '%s.pem ' "$@"); signing.key, signing.pub"
