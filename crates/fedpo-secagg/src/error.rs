//! What can go wrong in a secure-aggregation round.

use crate::Party;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SecAggError {
    #[error("{parties} parties with threshold {threshold}: need 2 ≤ threshold ≤ parties ≤ {max}", max = crate::MAX_PARTIES)]
    Threshold { parties: usize, threshold: usize },
    #[error("party {0} is not in this round")]
    UnknownParty(Party),
    #[error("the share from party {from} to party {to} does not decrypt (tampered, or for another round)")]
    Decrypt { from: Party, to: Party },
    #[error("only {got} shares for party {party}, the threshold is {threshold}")]
    TooFewShares { party: Party, got: usize, threshold: usize },
    #[error("a recovered secret has {0} bytes, not 32")]
    SecretLength(usize),
    #[error("an input has {got} values, the round expects {expected}")]
    Length { got: usize, expected: usize },
    #[error("only {got} devices sent an input, fewer than the threshold {threshold}: the sum would expose them")]
    TooFewInputs { got: usize, threshold: usize },
    #[error("value {value} exceeds the fixed-point range ±{range}")]
    OutOfRange { value: f32, range: f32 },
    #[error("malformed share: {0}")]
    Share(String),
}
