//! fedpo's wire protocol: versioned CBOR messages between devices and the aggregator,
//! named tensor payloads (f32, bf16, f16 and the compressed int8 and top-k
//! encodings), and chunked transfers verified by their BLAKE3 digest.
//!
//! Everything decoded here is untrusted: [`Message::decode`] and
//! [`TensorPayload::from_bytes`] (or `from_shared`, which decodes in place) check sizes against [`Limits`] before they allocate, refuse
//! unknown protocol versions, shapes that disagree with their bytes and (for updates)
//! non-finite values, each with an error naming what was wrong.

mod bundle;
mod bundle_bytes;
mod chunk;
mod chunk_store;
mod chunked_encoder;
pub mod device_tag;
mod digest;
mod downlink;
mod error;
mod in_place_decode;
mod kept;
pub mod keys;
mod limits;
mod message;
mod packed;
mod secagg_messages;
pub mod signing;
mod update_codec;
mod wire_tensor;

pub use bundle::{Bundle, BundleProgress};
pub use bundle_bytes::BundleBytes;
pub use bytes::Bytes;
pub use chunk::{split_payload, Reassembler, ReassemblyProgress};
pub use chunked_encoder::EncodedPayload;
pub use digest::{digest, DIGEST_BYTES};
pub use downlink::{apply_delta, DOWNLINK_SECTION};
pub use error::{Result, WireError};
pub use kept::{KeptBundle, KeptTransfer};
pub use limits::{Limits, DEFAULT_CHUNK_BYTES, MAX_ROUND};
pub use message::{
    check_sections, DeltaStep, DeviceBye, DeviceHello, Downlink, Hyperparameters, Manifest, Message, RoundDeclined,
    RoundPlan, RoundResult, TensorInfo, TransferChunk, Update, UpdateMetrics, MAX_SECTIONS, PROTOCOL_VERSION,
};
pub use packed::INT8_BLOCK;
pub use secagg_messages::{SecAggMessage, SecAggPlan};
pub use signing::{SignatureError, Signed, Signer, TrustedKey};
pub use update_codec::{Residual, UpdateCodec};
pub use wire_tensor::{byte_bounds, TensorPayload, ToWire, WireDType, WireTensor, MASKED_TENSOR};
