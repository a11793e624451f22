//! The `fedpo-device` binary's commands, one file each, and what they share (`setup`:
//! model, data and device arguments; `config_file`: `run --config`). Everything a device
//! does beyond its command line lives in the library (`fedpo_device`), which the
//! aggregator's simulation embeds as well.

pub(crate) mod assemble;
pub(crate) mod bench;
pub(crate) mod bench_generate;
pub(crate) mod config_file;
pub(crate) mod export;
pub(crate) mod generate;
pub(crate) mod run;
pub(crate) mod score;
pub(crate) mod train_local;
