//! The preference loss as tensor ops, evaluated where the log-probabilities are.
//!
//! On the CPU the trainer reads a micro-batch's 2P log-probs and evaluates
//! [`preference_loss`](crate::loss::preference_loss) in f64. On a GPU that read is a
//! host round trip per micro-batch, a synchronisation that stalls the queue of kernels.
//! Here the same loss, its derivative with respect to each log-prob and the reward
//! metrics are computed on the device in the log-probs' dtype, and the step's totals stay
//! there until the step ends ([`StepTotals`]), when one small read carries them to the host.

use candle_core::{DType, Device, Tensor};

use crate::error::Result;
use crate::loss::LossKind;

/// A micro-batch's loss on the device: scalar tensors and the surrogate's coefficients.
pub struct DeviceLoss {
    /// `[3]`: the summed loss, the pairs whose chosen reward wins, the summed margin.
    pub totals: Tensor,
    /// `[2P]`: `d(loss_sum)/d(logp)` for each log-prob, chosen rows first.
    pub grad: Tensor,
}

/// `log(sigmoid(x))`, stable for both signs: `min(x, 0) - log(1 + e^{-|x|})`.
fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let negative_part = x.minimum(0.0)?;
    let tail = ((x.abs()?.neg()?.exp()? + 1.0)?).log()?;
    Ok((negative_part - tail)?)
}

/// The loss of one micro-batch. `logps` and `reference` are `[2P]` (chosen rows first);
/// `lens` holds the 2P response lengths, used by IPO's averaging.
pub fn preference_loss_on_device(
    kind: LossKind,
    beta: f64,
    logps: &Tensor,
    reference: &Tensor,
    lens: &[usize],
) -> Result<DeviceLoss> {
    let rows = logps.dim(0)?;
    let p = rows / 2;
    let half = |t: &Tensor, at: usize| t.narrow(0, at, p);
    let (pc, pr) = (half(logps, 0)?, half(logps, p)?);
    let (rc, rr) = (half(reference, 0)?, half(reference, p)?);
    // h = (chosen - rejected) of policy minus that of the reference; beta * h is the
    // margin of implicit rewards, and the chosen reward wins where h > 0.
    let h = ((&pc - &rc)? - (&pr - &rr)?)?;
    let margin = (&h * beta)?;
    let correct = h.gt(0.0)?.to_dtype(logps.dtype())?;
    let (loss, dc, dr) = match kind {
        LossKind::Sigmoid { label_smoothing: eps } => {
            let z = &margin;
            let (ls_pos, ls_neg) = (log_sigmoid(z)?, log_sigmoid(&z.neg()?)?);
            let loss = ((&ls_pos * -(1.0 - eps))? - (&ls_neg * eps)?)?;
            // d/dz = -(1-e) s(-z) + e s(z), with s = exp(log_sigmoid)
            let dz = ((ls_neg.exp()? * -(1.0 - eps))? + (ls_pos.exp()? * eps)?)?;
            let dc = (&dz * beta)?;
            let dr = dc.neg()?;
            (loss, dc, dr)
        }
        LossKind::Ipo => {
            let lens: Vec<f32> = lens.iter().map(|&l| l.max(1) as f32).collect();
            let lens = Tensor::from_vec(lens, rows, logps.device())?.to_dtype(logps.dtype())?;
            let (lc, lr) = (half(&lens, 0)?, half(&lens, p)?);
            let hi = (((&pc - &rc)? / &lc)? - ((&pr - &rr)? / &lr)?)?;
            let d = (hi - 1.0 / (2.0 * beta))?;
            let loss = d.sqr()?;
            let dc = ((&d * 2.0)? / &lc)?;
            let dr = ((&d * -2.0)? / &lr)?;
            (loss, dc, dr)
        }
    };
    let totals = Tensor::stack(&[loss.sum_all()?, correct.sum_all()?, margin.sum_all()?], 0)?;
    Ok(DeviceLoss { totals, grad: Tensor::cat(&[dc, dr], 0)? })
}

/// A step's loss totals, summed on the device across micro-batches and read once.
#[derive(Default)]
pub struct StepTotals {
    sums: Option<Tensor>,
    pairs: usize,
}

impl StepTotals {
    /// Adds a micro-batch's `[3]` totals over `pairs` pairs.
    pub fn add(&mut self, totals: &Tensor, pairs: usize) -> Result<()> {
        let totals = totals.to_dtype(widened(totals.dtype()))?;
        self.sums = Some(match self.sums.take() {
            Some(sums) => (sums + totals)?,
            None => totals,
        });
        self.pairs += pairs;
        Ok(())
    }

    /// The `[3]` sums (zeros if nothing was added), to be read with whatever else the
    /// step reads.
    pub fn sums(&self, device: &Device) -> Result<Tensor> {
        Ok(match &self.sums {
            Some(sums) => sums.clone(),
            None => Tensor::zeros(3, DType::F32, device)?,
        })
    }

    /// Pairs added.
    pub fn pairs(&self) -> usize {
        self.pairs
    }
}

