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
use fedpo_secagg::{FixedPoint, Party, Server as SecAggServer, ShareBundle, UnmaskRequest, UnmaskResponse};
use fedpo_wire::{BundleBytes, Limits, Message, SecAggMessage, SecAggPlan, TensorPayload, WireDType, MASKED_TENSOR};

use super::{Aggregator, OpenRound};
use crate::combined_update::CombinedUpdate;
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

    /// A protocol message from `device` for `round`; `Err` says why it was refused.
    /// Messages for another round, from a device that is no party, or out of phase are
    /// ignored.
    pub(super) fn on_message(&mut self, round: u64, device: &str, msg: SecAggMessage) -> Result<(), String> {
        if msg.round() != round {
            return Ok(());
        }
        let Some(party) = self.party(device) else { return Ok(()) };
        match msg {
            SecAggMessage::Keys { device: claimed, keys, .. } if claimed == device && self.phase == Phase::Keys => {
                self.advertised.insert(party);
                self.server.advertise(party, keys).map_err(|e| e.to_string())
            }
            SecAggMessage::Shares { device: claimed, bundles, .. }
                if claimed == device && self.phase == Phase::Shares && self.advertised.contains(&party) =>
            {
                if bundles.iter().any(|b| b.from != party) {
                    Err("shares that claim another sender".into())
                } else if !self.server.sharing().contains(&party) {
                    self.bundles.extend(bundles);
                    self.server.shared(party).map_err(|e| e.to_string())
                } else {
                    Ok(())
                }
            }
            SecAggMessage::Unmasked { device: claimed, response, .. }
                if claimed == device && response.from == party =>
            {
                if !self.responses.iter().any(|r| r.from == party) {
                    self.responses.push(response);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// The message that moves the key or share phase on, once every device still
    /// expected has answered or is not `online`; `None` while some may still answer.
    pub(super) fn progress(&mut self, round: u64, online: impl Fn(&str) -> bool) -> Option<SecAggMessage> {
        let waiting_for = |answered: &dyn Fn(Party) -> bool| {
            self.parties.iter().enumerate().any(|(p, d)| !answered(p as Party) && online(d))
        };
        match self.phase {
            Phase::Keys if !waiting_for(&|p| self.advertised.contains(&p)) => {
                self.phase = Phase::Shares;
                tracing::info!(advertised = self.advertised.len(), "secure aggregation: key list out");
                Some(SecAggMessage::KeyList { round, keys: self.server.keys().to_vec() })
            }
            Phase::Shares if !waiting_for(&|p| !self.advertised.contains(&p) || self.server.sharing().contains(&p)) => {
                self.phase = Phase::Inputs;
                let sharing = self.server.sharing();
                tracing::info!(sharing = sharing.len(), "secure aggregation: shares relayed");
                Some(SecAggMessage::Relay { round, bundles: std::mem::take(&mut self.bundles), sharing })
            }
            _ => None,
        }
    }

    /// Whether a survivor of `request` that is still `online` has not sent its shares for
    /// unmasking.
    pub(super) fn awaiting_unmask(&self, request: &UnmaskRequest, online: impl Fn(&str) -> bool) -> bool {
        request
            .survivors
            .iter()
            .any(|&p| !self.responses.iter().any(|r| r.from == p) && online(&self.parties[usize::from(p)]))
    }
}

impl Aggregator {
    /// A secure-aggregation message from `device`.
    pub(super) fn secure_message(&mut self, open: &mut OpenRound, device: &str, msg: SecAggMessage) {
        let Some(sec) = open.secure.as_mut() else { return };
        if let Err(e) = sec.on_message(open.collector.round(), device, msg) {
            self.warnings.warn(device, "secure aggregation", &format!("secure aggregation message refused: {e}"));
        }
    }

    /// Moves the key and share phases on once every device still expected has answered
    /// or gone offline.
    pub(super) fn secure_progress(&mut self, open: &mut OpenRound) -> Result<()> {
        let Some(sec) = open.secure.as_mut() else { return Ok(()) };
        let online = |d: &str| self.state.devices.get(d).is_some_and(|r| r.online);
        if let Some(message) = sec.progress(open.collector.round(), online) {
            self.link.publish(&self.topics.down(), Message::SecAgg(message).encode())?;
        }
        Ok(())
    }

    /// After the inputs: asks the survivors for their shares, waits for them (or for
    /// the survivors still online), and returns the pair-weighted mean update.
    pub(super) fn secure_unmask(&mut self, open: &mut OpenRound, deadline: Instant) -> Result<CombinedUpdate> {
        let sec = open.secure.as_ref().expect("a secure round");
        let request = sec.server.unmask_request()?;
        let dropped: Vec<&String> = request.dropped.iter().map(|&p| &sec.parties[usize::from(p)]).collect();
        tracing::info!(survivors = request.survivors.len(), dropped = ?dropped, "secure aggregation: unmasking");
        let message = SecAggMessage::Unmask { round: open.collector.round(), request: request.clone() };
        self.link.publish(&self.topics.down(), Message::SecAgg(message).encode())?;
        let deadline = deadline.max(Instant::now() + Duration::from_secs(30));
        loop {
            let sec = open.secure.as_ref().expect("a secure round");
            let pending = sec.awaiting_unmask(&request, |d| self.state.devices.get(d).is_some_and(|r| r.online));
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
        Ok(CombinedUpdate::values(&self.global, &mean, count))
    }
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};
    use fedpo_secagg::Client;

    use super::*;
    use crate::global_model::GlobalTensor;

    const ROUND: u64 = 5;

    fn collect() -> (SecureCollect, Vec<Client>) {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let tensor = GlobalTensor { name: "a".into(), shape: vec![4], values: vec![0.0; 4], shared: true };
        let global = GlobalModel::new(spec, vec![tensor]);
        let parties: Vec<String> = ["a", "b", "c"].iter().map(|d| d.to_string()).collect();
        let sec = SecureCollect::new(ROUND, &parties, &global, Some(2), 1.0, 8).unwrap();
        let clients = (0..3).map(|p| Client::new(ROUND, p as Party, 2)).collect();
        (sec, clients)
    }

    fn keys(device: &str, client: &Client) -> SecAggMessage {
        SecAggMessage::Keys { round: ROUND, device: device.into(), keys: client.public_keys() }
    }

    #[test]
    fn the_key_list_goes_out_once_every_online_party_advertised() {
        let (mut sec, clients) = collect();
        let online = |_: &str| true;
        sec.on_message(ROUND, "a", keys("a", &clients[0])).unwrap();
        sec.on_message(ROUND + 1, "b", keys("b", &clients[1])).unwrap();
        assert!(sec.progress(ROUND, online).is_none(), "b's keys were for another round");
        sec.on_message(ROUND, "b", keys("b", &clients[1])).unwrap();
        sec.on_message(ROUND, "z", keys("z", &clients[2])).unwrap();
        assert!(sec.progress(ROUND, online).is_none(), "c has not advertised, and z is no party");
        let Some(SecAggMessage::KeyList { keys: list, .. }) = sec.progress(ROUND, |d| d != "c") else {
            panic!("an offline party is not waited for")
        };
        assert_eq!(list.iter().filter(|k| k.is_some()).count(), 2);
        assert!(sec.progress(ROUND, |d| d != "c").is_none(), "the key list goes out once");
        sec.on_message(ROUND, "c", keys("c", &clients[2])).unwrap();
        assert_eq!(sec.advertised.len(), 2, "keys after the key list are not taken");
    }

    #[test]
    fn shares_are_relayed_once_every_advertised_party_shared_and_forged_senders_refused() {
        let (mut sec, mut clients) = collect();
        let online = |_: &str| true;
        for (device, client) in ["a", "b", "c"].iter().zip(&clients) {
            sec.on_message(ROUND, device, keys(device, client)).unwrap();
        }
        let Some(SecAggMessage::KeyList { keys: list, .. }) = sec.progress(ROUND, online) else { panic!("key list") };
        let mut shares: Vec<Vec<ShareBundle>> = clients.iter_mut().map(|c| c.share(&list).unwrap()).collect();
        let forged = SecAggMessage::Shares { round: ROUND, device: "a".into(), bundles: shares[1].clone() };
        assert!(sec.on_message(ROUND, "a", forged).unwrap_err().contains("another sender"));
        for (p, device) in ["a", "b"].iter().enumerate() {
            let bundles = std::mem::take(&mut shares[p]);
            sec.on_message(ROUND, device, SecAggMessage::Shares { round: ROUND, device: device.to_string(), bundles })
                .unwrap();
        }
        assert!(sec.progress(ROUND, online).is_none(), "c has not shared");
        let bundles = std::mem::take(&mut shares[2]);
        sec.on_message(ROUND, "c", SecAggMessage::Shares { round: ROUND, device: "c".into(), bundles }).unwrap();
        let Some(SecAggMessage::Relay { sharing, bundles, .. }) = sec.progress(ROUND, online) else {
            panic!("every party shared")
        };
        assert_eq!(sharing, vec![0, 1, 2]);
        assert!(bundles.iter().all(|b| b.from < 3) && !bundles.is_empty());
        assert!(sec.progress(ROUND, online).is_none(), "the relay goes out once");
    }
}
