#!/usr/bin/env bash
# Compiles fedpo's `cuda` feature, tests included, on a machine with no GPU: what CI runs.
#
# The toolchain comes from PyPI (toolchain.sh) and the build goes to a target directory
# outside the checkout, /var/cache/fedpo/cuda-target unless FEDPO_CUDA_TARGET says
# otherwise, so that a machine that ran it before reuses candle's compiled kernels. nvcc
# compiles fedpo's own kernels (crates/*/kernels/*.cu) too, and a rustc warning in fedpo's
# code fails it, since nothing else compiles these cfg(cuda) paths.
# Arguments go to `cargo check`.
set -euo pipefail
cd "$(dirname "$0")/../.."
. scripts/cuda/toolchain.sh
export CARGO_TARGET_DIR=${FEDPO_CUDA_TARGET:-/var/cache/fedpo/cuda-target}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo check -p fedpo-model -p fedpo-train -p fedpo-device \
    --features fedpo-model/cuda,fedpo-train/cuda,fedpo-device/cuda --tests "$@" 2>&1 | tee "$log"
# rustc's warnings end in cargo's "generated N warnings" line; the build scripts' notes
# ("Compiling 1 of 1 PTX kernels") are warnings too, by cargo's only channel, and pass.
if grep -qE '^warning: .* generated [0-9]+ warnings?' "$log"; then
    echo "scripts/cuda/check.sh: the cuda build has warnings (above)" >&2
    exit 1
fi
