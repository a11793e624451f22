//! The aggregator's side of secure aggregation: relay keys and shares between the
//! selected devices, add up their masked inputs, and unmask only the sum.
//!
//! Phases, each closing when every device still expected has answered or gone offline:
//! keys → (key list) → shares → (relay) → masked inputs, which arrive as ordinary
//! update transfers → (unmask request) → shares for unmasking → the sum. The aggregator
//! holds one running sum of masked words and never an individual update.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use fedpo_secagg::{FixedPoint, Party, Server as SecAggServer, ShareBundle, UnmaskResponse};
use fedpo_wire::{BundleBytes, Limits, Message, SecAggMessage, SecAggPlan, TensorPayload, WireDType, MASKED_TENSOR};

use super::{OpenRound, Server};
use crate::accumulator::WeightedSum;
use crate::global_model::GlobalModel;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Keys,
    Shares,
    Inputs,
}

/// One round's secure-aggregation state.
pub(super) struct SecureCollect {
    /// Party k is `parties[k]` (the plan's sorted selection).
    parties: Vec<String>,
    server: SecAggServer,
    pub(super) settings: SecAggPlan,
    phase: Phase,
    advertised: BTreeSet<Party>,
    bundles: Vec<ShareBundle>,
    responses: Vec<UnmaskResponse>,
    /// Pairs claimed by each device whose input arrived.
    pairs: Vec<(Party, u64)>,
    /// The length of an input: every shared value.
    len: usize,
}

impl SecureCollect {
    /// Settings for `selected` devices on `global`: threshold `threshold` (or a majority),
    /// inputs of at most `range` per value times the largest pair count.
    pub(super) fn new(
        round: u64,
        selected: &[String],
        global: &GlobalModel,
        threshold: Option<usize>,
        range: f32,
        max_pairs: u64,
    ) -> Result<Self> {
        let n = selected.len();
        let threshold = threshold.unwrap_or(n / 2 + 1).max(2);
        let len = global.shared().map(|t| t.values.len()).sum();
        let server = SecAggServer::new(round, n, threshold, len)?;
        let fixed_point = FixedPoint::for_sum(range * max_pairs.max(1) as f32, n);
        Ok(Self {
            parties: selected.to_vec(),
            server,
            settings: SecAggPlan { threshold: threshold as u16, fixed_point },
            phase: Phase::Keys,
            advertised: BTreeSet::new(),
            bundles: Vec::new(),
            responses: Vec::new(),
            pairs: Vec::new(),
            len,
        })
    }

    fn party(&self, device: &str) -> Option<Party> {
        self.parties.iter().position(|d| d == device).map(|p| p as Party)
    }

    /// Checks a complete upload (one `secagg.masked` u32 tensor of every shared value) and
    /// adds it to the masked sum.
    pub(super) fn add_input(&mut self, device: &str, pairs: u64, bytes: &BundleBytes, limits: &Limits) -> Result<()> {
        let party = self.party(device).ok_or_else(|| anyhow::anyhow!("{device} is not a party of this round"))?;
        if !bytes.sections.is_empty() {
            bail!("a secure-aggregation input carries no sections");
        }
        let payload = TensorPayload::from_shared(bytes.main.clone(), limits, true)?;
        let [t] = payload.tensors.as_slice() else { bail!("a secure-aggregation input holds exactly one tensor") };
        if t.name() != MASKED_TENSOR || t.dtype() != WireDType::U32 || t.len() != self.len {
            bail!(
                "expected `{MASKED_TENSOR}` as {} u32 words, got `{}` as {} {}",
                self.len,
                t.name(),
                t.len(),
                t.dtype()
            );
        }
        self.server.add_input(party, &t.words())?;
        self.pairs.push((party, pairs));
        Ok(())
    }
}

