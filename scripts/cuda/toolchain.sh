# Source this: `. scripts/cuda/toolchain.sh [--link]`.
#
# A CUDA 13.0 toolchain for building fedpo's `cuda` feature on a machine with no GPU and
# no CUDA install, from PyPI wheels only. It sets PATH (nvcc), CUDA_ROOT, CUDA_COMPUTE_CAP
# (90, an H100, unless set) and NVCC (the shim that leaves out candle's unused MoE
# kernels, see nvcc-without-moe).
#
# Why 13.0: candle 0.11's cudarc needs CUDA >= 12, the cu12 nvcc wheel carries no nvcc
# binary, and a newer nvcc emits PTX that a 580 driver (CUDA 13.0) refuses to load.
#
# Without options it installs the compiler only, which is all `cargo check` needs. With
# --link it adds cuBLAS, cuRAND and NVRTC and a stub libcuda.so so that `cargo build`
# links: candle forces cudarc's dynamic linking, so the binary names libcuda.so.1 and the
# real one comes with the NVIDIA driver on the machine that runs it.
#
# Everything goes under FEDPO_CUDA_HOME (default /var/cache/fedpo/cuda), and a second
# run with the same wheels downloads nothing.

_fedpo_cuda_setup() {
    local link=0
    [ "${1:-}" = --link ] && link=1
    local home=${FEDPO_CUDA_HOME:-/var/cache/fedpo/cuda}
    local here
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    local compiler=(nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88
        nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85)
    local linking=(nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 nvidia-cuda-nvrtc==13.0.88)
    local wanted=("${compiler[@]}")
    [ $link = 1 ] && wanted+=("${linking[@]}")

    mkdir -p "$home" || return 1
    if [ ! -x "$home/venv/bin/pip" ]; then
        python3 -m venv "$home/venv" || {
            echo "toolchain.sh: python3 -m venv failed (Debian: apt-get install python3-venv)" >&2
            return 1
        }
    fi
    # pip skips what is installed at the pinned version; --no-deps keeps the wheels to
    # exactly the list above (their declared dependencies pull the whole CUDA stack).
    "$home/venv/bin/pip" install -q --disable-pip-version-check --no-deps "${wanted[@]}" || return 1

    local cu
    cu=$(echo "$home"/venv/lib/python3*/site-packages/nvidia/cu13)
    [ -x "$cu/bin/nvcc" ] || { echo "toolchain.sh: no nvcc under $cu/bin" >&2; return 1; }
    local root=$home/root
    mkdir -p "$root/lib/stubs"
    ln -sfn "$cu/bin" "$root/bin"
    ln -sfn "$cu/include" "$root/include"
    ln -sfn "$cu/nvvm" "$root/nvvm"

    if [ $link = 1 ]; then
        local l
        for l in cudart.so.13 cublas.so.13 cublasLt.so.13 curand.so.10 nvrtc.so.13; do
            [ -e "$cu/lib/lib$l" ] && ln -sf "$cu/lib/lib$l" "$root/lib/lib${l%%.so*}.so"
        done
        # The driver has no wheel. The stub defines every entry point cudarc's driver
        # bindings name, so the link resolves; it is never loaded at run time (its soname
        # is libcuda.so.1, which the driver provides).
        if [ ! -e "$root/lib/stubs/libcuda.so" ]; then
            local cudarc
            cudarc=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | head -1)
            [ -n "$cudarc" ] || { echo "toolchain.sh: cudarc's source is not fetched yet (cargo fetch)" >&2; return 1; }
            grep -ohE '^\s*pub (unsafe )?fn cu[A-Za-z0-9_]+' "$cudarc"/src/driver/sys/*.rs \
                | grep -oE 'cu[A-Za-z0-9_]+$' | sort -u \
                | awk '{ print "int " $1 "(void) { return 999; }" }' > "$root/libcuda_stub.c"
            cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$root/lib/stubs/libcuda.so" "$root/libcuda_stub.c" || return 1
        fi
    fi

    export PATH="$root/bin:$PATH"
    export CUDA_ROOT=$root
    export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
    export NVCC=$here/nvcc-without-moe
    export CUDAFORGE_THREADS=${CUDAFORGE_THREADS:-$(nproc)}
    echo "CUDA toolchain: $(nvcc --version | grep -o 'release [0-9.]*'), CUDA_ROOT=$CUDA_ROOT, CUDA_COMPUTE_CAP=$CUDA_COMPUTE_CAP"
}
_fedpo_cuda_setup "$@"
