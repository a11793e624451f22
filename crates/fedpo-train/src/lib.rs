//! DPO training for fedpo: the loss family, response log-probs, reference caching,
//! optimizers with persistent state, and the local trainer every device runs.

#[cfg(feature = "cuda")]
mod cuda;
mod error;
mod inplace;
pub mod logps;
pub mod loss;
pub mod loss_on_device;
pub mod optim;
pub mod reference;
pub mod terms;
mod trainer;

pub use error::{Result, TrainError};
pub use loss::LossKind;
pub use optim::{OptimConfig, OptimKind, Optimizer};
pub use reference::{check_cache, load_or_score_pairs, score_pairs, SequenceLogps};
pub use terms::LocalTerms;
pub use trainer::{evaluate, DpoSettings, EvalMetrics, LocalTrainer, PreferenceSet, StepMetrics};
