#!/usr/bin/env bash
# Builds fedpo-device with CUDA on a Jetson, on the board itself, with JetPack's CUDA.
#
#   cross/jetson-build.sh [--compute-cap NN] [-- extra cargo args]
#
# Why on the board: candle compiles its kernels with nvcc for the board's GPU, the PyPI
# CUDA wheels are x86-64 and sbsa only, and PTX from a newer CUDA than the board's driver
# does not load (CUDA 13 PTX on JetPack 6's CUDA 12 driver, for one). JetPack's own nvcc
# matches its driver by construction.
#
# Needs: JetPack 6 (CUDA 12.2-12.6, /usr/local/cuda), a Rust toolchain (rustup), and about
# 3 GB free. The compute capability is read from the device tree (Orin 87, Xavier 72);
# Jetson has no nvidia-smi for candle's build to ask. candle's quantised MoE kernels,
# which fedpo does not use, are left out (scripts/cuda/nvcc-without-moe).
#
# The binary links libcuda.so.1, which JetPack installs; it does not start where that
# library is missing (candle links CUDA at build time), so boards without JetPack run the
# CPU build from cross/build.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."

cap=""
while [ $# -gt 0 ]; do
    case "$1" in
        --compute-cap) cap="${2:?--compute-cap needs a number such as 87}"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "cross/jetson-build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done

[ "$(uname -m)" = aarch64 ] || { echo "cross/jetson-build.sh: run this on the Jetson (this is $(uname -m))" >&2; exit 1; }
cuda=${CUDA_HOME:-/usr/local/cuda}
[ -x "$cuda/bin/nvcc" ] || { echo "cross/jetson-build.sh: no nvcc at $cuda/bin/nvcc; install JetPack's CUDA (apt-get install nvidia-jetpack) or set CUDA_HOME" >&2; exit 1; }
if [ -z "$cap" ]; then
    compatible=$(tr '\0' ' ' < /proc/device-tree/compatible 2>/dev/null || true)
    case "$compatible" in
        *tegra234*) cap=87 ;;   # Orin
        *tegra194*) cap=72 ;;   # Xavier
        *) echo "cross/jetson-build.sh: unknown board ($compatible); pass --compute-cap" >&2; exit 1 ;;
    esac
fi

export PATH="$cuda/bin:$PATH" CUDA_ROOT=$cuda CUDA_COMPUTE_CAP=$cap
export NVCC=$PWD/scripts/cuda/nvcc-without-moe
echo "nvcc $(nvcc --version | grep -o 'release [0-9.]*'), compute capability $cap"
cargo build --release -p fedpo-device --features cuda "$@"
binary=target/release/fedpo-device
ls -l "$binary"
ldd "$binary" | grep -E 'cuda|cublas|curand|not found' || true
