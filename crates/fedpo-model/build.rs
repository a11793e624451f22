//! With the `cuda` feature, compiles the fused ops' CUDA kernels (`kernels/*.cu`) to PTX,
//! the way candle compiles its own: nvcc on PATH (or `NVCC`), for `CUDA_COMPUTE_CAP`.
//! `src/ops/cuda.rs` loads them at run time. Without the feature it does nothing.

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    #[cfg(feature = "cuda")]
    cuda_kernels();
}

#[cfg(feature = "cuda")]
fn cuda_kernels() {
    println!("cargo::rerun-if-changed=kernels");
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let ptx = cudaforge::KernelBuilder::new()
        .source_dir("kernels")
        .arg("-O3")
        .arg("-std=c++17")
        .build_ptx()
        .unwrap_or_else(|e| panic!("compiling fedpo-model's CUDA kernels (kernels/*.cu): {e}"));
    ptx.write(out_dir.join("ptx.rs")).unwrap_or_else(|e| panic!("writing the kernels' PTX index: {e}"));
}
