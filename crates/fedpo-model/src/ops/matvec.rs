//! Products of a few rows with a weight matrix, for decoding one token at a time.
//!
//! A generated token's forward pass multiplies one row by every weight matrix: the work is
//! reading the weights, once, and the speed is the memory bandwidth of every core. gemm is
//! built for many rows; given one, it reads a transposed head in strides and splits little
//! of the work across threads. These kernels stream each matrix in its stored layout,
//! split into column blocks (a Conv1D's `[in, out]` weight) or row blocks (the tied
//! head's `[vocab, d]` table) across the rayon pool, with the inner loops compiled for the
//! CPU's widest vectors ([`multiversion`](super::multiversion)).

use candle_core::{DType, Storage, Tensor};
use rayon::prelude::*;

use super::multiversion::multiversion;

type CResult<T> = candle_core::Result<T>;

/// The most rows these kernels take; more go to gemm, which reuses each weight it reads.
pub const MATVEC_MAX_ROWS: usize = 4;

/// Rows of a Conv1D weight one task reads.
const WEIGHT_ROW_BLOCK: usize = 64;
/// Rows of the head one task computes.
const ROW_BLOCK: usize = 512;

/// A weight's values as stored: f32, or bf16 read into f32 as they are used (half the
/// bytes to stream, and decoding is bound by them).
#[derive(Clone, Copy)]
enum Values<'a> {
    F32(&'a [f32]),
    Bf16(&'a [half::bf16]),
}

/// Runs `f` on the values of contiguous CPU tensors in f32 or bf16, or returns `None` for
/// anything else.
fn with_values<R>(tensors: &[&Tensor], f: impl FnOnce(&[Values<'_>]) -> CResult<R>) -> CResult<Option<R>> {
    if tensors.iter().any(|t| !t.device().is_cpu() || !matches!(t.dtype(), DType::F32 | DType::BF16)) {
        return Ok(None);
    }
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let mut values = Vec::with_capacity(guards.len());
    for (storage, layout) in &guards {
        let (Storage::Cpu(cpu), Some((start, end))) = (&**storage, layout.contiguous_offsets()) else {
            return Ok(None);
        };
        values.push(match cpu {
            candle_core::CpuStorage::F32(v) => Values::F32(&v[start..end]),
            candle_core::CpuStorage::BF16(v) => Values::Bf16(&v[start..end]),
            _ => return Ok(None),
        });
    }
    f(&values).map(Some)
}

multiversion! {
    /// `y[r, :] += sum_i x[r, i] * w[i, :]` over the `count` weight rows from `first`, for
    /// `x: [rows, in]`.
    fn weight_rows / weight_rows_at(x: &[f32], rows: usize, w: &[f32], out: usize, span: (usize, usize), y: &mut [f32]) {
        let (fan_in, (first, count)) = (x.len() / rows, span);
        for r in 0..rows {
            let yr = &mut y[r * out..(r + 1) * out];
            for i in first..first + count {
                let xi = x[r * fan_in + i];
                for (y, &w) in yr.iter_mut().zip(&w[i * out..(i + 1) * out]) {
                    *y += xi * w;
                }
            }
        }
    }
}

multiversion! {
    /// [`weight_rows`] over bf16 weights.
    fn weight_rows_bf16 / weight_rows_bf16_at(x: &[f32], rows: usize, w: &[half::bf16], out: usize, span: (usize, usize), y: &mut [f32]) {
        let (fan_in, (first, count)) = (x.len() / rows, span);
        for r in 0..rows {
            let yr = &mut y[r * out..(r + 1) * out];
            for i in first..first + count {
                let xi = x[r * fan_in + i];
                for (y, &w) in yr.iter_mut().zip(&w[i * out..(i + 1) * out]) {
                    *y += xi * f32::from_bits(u32::from(w.to_bits()) << 16);
                }
            }
        }
    }
}

multiversion! {
    /// `logits[r, first + j] = h[r, :] · table[first + j, :]` for the rows of one block.
    fn table_rows / table_rows_at(h: &[f32], rows: usize, table: &[f32], d: usize, first: usize, out: &mut [f32]) {
        let block = out.len() / rows;
        for r in 0..rows {
            let hr = &h[r * d..(r + 1) * d];
            for j in 0..block {
                let tv = &table[(first + j) * d..(first + j + 1) * d];
                let mut lanes = [0f32; 16];
                for (t, h) in tv.chunks_exact(16).zip(hr.chunks_exact(16)) {
                    for l in 0..16 {
                        lanes[l] += t[l] * h[l];
                    }
                }
                let tail: f32 = tv.chunks_exact(16).remainder().iter().zip(hr.chunks_exact(16).remainder()).map(|(t, h)| t * h).sum();
                out[r * block + j] = lanes.iter().sum::<f32>() + tail;
            }
        }
    }
}

multiversion! {
    /// [`table_rows`] over a bf16 table.
    fn table_rows_bf16 / table_rows_bf16_at(h: &[f32], rows: usize, table: &[half::bf16], d: usize, first: usize, out: &mut [f32]) {
        let block = out.len() / rows;
        let widen = |t: half::bf16| f32::from_bits(u32::from(t.to_bits()) << 16);
        for r in 0..rows {
            let hr = &h[r * d..(r + 1) * d];
            for j in 0..block {
                let tv = &table[(first + j) * d..(first + j + 1) * d];
                let mut lanes = [0f32; 16];
                for (t, h) in tv.chunks_exact(16).zip(hr.chunks_exact(16)) {
                    for l in 0..16 {
                        lanes[l] += widen(t[l]) * h[l];
                    }
                }
                let tail: f32 = tv.chunks_exact(16).remainder().iter().zip(hr.chunks_exact(16).remainder()).map(|(&t, h)| widen(t) * h).sum();
                out[r * block + j] = lanes.iter().sum::<f32>() + tail;
            }
        }
    }
}

/// `x @ w + bias` for `x: [rows, in]` in f32 with at most [`MATVEC_MAX_ROWS`] rows and
/// `w: [in, out]` in f32 or bf16, contiguous on the CPU; `None` for anything else (the
/// caller uses gemm).
pub fn rows_times_weight(x: &Tensor, w: &Tensor, bias: &Tensor) -> CResult<Option<Tensor>> {
    let (rows, fan_in) = x.dims2()?;
    let (w_in, out) = w.dims2()?;
    if rows == 0 || rows > MATVEC_MAX_ROWS || w_in != fan_in || bias.dims1()? != out || x.dtype() != DType::F32 {
        return Ok(None);
    }
    let bias = bias.to_dtype(DType::F32)?;
    let y = with_values(&[x, w, &bias], |v| {
        let (Values::F32(xs), Values::F32(bs)) = (v[0], v[2]) else { unreachable!("x and the bias are f32") };
        // Each task streams whole weight rows, contiguous in memory, into a partial sum.
        let firsts: Vec<usize> = (0..fan_in).step_by(WEIGHT_ROW_BLOCK).collect();
        let partial = firsts
            .par_iter()
            .fold(
                || vec![0f32; rows * out],
                |mut y, &first| {
                    let count = WEIGHT_ROW_BLOCK.min(fan_in - first);
                    match v[1] {
                        Values::F32(ws) => weight_rows(xs, rows, ws, out, (first, count), &mut y),
                        Values::Bf16(ws) => weight_rows_bf16(xs, rows, ws, out, (first, count), &mut y),
                    }
                    y
                },
            )
            .reduce_with(|mut a, b| {
                a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                a
            });
        let mut y = partial.unwrap_or_else(|| vec![0f32; rows * out]);
        for r in 0..rows {
            y[r * out..(r + 1) * out].iter_mut().zip(bs).for_each(|(y, b)| *y += b);
        }
        Ok(y)
    })?;
    y.map(|y| Tensor::from_vec(y, (rows, out), x.device())).transpose()
}

/// `h @ table^T` for `h: [rows, d]` in f32 with at most [`MATVEC_MAX_ROWS`] rows and
/// `table: [vocab, d]` (the tied head) in f32 or bf16, contiguous on the CPU; `None` for
/// anything else.
pub fn rows_times_table(h: &Tensor, table: &Tensor) -> CResult<Option<Tensor>> {
    let (rows, d) = h.dims2()?;
    let (vocab, table_d) = table.dims2()?;
    if rows == 0 || rows > MATVEC_MAX_ROWS || table_d != d || h.dtype() != DType::F32 {
        return Ok(None);
    }
    let logits = with_values(&[h, table], |v| {
        let Values::F32(hs) = v[0] else { unreachable!("h is f32") };
        let firsts: Vec<usize> = (0..vocab).step_by(ROW_BLOCK).collect();
        let parts: Vec<Vec<f32>> = firsts
            .par_iter()
            .map(|&first| {
                let mut out = vec![0f32; rows * ROW_BLOCK.min(vocab - first)];
                match v[1] {
                    Values::F32(ts) => table_rows(hs, rows, ts, d, first, &mut out),
                    Values::Bf16(ts) => table_rows_bf16(hs, rows, ts, d, first, &mut out),
                }
                out
            })
            .collect();
        let mut logits = vec![0f32; rows * vocab];
        for (&first, part) in firsts.iter().zip(&parts) {
            let block = part.len() / rows;
            for r in 0..rows {
                logits[r * vocab + first..r * vocab + first + block].copy_from_slice(&part[r * block..(r + 1) * block]);
            }
        }
        Ok(logits)
    })?;
    logits.map(|l| Tensor::from_vec(l, (rows, vocab), h.device())).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
    }

    #[test]
    fn one_to_four_rows_match_the_matmul_for_weights_and_the_tied_table() {
        let dev = Device::Cpu;
        for rows in 1..=MATVEC_MAX_ROWS {
            // Widths that leave partial blocks and a partial 16-lane tail.
            let x = Tensor::randn(0f32, 1.0, (rows, 70), &dev).unwrap();
            let w = Tensor::randn(0f32, 1.0, (70, 600), &dev).unwrap();
            let b = Tensor::randn(0f32, 1.0, 600, &dev).unwrap();
            let fast = rows_times_weight(&x, &w, &b).unwrap().expect("f32 on the CPU");
            let slow = x.matmul(&w).unwrap().broadcast_add(&b).unwrap();
            assert!(max_diff(&fast, &slow) < 1e-4, "rows {rows}: {}", max_diff(&fast, &slow));
            let table = Tensor::randn(0f32, 1.0, (1_100, 70), &dev).unwrap();
            let fast = rows_times_table(&x, &table).unwrap().expect("f32 on the CPU");
            let slow = x.matmul(&table.t().unwrap()).unwrap();
            assert!(max_diff(&fast, &slow) < 1e-4, "rows {rows}: {}", max_diff(&fast, &slow));
        }
        // bf16 weights, read as stored: the same as the f32 product of the rounded weights.
        let x = Tensor::randn(0f32, 1.0, (2, 70), &dev).unwrap();
        let w16 = Tensor::randn(0f32, 1.0, (70, 600), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let b16 = Tensor::randn(0f32, 1.0, 600, &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let fast = rows_times_weight(&x, &w16, &b16).unwrap().expect("bf16 weights on the CPU");
        let (w32, b32) = (w16.to_dtype(DType::F32).unwrap(), b16.to_dtype(DType::F32).unwrap());
        let slow = x.matmul(&w32).unwrap().broadcast_add(&b32).unwrap();
        assert!(max_diff(&fast, &slow) < 1e-4, "bf16 weight: {}", max_diff(&fast, &slow));
        let t16 = Tensor::randn(0f32, 1.0, (1_100, 70), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let fast = rows_times_table(&x, &t16).unwrap().expect("bf16 table on the CPU");
        let slow = x.matmul(&t16.to_dtype(DType::F32).unwrap().t().unwrap()).unwrap();
        assert!(max_diff(&fast, &slow) < 1e-4, "bf16 table: {}", max_diff(&fast, &slow));
        // Not for these kernels: too many rows, another dtype, a strided view.
        let x = Tensor::randn(0f32, 1.0, (5, 8), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (8, 8), &dev).unwrap();
        let b = Tensor::zeros(8, DType::F32, &dev).unwrap();
        assert!(rows_times_weight(&x, &w, &b).unwrap().is_none());
        let x1 = x.narrow(0, 0, 1).unwrap();
        assert!(rows_times_weight(
            &x1.to_dtype(DType::F64).unwrap(),
            &w.to_dtype(DType::F64).unwrap(),
            &b.to_dtype(DType::F64).unwrap()
        )
        .unwrap()
        .is_none());
        assert!(rows_times_weight(&x1, &w.t().unwrap(), &b).unwrap().is_none());
    }
}
