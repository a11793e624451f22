//! Byzantine behaviour for fleet simulations: a device that trains honestly, then
//! uploads a sign-flipped or scaled update.
//!
//! Robust aggregation is only tested if someone attacks it. The attack is applied to the
//! payload after training, so the attacker's own metrics and state stay honest and only
//! what the aggregator receives is poisoned. It lives with the simulation: `simulate
//! --attackers` hands it to in-process devices as their update rewrite
//! (`fedpo_device::participant::ParticipantConfig::rewrite_update`), and the device
//! library knows nothing of attacks.

use std::fmt;
use std::str::FromStr;

use fedpo_wire::{TensorPayload, ToWire, WireTensor};

/// What an attacking device does to its update Δ before uploading it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Adversary {
    /// Uploads −factor·Δ: pushes the model against the honest direction.
    SignFlip { factor: f32 },
    /// Uploads factor·Δ: one device outweighs the rest.
    Scale { factor: f32 },
}

impl Adversary {
    /// The poisoned update.
    pub(crate) fn apply(&self, update: &TensorPayload) -> TensorPayload {
        let k = match *self {
            Self::SignFlip { factor } => -factor,
            Self::Scale { factor } => factor,
        };
        let tensors = update
            .tensors
            .iter()
            .map(|t| {
                let values: Vec<f32> = t.values().into_iter().map(|v| v * k).collect();
                WireTensor::from_shared(&Scaled { name: t.name(), shape: t.shape(), values }, t.dtype())
            })
            .collect();
        TensorPayload { tensors }
    }
}

struct Scaled<'a> {
    name: &'a str,
    shape: &'a [u64],
    values: Vec<f32>,
}

impl ToWire for Scaled<'_> {
    fn wire_name(&self) -> &str {
        self.name
    }
    fn wire_shape(&self) -> Vec<u64> {
        self.shape.to_vec()
    }
    fn wire_values(&self) -> &[f32] {
        &self.values
    }
}

impl FromStr for Adversary {
    type Err = String;

    /// `sign-flip`, `sign-flip:FACTOR` or `scale:FACTOR`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, factor) = match s.split_once(':') {
            Some((kind, f)) => {
                let factor: f32 = f.parse().map_err(|_| format!("attack factor `{f}` is not a number"))?;
                if !(factor.is_finite() && factor > 0.0) {
                    return Err(format!("attack factor must be a positive number, got {f}"));
                }
                (kind, Some(factor))
            }
            None => (s, None),
        };
        match (kind, factor) {
            ("sign-flip", f) => Ok(Self::SignFlip { factor: f.unwrap_or(1.0) }),
            ("scale", Some(factor)) => Ok(Self::Scale { factor }),
            ("scale", None) => Err("`scale` needs a factor, e.g. scale:10".into()),
            _ => Err(format!("unknown attack `{s}`: expected sign-flip, sign-flip:FACTOR or scale:FACTOR")),
        }
    }
}

impl fmt::Display for Adversary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SignFlip { factor } => write!(f, "sign-flip:{factor}"),
            Self::Scale { factor } => write!(f, "scale:{factor}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct T(Vec<f32>);
    impl ToWire for T {
        fn wire_name(&self) -> &str {
            "w"
        }
        fn wire_shape(&self) -> Vec<u64> {
            vec![self.0.len() as u64]
        }
        fn wire_values(&self) -> &[f32] {
            &self.0
        }
    }

    #[test]
    fn attacks_flip_or_scale_every_value_and_keep_names_and_shapes() {
        let honest = TensorPayload::encode(&[T(vec![1.0, -2.0])], fedpo_wire::WireDType::F32);
        let flipped = "sign-flip:3".parse::<Adversary>().unwrap().apply(&honest);
        assert_eq!(flipped.tensors[0].values(), vec![-3.0, 6.0]);
        assert_eq!((flipped.tensors[0].name(), flipped.tensors[0].shape()), ("w", &[2u64][..]));
        let scaled = "scale:10".parse::<Adversary>().unwrap().apply(&honest);
        assert_eq!(scaled.tensors[0].values(), vec![10.0, -20.0]);
        assert_eq!("sign-flip".parse::<Adversary>().unwrap(), Adversary::SignFlip { factor: 1.0 });
    }

    #[test]
    fn malformed_attacks_are_refused_with_the_spelling() {
        assert!("scale".parse::<Adversary>().unwrap_err().contains("scale:10"));
        assert!("scale:-1".parse::<Adversary>().unwrap_err().contains("positive"));
        assert!("flip".parse::<Adversary>().unwrap_err().contains("unknown attack `flip`"));
    }
}
