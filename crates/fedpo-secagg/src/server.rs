//! The aggregator's side: relay keys and shares, add up masked inputs, remove the masks.
//!
//! The server keeps only the running sum of masked inputs, never an input by itself, and
//! each input is uniformly random in (Z/2³²)^len without the masks of others.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use sharks::{Share, Sharks};
use x25519_dalek::StaticSecret;

use crate::error::SecAggError;
use crate::fixed_point::FixedPoint;
use crate::keys::{agree, PublicKeys};
use crate::prg;
use crate::{Party, MAX_PARTIES};

/// Who sent an input (survivors) and who shared but did not (dropped).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnmaskRequest {
    pub survivors: Vec<Party>,
    pub dropped: Vec<Party>,
}

/// A survivor's shares: of the survivors' self-mask seeds, and of the dropped parties'
/// mask keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UnmaskResponse {
    pub from: Party,
    pub seed_shares: Vec<(Party, Vec<u8>)>,
    pub mask_shares: Vec<(Party, Vec<u8>)>,
}

pub struct Server {
    round: u64,
    threshold: usize,
    len: usize,
    keys: Vec<Option<PublicKeys>>,
    sharing: BTreeSet<Party>,
    survivors: BTreeSet<Party>,
    masked_sum: Vec<u32>,
}

impl Server {
    /// A round of `parties` parties, `threshold` shares to reconstruct a secret, inputs of
    /// `len` values.
    pub fn new(round: u64, parties: usize, threshold: usize, len: usize) -> Result<Self, SecAggError> {
        if !(2..=parties).contains(&threshold) || parties > MAX_PARTIES {
            return Err(SecAggError::Threshold { parties, threshold });
        }
        Ok(Self {
            round,
            threshold,
            len,
            keys: vec![None; parties],
            sharing: BTreeSet::new(),
            survivors: BTreeSet::new(),
            masked_sum: vec![0; len],
        })
    }

    pub fn advertise(&mut self, from: Party, keys: PublicKeys) -> Result<(), SecAggError> {
        *self.keys.get_mut(usize::from(from)).ok_or(SecAggError::UnknownParty(from))? = Some(keys);
        Ok(())
    }

    /// Every party's keys, to broadcast.
    pub fn keys(&self) -> &[Option<PublicKeys>] {
        &self.keys
    }

    /// Notes that `from` sent its share bundles (which the transport relays as they are).
    pub fn shared(&mut self, from: Party) -> Result<(), SecAggError> {
        self.keys.get(usize::from(from)).copied().flatten().ok_or(SecAggError::UnknownParty(from))?;
        self.sharing.insert(from);
        Ok(())
    }

    /// The parties whose shares went out: every input must mask against exactly these.
    pub fn sharing(&self) -> Vec<Party> {
        self.sharing.iter().copied().collect()
    }

    /// Adds a masked input to the running sum.
    pub fn add_input(&mut self, from: Party, masked: &[u32]) -> Result<(), SecAggError> {
        if !self.sharing.contains(&from) {
            return Err(SecAggError::UnknownParty(from));
        }
        if masked.len() != self.len {
            return Err(SecAggError::Length { got: masked.len(), expected: self.len });
        }
        if self.survivors.insert(from) {
            for (s, v) in self.masked_sum.iter_mut().zip(masked) {
                *s = s.wrapping_add(*v);
            }
        }
        Ok(())
    }

    /// What to ask the survivors for.
    pub fn unmask_request(&self) -> Result<UnmaskRequest, SecAggError> {
        if self.survivors.len() < self.threshold {
            return Err(SecAggError::TooFewInputs { got: self.survivors.len(), threshold: self.threshold });
        }
        Ok(UnmaskRequest {
            survivors: self.survivors.iter().copied().collect(),
            dropped: self.sharing.difference(&self.survivors).copied().collect(),
        })
    }

    /// Removes every remaining mask with the survivors' shares and decodes the sum of the
    /// survivors' inputs.
    pub fn finish(self, responses: &[UnmaskResponse], fp: &FixedPoint) -> Result<Vec<f64>, SecAggError> {
        let request = self.unmask_request()?;
        let mut sum = self.masked_sum.clone();
        for &i in &request.survivors {
            let seed = self.recover(i, responses.iter().flat_map(|r| &r.seed_shares))?;
            prg::apply(&mut sum, &seed, true);
        }
        for &d in &request.dropped {
            let secret = StaticSecret::from(self.recover(d, responses.iter().flat_map(|r| &r.mask_shares))?);
            for &i in &request.survivors {
                let peer = self.keys[usize::from(i)].expect("survivors advertised");
                let seed = prg::derive(&agree(&secret, &peer.mask), "mask", self.round, i, d);
                // Survivor i added +mask when i < d and −mask when i > d; take it back.
                prg::apply(&mut sum, &seed, i < d);
            }
        }
        Ok(fp.decode(&sum))
    }

    fn recover<'a>(
        &self,
        party: Party,
        shares: impl Iterator<Item = &'a (Party, Vec<u8>)>,
    ) -> Result<[u8; 32], SecAggError> {
        let shares: Vec<Share> = shares
            .filter(|(p, _)| *p == party)
            .map(|(_, bytes)| Share::try_from(bytes.as_slice()).map_err(|e| SecAggError::Share(e.to_string())))
            .collect::<Result<_, _>>()?;
        if shares.len() < self.threshold {
            return Err(SecAggError::TooFewShares { party, got: shares.len(), threshold: self.threshold });
        }
        let secret = Sharks(self.threshold as u8).recover(&shares).map_err(|e| SecAggError::Share(e.to_string()))?;
        secret.as_slice().try_into().map_err(|_| SecAggError::SecretLength(secret.len()))
    }
}
