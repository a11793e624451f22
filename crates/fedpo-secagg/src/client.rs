//! A device's side of a secure-aggregation round.

use std::collections::BTreeMap;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305};
use serde::{Deserialize, Serialize};
use sharks::{Share, Sharks};

use crate::error::SecAggError;
use crate::fixed_point::FixedPoint;
use crate::keys::{agree, PublicKeys, Secrets};
use crate::prg;
use crate::server::{UnmaskRequest, UnmaskResponse};
use crate::{Party, MAX_PARTIES};

/// One party's Shamir shares for another, encrypted so that only the addressee reads
/// them: its share of the sender's mask secret key, then of the sender's self-mask seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShareBundle {
    pub from: Party,
    pub to: Party,
    #[serde(with = "serde_bytes")]
    pub ciphertext: Vec<u8>,
}

/// Bytes of one serialized share of a 32-byte secret: its x, then 32 y bytes.
const SHARE_BYTES: usize = 33;

pub struct Client {
    round: u64,
    me: Party,
    threshold: usize,
    secrets: Secrets,
    /// Every party's advertised keys, by party.
    keys: Vec<Option<PublicKeys>>,
    /// Shares others sent this party (and its own), by sender: (mask key share, seed share).
    held: BTreeMap<Party, (Vec<u8>, Vec<u8>)>,
}

impl Client {
    /// Draws this round's secrets for party `me`.
    pub fn new(round: u64, me: Party, threshold: usize) -> Self {
        Self { round, me, threshold, secrets: Secrets::draw(), keys: Vec::new(), held: BTreeMap::new() }
    }

    pub fn public_keys(&self) -> PublicKeys {
        self.secrets.public()
    }

    /// Splits this party's mask key and self-mask seed among every party that advertised
    /// (`keys`, by party), keeping its own share; returns the bundles for the others.
    pub fn share(&mut self, keys: &[Option<PublicKeys>]) -> Result<Vec<ShareBundle>, SecAggError> {
        let parties = keys.len();
        if !(2..=parties).contains(&self.threshold) || parties > MAX_PARTIES {
            return Err(SecAggError::Threshold { parties, threshold: self.threshold });
        }
        if keys.get(usize::from(self.me)).copied().flatten() != Some(self.public_keys()) {
            return Err(SecAggError::UnknownParty(self.me));
        }
        self.keys = keys.to_vec();
        let sharks = Sharks(self.threshold as u8);
        // Share k (x = k + 1) belongs to party k.
        let mask_shares: Vec<Share> = sharks.dealer(self.secrets.mask.as_bytes()).take(parties).collect();
        let seed_shares: Vec<Share> = sharks.dealer(&self.secrets.self_seed).take(parties).collect();
        let mut bundles = Vec::new();
        for (to, peer) in keys.iter().enumerate() {
            let Some(peer) = peer else { continue };
            let to = to as Party;
            let pair = (Vec::from(&mask_shares[usize::from(to)]), Vec::from(&seed_shares[usize::from(to)]));
            if to == self.me {
                self.held.insert(self.me, pair);
                continue;
            }
            let mut plaintext = pair.0;
            plaintext.extend(pair.1);
            let key = self.channel_key(peer, to);
            key.seal_in_place_append_tag(nonce(self.me, to), aad(self.round, self.me, to), &mut plaintext)
                .map_err(|_| SecAggError::Decrypt { from: self.me, to })?;
            bundles.push(ShareBundle { from: self.me, to, ciphertext: plaintext });
        }
        Ok(bundles)
    }

    /// Takes a bundle addressed to this party.
    pub fn receive(&mut self, bundle: &ShareBundle) -> Result<(), SecAggError> {
        let (from, to) = (bundle.from, bundle.to);
        let sender = self.keys.get(usize::from(from)).copied().flatten().ok_or(SecAggError::UnknownParty(from))?;
        if to != self.me {
            return Err(SecAggError::UnknownParty(to));
        }
        let key = self.channel_key(&sender, from);
        let mut bytes = bundle.ciphertext.clone();
        let plain = key
            .open_in_place(nonce(from, to), aad(self.round, from, to), &mut bytes)
            .map_err(|_| SecAggError::Decrypt { from, to })?;
        if plain.len() != 2 * SHARE_BYTES {
            return Err(SecAggError::Decrypt { from, to });
        }
        let (mask, seed) = plain.split_at(SHARE_BYTES);
        self.held.insert(from, (mask.to_vec(), seed.to_vec()));
        Ok(())
    }

    /// The masked, fixed-point input: `values` (already weighted and clipped to the
    /// range) plus the self mask and the pairwise masks with every party in `sharing`
    /// (those whose shares this round holds).
    pub fn masked_input(&self, values: &[f32], fp: &FixedPoint, sharing: &[Party]) -> Result<Vec<u32>, SecAggError> {
        let mut y = fp.encode(values)?;
        prg::apply(&mut y, &self.secrets.self_seed, false);
        for &j in sharing.iter().filter(|&&j| j != self.me) {
            let peer = self.keys.get(usize::from(j)).copied().flatten().ok_or(SecAggError::UnknownParty(j))?;
            let seed = prg::derive(&agree(&self.secrets.mask, &peer.mask), "mask", self.round, self.me, j);
            prg::apply(&mut y, &seed, self.me > j);
        }
        Ok(y)
    }

    /// Reveals this party's shares for the aggregator's final step: of the self-mask seed
    /// of every survivor, of the mask key of every dropped party. Refuses a request that
    /// names a party as both (which would unmask its input) or that leaves fewer
    /// survivors than the threshold (whose sum would expose them).
    pub fn unmask(&self, request: &UnmaskRequest) -> Result<UnmaskResponse, SecAggError> {
        if let Some(&both) = request.survivors.iter().find(|p| request.dropped.contains(p)) {
            return Err(SecAggError::Share(format!("party {both} is named both a survivor and dropped")));
        }
        if request.survivors.len() < self.threshold {
            return Err(SecAggError::TooFewInputs { got: request.survivors.len(), threshold: self.threshold });
        }
        let pick = |parties: &[Party], seed: bool| -> Vec<(Party, Vec<u8>)> {
            parties
                .iter()
                .filter_map(|p| self.held.get(p).map(|(m, s)| (*p, if seed { s.clone() } else { m.clone() })))
                .collect()
        };
        Ok(UnmaskResponse {
            from: self.me,
            seed_shares: pick(&request.survivors, true),
            mask_shares: pick(&request.dropped, false),
        })
    }

    fn channel_key(&self, peer: &PublicKeys, other: Party) -> LessSafeKey {
        let key = prg::derive(&agree(&self.secrets.channel, &peer.channel), "channel", self.round, self.me, other);
        LessSafeKey::new(UnboundKey::new(&CHACHA20_POLY1305, &key).expect("32-byte key"))
    }
}

/// One nonce per direction: a pair's channel key encrypts exactly one bundle each way.
fn nonce(from: Party, to: Party) -> Nonce {
    let mut n = [0u8; 12];
    n[..2].copy_from_slice(&from.to_le_bytes());
    n[2..4].copy_from_slice(&to.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

fn aad(round: u64, from: Party, to: Party) -> Aad<[u8; 12]> {
    let mut a = [0u8; 12];
    a[..8].copy_from_slice(&round.to_le_bytes());
    a[8..10].copy_from_slice(&from.to_le_bytes());
    a[10..].copy_from_slice(&to.to_le_bytes());
    Aad::from(a)
}
