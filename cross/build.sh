#!/usr/bin/env bash
# Build fedpo-device for an edge board, or test it there under emulation.
#
#   cross/build.sh [TARGET] [--glibc X.Y] [--features LIST] [--profile NAME] [--test]
#
# TARGET defaults to aarch64-unknown-linux-gnu (Raspberry Pi 4/5 with a 64-bit OS, Jetson).
# The build takes the first of these paths that applies:
#
#   --glibc X.Y    cargo zigbuild --target TARGET.X.Y: links against glibc X.Y's symbols, so
#                  the binary runs on older board images (2.31: Pi OS bullseye, Ubuntu 20.04,
#                  JetPack 5). Needs `pip install ziglang` and `cargo install cargo-zigbuild`.
#   cross          when `cross` is installed and a container engine answers: cross build
#                  with cross/Cross.toml (a pinned image).
#   cargo          otherwise: rustup's target plus Debian's cross linker
#                  (`apt-get install gcc-aarch64-linux-gnu`).
#
# --test builds the device-side crates' unit tests instead and runs them under
# qemu-aarch64 (`apt-get install qemu-user libc6-dev-arm64-cross`); this is what CI runs.
#
# A build ends by printing the binary's path, its size and the newest glibc symbol version
# it needs: the board's `ldd --version` must be at least that.
set -euo pipefail
cd "$(dirname "$0")/.."

target=aarch64-unknown-linux-gnu
glibc=""
features=""
profile=release
test_mode=false
while [ $# -gt 0 ]; do
    case "$1" in
        --glibc) glibc="${2:?--glibc needs a version such as 2.31}"; shift 2 ;;
        --features) features="${2:?--features needs a list}"; shift 2 ;;
        --profile) profile="${2:?--profile needs a name}"; shift 2 ;;
        --test) test_mode=true; shift ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        -*) echo "cross/build.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) target="$1"; shift ;;
    esac
done

case "$target" in
    aarch64-unknown-linux-gnu) gcc_prefix=aarch64-linux-gnu; qemu=qemu-aarch64 ;;
    x86_64-unknown-linux-gnu) gcc_prefix=""; qemu="" ;;
    *) echo "cross/build.sh: unsupported target $target (aarch64-unknown-linux-gnu, x86_64-unknown-linux-gnu)" >&2
       exit 2 ;;
esac
case "$features" in
    *cuda*)
        echo "cross/build.sh: the cuda feature is built on the Jetson itself, with JetPack's CUDA:" \
             "cross/jetson-build.sh (docs/gpu.md). That binary needs the NVIDIA driver's libcuda.so.1" \
             "to start at all; other boards run this script's CPU build." >&2
        exit 2 ;;
    *metal*|*accelerate*)
        echo "cross/build.sh: the $features feature cannot be cross-compiled: build it on the board" \
             "(docs/edge-devices.md, \"Building for a board\")" >&2
        exit 2 ;;
esac
feature_args=()
[ -n "$features" ] && feature_args=(--features "$features")

have() { command -v "$1" >/dev/null 2>&1; }
need() {
    have "$1" || { echo "cross/build.sh: $1 not found; $2" >&2; exit 1; }
}
target_env=$(echo "$target" | tr 'a-z-' 'A-Z_')

ensure_rust_target() {
    if ! rustup target list --installed | grep -qx "$target"; then
        rustup target add "$target"
    fi
}

use_debian_linker() {
    if [ -n "$gcc_prefix" ]; then
        need "$gcc_prefix-gcc" "install it with: apt-get install gcc-$gcc_prefix"
        export "CARGO_TARGET_${target_env}_LINKER=$gcc_prefix-gcc"
        export "CC_${target//-/_}=$gcc_prefix-gcc"
    fi
}

if $test_mode; then
    ensure_rust_target
    use_debian_linker
    if [ -n "$qemu" ]; then
        need "$qemu" "install it with: apt-get install qemu-user libc6-dev-arm64-cross"
        export "CARGO_TARGET_${target_env}_RUNNER=$qemu -L /usr/$gcc_prefix"
        # qemu's default CPU has FP16 arithmetic: the f16 kernel tests fail rather than
        # skip if the probe does not find it.
        [ "$target" = aarch64-unknown-linux-gnu ] && export FEDPO_EXPECT_FP16=1
    fi
    # The device-side crates. Their unit tests are functional checks on tiny shapes; matmul
    # under emulation is hundreds of times slower, so the numerics-heavy integration tests
    # stay on the host.
    exec cargo test --target "$target" "${feature_args[@]}" --lib --bins \
        -p fedpo-wire -p fedpo-data -p fedpo-process -p fedpo-model -p fedpo-train -p fedpo-device
fi

started=$(date +%s)
out_dir="target/$target/$profile"
[ "$profile" = dev ] && out_dir="target/$target/debug"
if [ -n "$glibc" ]; then
    need cargo-zigbuild "install it with: pip install ziglang && cargo install cargo-zigbuild"
    ensure_rust_target
    cargo zigbuild --profile "$profile" --target "$target.$glibc" -p fedpo-device "${feature_args[@]}"
elif have cross && { docker info >/dev/null 2>&1 || podman info >/dev/null 2>&1; }; then
    CROSS_CONFIG=cross/Cross.toml cross build --profile "$profile" --target "$target" -p fedpo-device \
        "${feature_args[@]}"
else
    ensure_rust_target
    use_debian_linker
    cargo build --profile "$profile" --target "$target" -p fedpo-device "${feature_args[@]}"
fi

binary="$out_dir/fedpo-device"
size=$(stat -c %s "$binary")
newest_glibc=$(readelf --dyn-syms --wide "$binary" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
echo "built $binary in $(( $(date +%s) - started )) s"
echo "  size:  $size bytes ($(( size / 1024 / 1024 )) MiB)"
echo "  needs: ${newest_glibc:-no versioned glibc symbols} (the board's \`ldd --version\` must be at least this)"
