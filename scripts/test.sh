#!/usr/bin/env bash
# The test command: installs what fedpo's tests need when it is missing, then runs every
# test of the workspace. Arguments go to `cargo test` (e.g. `scripts/test.sh -p fedpo-wire`).
#
# Needed beyond Rust: Mosquitto (fleet scenarios start their own on loopback; the
# package's own service is not used) and openssl (the mutual-TLS scenario makes its
# certificates). Both come from Debian's packages, with sudo when not root.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || missing+=(mosquitto)
command -v openssl >/dev/null || missing+=(openssl)
if [ ${#missing[@]} -gt 0 ]; then
    if ! command -v apt-get >/dev/null; then
        echo "scripts/test.sh: the tests need ${missing[*]}; install them with your package manager" >&2
        exit 1
    fi
    as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
    echo "== installing ${missing[*]} (Debian packages)"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

echo "== cargo test --workspace $*"
cargo test --workspace "$@"
