//! DPO training for fedpo: the loss family, response log-probs, reference caching,
//! optimizers with persistent state, and the local trainer every device runs.

pub mod algorithms;
#[cfg(feature = "cuda")]
mod cuda;
mod error;
pub mod logps;
pub mod loss;
pub mod loss_on_device;
pub mod optim;
mod optimizer_ops;
pub mod reference;
mod trainer;

pub use algorithms::LocalTerms;
pub use error::{Result, TrainError};
pub use loss::LossKind;
pub use optim::{OptimConfig, OptimKind, Optimizer};
pub use reference::{check_cache, load_or_score_pairs, score_pairs, SequenceLogps};
pub use trainer::{evaluate, DpoSettings, EvalMetrics, LocalTrainer, PreferenceSet, StepMetrics};
