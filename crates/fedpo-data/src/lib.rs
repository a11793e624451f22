//! Preference data for fedpo: pairs, file formats, the synthetic persona generator,
//! partitioning over devices and token batches. No tensors here; the trainer turns
//! [`PairBatch`]es into tensors.

mod batch;
mod error;
pub mod formats;
mod pair;
pub mod partition;
pub mod synthetic;

pub use batch::{collate, fingerprint, tokenize_pairs, PairBatch, TokenizedPair};
pub use error::{DataError, Result};
pub use formats::{load_jsonl, load_jsonl_keyed, to_jsonl, DataFormat, LoadedPairs};
pub use pair::PreferencePair;
pub use synthetic::{
    generate_device, generate_drawn_device, generate_pairs, DeviceData, DrawnDeviceData, DrawnPersona, Persona,
    Personas, SyntheticSpec,
};