/// The global L2 norm of `grads` as a scalar tensor on their device, with no host read.
/// Summed in f32 for half-precision gradients, in f64 if any gradient is f64.
pub fn global_norm_on_device<'a>(grads: impl IntoIterator<Item = &'a Tensor>) -> Result<Option<Tensor>> {
    let grads: Vec<&Tensor> = grads.into_iter().collect();
    let dtype = if grads.iter().any(|g| g.dtype() == DType::F64) { DType::F64 } else { DType::F32 };
    let squares = grads.iter().map(|g| Ok(g.to_dtype(dtype)?.sqr()?.sum_all()?)).collect::<Result<Vec<Tensor>>>()?;
    if squares.is_empty() {
        return Ok(None);
    }
    Ok(Some(Tensor::stack(&squares, 0)?.sum_all()?.sqrt()?))
}

/// f64 stays f64 (the reference precision); everything else sums in f32. f64 is not
/// widened into on the device, since Metal has none.
pub fn widened(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Reads a small vector to the host as f64, whatever its float dtype.
pub fn read_values(t: &Tensor) -> Result<Vec<f64>> {
    Ok(match t.dtype() {
        DType::F64 => t.to_vec1()?,
        _ => t.to_dtype(DType::F32)?.to_vec1::<f32>()?.into_iter().map(f64::from).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::{preference_loss, PairLogps};

    /// For three pairs: the policy's log-probs of chosen and rejected, the reference's, and
    /// the six response lengths.
    type Case = ([f64; 3], [f64; 3], [f64; 3], [f64; 3], [usize; 6]);

    fn case() -> Case {
        ([-3.0, -7.5, -20.25], [-4.0, -6.0, -20.0], [-3.5, -7.0, -21.0], [-3.8, -6.2, -19.0], [4, 9, 1, 3, 5, 2])
    }

    #[test]
    fn device_loss_matches_the_host_loss_for_every_variant_in_f64_and_f32() {
        let (pc, pr, rc, rr, lens) = case();
        let device = Device::Cpu;
        for kind in
            [LossKind::Sigmoid { label_smoothing: 0.0 }, LossKind::Sigmoid { label_smoothing: 0.1 }, LossKind::Ipo]
        {
            let host = preference_loss(
                kind,
                0.3,
                PairLogps {
                    policy_chosen: &pc,
                    policy_rejected: &pr,
                    ref_chosen: &rc,
                    ref_rejected: &rr,
                    chosen_lens: &lens[..3],
                    rejected_lens: &lens[3..],
                },
            );
            for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
                let logps = Tensor::new(&[pc, pr].concat()[..], &device).unwrap().to_dtype(dtype).unwrap();
                let reference = Tensor::new(&[rc, rr].concat()[..], &device).unwrap().to_dtype(dtype).unwrap();
                let out = preference_loss_on_device(kind, 0.3, &logps, &reference, &lens).unwrap();
                let totals: Vec<f64> = out.totals.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
                let grad: Vec<f64> = out.grad.to_dtype(DType::F64).unwrap().to_vec1().unwrap();
                let close = |a: f64, b: f64| (a - b).abs() <= tol * b.abs().max(1.0);
                assert!(close(totals[0], host.loss_sum), "{kind:?} {dtype:?} loss {} vs {}", totals[0], host.loss_sum);
                assert_eq!(totals[1], host.correct as f64, "{kind:?} {dtype:?}");
                assert!(close(totals[2], host.margin_sum), "{kind:?} {dtype:?} margin");
                let host_grad: Vec<f64> = host.grad_chosen.iter().chain(&host.grad_rejected).copied().collect();
                for (g, h) in grad.iter().zip(&host_grad) {
                    assert!(close(*g, *h), "{kind:?} {dtype:?} grad {grad:?} vs {host_grad:?}");
                }
            }
        }
    }

    #[test]
    fn device_loss_stays_finite_for_huge_margins() {
        let device = Device::Cpu;
        let logps = Tensor::new(&[0.0f32, -1e4], &device).unwrap();
        let reference = Tensor::zeros(2, DType::F32, &device).unwrap();
        let out = preference_loss_on_device(LossKind::default(), 1.0, &logps, &reference, &[1, 1]).unwrap();
        let totals: Vec<f32> = out.totals.to_vec1().unwrap();
        assert!(totals[0].is_finite() && totals[0] < 1e-6, "{totals:?}");
        let flipped = Tensor::new(&[-1e4f32, 0.0], &device).unwrap();
        let out = preference_loss_on_device(LossKind::default(), 1.0, &flipped, &reference, &[1, 1]).unwrap();
        let totals: Vec<f32> = out.totals.to_vec1().unwrap();
        assert!((totals[0] - 1e4).abs() < 1e-2, "{totals:?}");
    }

    #[test]
    fn step_totals_sum_micro_batches_and_the_norm_matches_the_host_norm() {
        let device = Device::Cpu;
        let mut totals = StepTotals::default();
        totals.add(&Tensor::new(&[1.5f32, 2.0, 0.25], &device).unwrap(), 3).unwrap();
        totals.add(&Tensor::new(&[0.5f32, 1.0, -0.75], &device).unwrap(), 2).unwrap();
        assert_eq!(read_values(&totals.sums(&device).unwrap()).unwrap(), [2.0, 3.0, -0.5]);
        assert_eq!(totals.pairs(), 5);
        let a = Tensor::new(&[3.0f32, 0.0], &device).unwrap();
        let b = Tensor::new(&[[4.0f32], [12.0]], &device).unwrap();
        let norm = global_norm_on_device([&a, &b]).unwrap().unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(norm, 13.0);
        assert!(global_norm_on_device(std::iter::empty()).unwrap().is_none());
    }
}
