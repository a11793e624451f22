//! Secure aggregation's messages: the rounds of fedpo-secagg's protocol as the wire
//! carries them. Parties are positions in the plan's `selected` list.

use fedpo_secagg::{FixedPoint, Party, PublicKeys, ShareBundle, UnmaskRequest, UnmaskResponse};
use serde::{Deserialize, Serialize};

use crate::error::{Result, WireError};
use crate::limits::Limits;

/// A round's secure-aggregation settings, part of its plan.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SecAggPlan {
    /// Shares needed to rebuild a secret; also the fewest inputs the aggregator may unmask.
    pub threshold: u16,
    /// How each device encodes its pair-weighted update (values beyond the range are
    /// clamped to it).
    pub fixed_point: FixedPoint,
}

/// One step of the protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SecAggMessage {
    /// Device → aggregator: its public keys for the round.
    Keys { round: u64, device: String, keys: PublicKeys },
    /// Aggregator → devices: every party's keys (`None`: did not advertise).
    KeyList { round: u64, keys: Vec<Option<PublicKeys>> },
    /// Device → aggregator: its encrypted shares for the other parties.
    Shares { round: u64, device: String, bundles: Vec<ShareBundle> },
    /// Aggregator → devices: every bundle, and the parties that shared (the masks of an
    /// input cover exactly these).
    Relay { round: u64, bundles: Vec<ShareBundle>, sharing: Vec<Party> },
    /// Aggregator → devices: who sent an input and who did not.
    Unmask { round: u64, request: UnmaskRequest },
    /// Device → aggregator: its shares for the unmasking.
    Unmasked { round: u64, device: String, response: UnmaskResponse },
}

impl SecAggMessage {
    /// The round it belongs to.
    pub fn round(&self) -> u64 {
        match self {
            Self::Keys { round, .. }
            | Self::KeyList { round, .. }
            | Self::Shares { round, .. }
            | Self::Relay { round, .. }
            | Self::Unmask { round, .. }
            | Self::Unmasked { round, .. } => *round,
        }
    }

    pub(crate) fn validate(&self, limits: &Limits) -> Result<()> {
        let parties = |n: usize, field: &'static str| {
            if n > fedpo_secagg::MAX_PARTIES * fedpo_secagg::MAX_PARTIES {
                return Err(WireError::InvalidField { field, reason: format!("{n} entries") });
            }
            Ok(())
        };
        match self {
            Self::Keys { device, .. } | Self::Shares { device, .. } | Self::Unmasked { device, .. } => {
                crate::limits::check_name("device", device, limits)?;
            }
            _ => {}
        }
        match self {
            Self::KeyList { keys, .. } => parties(keys.len(), "keys"),
            Self::Shares { bundles, .. } | Self::Relay { bundles, .. } => parties(bundles.len(), "bundles"),
            _ => Ok(()),
        }
    }
}

impl SecAggPlan {
    pub(crate) fn validate(&self) -> Result<()> {
        let fp = &self.fixed_point;
        if !(fp.scale.is_finite() && fp.scale >= 1.0 && fp.range.is_finite() && fp.range > 0.0) {
            return Err(WireError::InvalidField {
                field: "secagg.fixed_point",
                reason: format!("scale {} and range {} must be finite and positive", fp.scale, fp.range),
            });
        }
        if self.threshold < 2 {
            return Err(WireError::InvalidField { field: "secagg.threshold", reason: "below 2".into() });
        }
        Ok(())
    }
}
