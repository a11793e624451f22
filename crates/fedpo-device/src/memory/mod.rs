//! Memory on small devices: what training will take ([`footprint`]) and what generating
//! will ([`generation_estimate`]), fitting training into a budget ([`planner`]), and what
//! the GPU's driver reports ([`gpu_memory`]). What the process actually used is
//! [`fedpo_process::usage`]'s.

pub mod footprint;
mod generation;
mod gpu;
pub mod planner;

pub use footprint::{Estimate, ParamCounts, StepKernels, Workload, SAFETY_MARGIN, TOKENIZER_MIB};
pub use generation::{generation_estimate, GenerationEstimate};
pub use gpu::{
    gpu_memory, gpu_peak_mib, reset_gpu_peak, training_budget, Budget, BudgetSource, GpuMemory, GPU_RESERVE_MIB,
};
pub use planner::{longest, plan, MemoryPlan, PlanError, PlanRequest, StartOnDisk};
