//! How the packed wire dtypes lay out their values: int8 in blocks with an f32 scale each,
//! and sparse (index, value) entries. [`crate::WireTensor`] encodes and decodes through
//! these, and the update codecs ([`crate::UpdateCodec`]) choose between them.

/// Values per int8 block; each block carries its own f32 scale.
pub const INT8_BLOCK: usize = 64;

/// Bytes of one sparse entry: a u32 index and an f32 value, little endian.
pub(crate) const SPARSE_ENTRY: usize = 8;

/// Per-block absmax int8: for each block, the scale `absmax / 127` then one byte per value.
pub(crate) fn int8_encode(values: &[f32], out: &mut Vec<u8>) {
    for block in values.chunks(INT8_BLOCK) {
        let absmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let scale = if block.iter().all(|v| v.is_finite()) { absmax / 127.0 } else { f32::NAN };
        out.extend_from_slice(&scale.to_le_bytes());
        out.extend(block.iter().map(|v| {
            if scale > 0.0 {
                (v / scale).round().clamp(-127.0, 127.0) as i8 as u8
            } else {
                0
            }
        }));
    }
}

/// The inverse of [`int8_encode`] for `n` values (a block whose scale is not finite decodes
/// to NaN, which update validation refuses).
pub(crate) fn int8_decode(data: &[u8], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    for block in data.chunks(4 + INT8_BLOCK) {
        let Some((scale, codes)) = block.split_first_chunk::<4>() else { break };
        let scale = f32::from_le_bytes(*scale);
        out.extend(codes.iter().map(|&q| if scale.is_finite() { f32::from(q as i8) * scale } else { f32::NAN }));
    }
    out.truncate(n);
    out
}

/// (index, value) entries into a dense vector of `n` zeros; out-of-range indices (refused
/// by validation) are skipped rather than trusted.
pub(crate) fn sparse_decode(data: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    for (index, value) in sparse_entries(data) {
        if let Some(slot) = out.get_mut(index as usize) {
            *slot = value;
        }
    }
    out
}

pub(crate) fn sparse_entries(data: &[u8]) -> impl Iterator<Item = (u32, f32)> + '_ {
    data.chunks_exact(SPARSE_ENTRY).map(|e| {
        let (index, value) = e.split_at(4);
        (u32::from_le_bytes(index.try_into().unwrap()), f32::from_le_bytes(value.try_into().unwrap()))
    })
}

/// Checks that sparse indices rise strictly and stay below `n`.
pub(crate) fn check_sparse_indices(data: &[u8], n: u64) -> Result<(), String> {
    let mut previous: Option<u32> = None;
    for (k, (index, _)) in sparse_entries(data).enumerate() {
        if u64::from(index) >= n {
            return Err(format!("entry {k} has index {index}, past the tensor's {n} values"));
        }
        if previous.is_some_and(|p| index <= p) {
            return Err(format!("entry {k} has index {index}, not above the previous entry's"));
        }
        previous = Some(index);
    }
    Ok(())
}
