//! New activation-sized buffers, filled by every core.
//!
//! `vec![0.0; n]` zero-fills on the calling thread, and so does `slice.to_vec()` copy:
//! each of the fused block's outputs and gradients started that way, and those fills and
//! copies were a visible share of a DistilGPT-2 step, with the other core waiting. Here
//! a parallel task initialises its own chunk and writes it at once, while its cache lines
//! are still hot, so the fill costs a fraction of a pass and both cores share it.

use std::mem::MaybeUninit;

use candle_core::WithDType;
use rayon::prelude::*;

/// A new vector of `n` values: `fill(offset, chunk)` writes each chunk of about `chunk`
/// elements (the last may be shorter), in parallel. A chunk reaches `fill` zeroed, so
/// whatever `fill` leaves alone reads as zero.
pub(super) fn par_filled<T: WithDType>(n: usize, chunk: usize, fill: impl Fn(usize, &mut [T]) + Sync) -> Vec<T> {
    let chunk = chunk.max(1);
    let mut out: Vec<T> = Vec::with_capacity(n);
    out.spare_capacity_mut()[..n].par_chunks_mut(chunk).enumerate().for_each(|(i, part)| {
        part.fill(MaybeUninit::new(T::zero()));
        // SAFETY: every element of `part` was initialised on the line above, and
        // `MaybeUninit<T>` has `T`'s layout.
        let part = unsafe { &mut *(std::ptr::from_mut(part) as *mut [T]) };
        fill(i * chunk, part);
    });
    // SAFETY: the loop above initialised all `n` elements (it returns only when every task
    // has; a panic in `fill` propagates before this line and the vector drops empty).
    unsafe { out.set_len(n) };
    out
}

/// Elements per task of [`par_zeroed`] and [`par_copy`]: 256 KiB of f32.
const COPY_CHUNK: usize = 64 * 1024;

/// `vec![T::zero(); n]`, zeroed by every core.
pub(super) fn par_zeroed<T: WithDType>(n: usize) -> Vec<T> {
    par_filled(n, COPY_CHUNK, |_, _| {})
}

/// `src.to_vec()`, copied by every core.
pub(super) fn par_copy<T: WithDType>(src: &[T]) -> Vec<T> {
    par_filled(src.len(), COPY_CHUNK, |offset, part| part.copy_from_slice(&src[offset..offset + part.len()]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn par_filled_hands_each_chunk_its_offset_and_covers_every_element_once() {
        // 10 elements in chunks of 4: offsets 0, 4, 8 and a short last chunk of 2.
        let out: Vec<f32> = par_filled(10, 4, |offset, part| {
            for (i, v) in part.iter_mut().enumerate() {
                *v += (offset + i) as f32 + 1.0;
            }
        });
        assert_eq!(out, (1..=10).map(|v| v as f32).collect::<Vec<_>>());
    }

    #[test]
    fn par_copy_and_par_zeroed_match_their_serial_forms_across_many_chunks() {
        let src: Vec<f64> = (0..3 * COPY_CHUNK + 17).map(|i| (i as f64).sin()).collect();
        assert_eq!(par_copy(&src), src);
        assert!(par_zeroed::<f32>(2 * COPY_CHUNK + 5).iter().all(|&v| v == 0.0));
        assert!(par_copy::<f32>(&[]).is_empty());
    }
}
