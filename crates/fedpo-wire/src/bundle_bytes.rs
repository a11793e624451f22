//! What a completed bundle hands over: its transfers' verified bytes.

use std::collections::BTreeMap;

use bytes::Bytes;

/// The verified bytes of a completed bundle, as shared buffers that
/// [`crate::TensorPayload::from_shared`] decodes in place.
#[derive(Debug, Clone, PartialEq)]
pub struct BundleBytes {
    /// The main transfer (the global model, the delta).
    pub main: Bytes,
    /// Each section's bytes, by section name.
    pub sections: BTreeMap<String, Bytes>,
}