impl Server {
    /// A secure-aggregation message from `device`.
    pub(super) fn secure_message(&mut self, open: &mut OpenRound, device: &str, msg: SecAggMessage) {
        let Some(sec) = open.secure.as_mut() else { return };
        if msg.round() != open.round {
            return;
        }
        let Some(party) = sec.party(device) else { return };
        let result = match msg {
            SecAggMessage::Keys { device: claimed, keys, .. } if claimed == device && sec.phase == Phase::Keys => {
                sec.advertised.insert(party);
                sec.server.advertise(party, keys).map_err(anyhow::Error::from)
            }
            SecAggMessage::Shares { device: claimed, bundles, .. }
                if claimed == device && sec.phase == Phase::Shares && sec.advertised.contains(&party) =>
            {
                if bundles.iter().any(|b| b.from != party) {
                    Err(anyhow::anyhow!("shares that claim another sender"))
                } else if !sec.server.sharing().contains(&party) {
                    sec.bundles.extend(bundles);
                    sec.server.shared(party).map_err(anyhow::Error::from)
                } else {
                    Ok(())
                }
            }
            SecAggMessage::Unmasked { device: claimed, response, .. }
                if claimed == device && response.from == party =>
            {
                if !sec.responses.iter().any(|r| r.from == party) {
                    sec.responses.push(response);
                }
                Ok(())
            }
            _ => Ok(()),
        };
        if let Err(e) = result {
            self.warnings.warn(device, "secure aggregation", &format!("secure aggregation message refused: {e}"));
        }
    }

    /// Moves the key and share phases on once every device still expected has answered
    /// or gone offline.
    pub(super) fn secure_progress(&mut self, open: &mut OpenRound) -> Result<()> {
        let Some(sec) = open.secure.as_mut() else { return Ok(()) };
        let online = |d: &String| self.state.devices.get(d).is_some_and(|r| r.online);
        let waiting_for = |answered: &dyn Fn(Party) -> bool| {
            sec.parties.iter().enumerate().any(|(p, d)| !answered(p as Party) && online(d))
        };
        let message = match sec.phase {
            Phase::Keys if !waiting_for(&|p| sec.advertised.contains(&p)) => {
                sec.phase = Phase::Shares;
                tracing::info!(advertised = sec.advertised.len(), "secure aggregation: key list out");
                SecAggMessage::KeyList { round: open.round, keys: sec.server.keys().to_vec() }
            }
            Phase::Shares if !waiting_for(&|p| !sec.advertised.contains(&p) || sec.server.sharing().contains(&p)) => {
                sec.phase = Phase::Inputs;
                let sharing = sec.server.sharing();
                tracing::info!(sharing = sharing.len(), "secure aggregation: shares relayed");
                SecAggMessage::Relay { round: open.round, bundles: std::mem::take(&mut sec.bundles), sharing }
            }
            _ => return Ok(()),
        };
        self.link.publish(&self.topics.down(), Message::SecAgg(message).encode())?;
        Ok(())
    }

    /// After the inputs: asks the survivors for their shares, waits for them (or for
    /// the survivors still online), and returns the pair-weighted mean update.
    pub(super) fn secure_unmask(&mut self, open: &mut OpenRound, deadline: Instant) -> Result<WeightedSum> {
        let sec = open.secure.as_ref().expect("a secure round");
        let request = sec.server.unmask_request()?;
        let dropped: Vec<&String> = request.dropped.iter().map(|&p| &sec.parties[usize::from(p)]).collect();
        tracing::info!(survivors = request.survivors.len(), dropped = ?dropped, "secure aggregation: unmasking");
        let message = SecAggMessage::Unmask { round: open.round, request: request.clone() };
        self.link.publish(&self.topics.down(), Message::SecAgg(message).encode())?;
        let deadline = deadline.max(Instant::now() + Duration::from_secs(30));
        loop {
            let sec = open.secure.as_ref().expect("a secure round");
            let pending = request.survivors.iter().any(|&p| {
                !sec.responses.iter().any(|r| r.from == p)
                    && self.state.devices.get(&sec.parties[usize::from(p)]).is_some_and(|d| d.online)
            });
            if !pending || Instant::now() > deadline {
                break;
            }
            self.poll(Duration::from_millis(200), Some(open))?;
        }
        let sec = open.secure.take().expect("a secure round");
        let total_pairs: u64 = sec.pairs.iter().map(|(_, p)| p).sum();
        let count = sec.pairs.len();
        let sum = sec.server.finish(&sec.responses, &sec.settings.fixed_point)?;
        let mean: Vec<f64> = sum.iter().map(|v| v / total_pairs.max(1) as f64).collect();
        Ok(WeightedSum::from_mean(&self.global, &mean, count))
    }
}
