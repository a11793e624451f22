//! The `--method` choices: the parameter partition a federated job trains (what is shared,
//! what stays on the device), or centralized training.

use std::fmt;
use std::str::FromStr;

use fedpo_model::PartitionPreset;

/// What is shared, what stays on the device, and who trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Method {
    /// A parameter partition trained by every selected device.
    Federated(PartitionPreset),
    /// One trainer on the union of every device's pairs, the whole model trainable and no
    /// adapter: the upper reference for what pooling the data would give. It runs through
    /// the same aggregator, rounds and reporting, as a fleet of one.
    Centralized,
}

impl Method {
    /// The CLI spelling.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Federated(p) => p.name(),
            Self::Centralized => "centralized",
        }
    }

    /// The parameter partition the model is built with.
    pub(crate) fn partition(self) -> PartitionPreset {
        match self {
            Self::Federated(p) => p,
            Self::Centralized => PartitionPreset::Feddpo,
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Method {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "centralized" {
            return Ok(Self::Centralized);
        }
        s.parse::<PartitionPreset>()
            .map(Self::Federated)
            .map_err(|_| format!("unknown method `{s}`; expected one of pfeddpo, feddpo, shared-lora, centralized"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn method_names_round_trip_and_centralized_trains_the_whole_model_without_adapter() {
        for name in ["pfeddpo", "feddpo", "shared-lora", "centralized"] {
            assert_eq!(name.parse::<Method>().unwrap().name(), name);
        }
        assert_eq!(Method::Centralized.partition(), PartitionPreset::Feddpo);
        assert!("fedsgd".parse::<Method>().unwrap_err().contains("centralized"));
    }
}
