//! Round checkpoints: the global model as safetensors plus the server state as CBOR.
//!
//! The model alternates between two slot files, `global-a.safetensors` and
//! `global-b.safetensors`, rewritten in place; `global.safetensors` links to the latest.
//! Each round writes the slot the current state does not name, then the state naming
//! that slot and the model's digest, and keeps the state it replaces as
//! `state.prev.cbor`. A killed process therefore leaves one whole pair whatever moment it
//! died in (a torn slot is never the one a state names), and resume takes the newest
//! state whose model matches its hash.
//!
//! Two costs shaped this. Writing a model-sized file into fresh page-cache pages cost far
//! more than rewriting one in place, and the `fsync` that makes it survive a power cut
//! cost as much again, on the round's critical path. The sync now runs in the background while the next
//! round's model goes out, and the next checkpoint waits for it before it rewrites the
//! other slot: the kept pair is always on disk, so a power cut costs at most the last
//! round. Rounds are never mixed: a model is only used with a state that names its hash.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::algorithms::dp::RdpAccountant;
use crate::global_model::GlobalModel;

/// A registered device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct DeviceRecord {
    /// Training pairs (FedAvg weight).
    pub(crate) pairs: u64,
    /// Compute backend it reported.
    pub(crate) backend: String,
    /// Whether it is connected, as far as the aggregator knows.
    pub(crate) online: bool,
    /// The connection number of its last hello.
    #[serde(default)]
    pub(crate) connection: u32,
    /// Digest (hex) of the whole model it holds, as its hello said or its last update
    /// showed; empty: none known. The compressed downlink sends it deltas from that model.
    #[serde(default)]
    pub(crate) holds: String,
}

/// The compressed downlink's public model, in a job that has one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct DownlinkRecord {
    /// Digest (hex) of the public model as a whole payload, frozen tensors included.
    pub(crate) public_digest: String,
    /// The checkpoint file holding its shared tensors; set by [`CheckpointDir::save`].
    #[serde(default)]
    pub(crate) public_file: String,
}

/// Everything but the model needed to continue a job.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ServerState {
    pub(crate) format: String,
    pub(crate) job: String,
    /// The run: drawn when the job starts afresh, kept across `--resume`, and named in every
    /// signed plan and result, so that devices refuse what an earlier run signed. States
    /// from before it hold 0, and draw one when resumed.
    #[serde(default)]
    pub(crate) run: u64,
    pub(crate) method: String,
    /// Last round whose aggregate is in the model file.
    pub(crate) round: u64,
    /// Digest (hex) of the model's wire payload. States of format 1 hold its SHA-256
    /// under the old name, which [`CheckpointDir::load`] checks and converts.
    #[serde(alias = "global_sha256")]
    pub(crate) global_digest: String,
    pub(crate) devices: BTreeMap<String, DeviceRecord>,
    pub(crate) strategy: String,
    #[serde(with = "serde_bytes")]
    pub(crate) strategy_state: Vec<u8>,
    pub(crate) bytes_up: u64,
    pub(crate) bytes_down: u64,
    /// The client term's state (SCAFFOLD's c, FedGA's r).
    #[serde(default, with = "serde_bytes")]
    pub(crate) client_term_state: Vec<u8>,
    /// The privacy accountant, with --dp-noise-multiplier.
    #[serde(default)]
    pub(crate) privacy: Option<RdpAccountant>,
    /// The checkpoint file holding the model this state goes with; set by
    /// [`CheckpointDir::save`]. Empty in states from before the slots: `global.safetensors`.
    #[serde(default)]
    pub(crate) model_file: String,
    /// The compressed downlink's public model, once one went out (`--downlink-codec`).
    #[serde(default)]
    pub(crate) downlink: Option<DownlinkRecord>,
}

/// The two model slots, and the name every reader opens.
const SLOTS: [&str; 2] = ["global-a.safetensors", "global-b.safetensors"];
const LATEST: &str = "global.safetensors";
/// The public model's slots, one beside each model slot.
const PUBLIC_SLOTS: [&str; 2] = ["public-a.safetensors", "public-b.safetensors"];

pub(crate) const STATE_FORMAT: &str = "fedpo-server-state/2";
/// States written before models were named by their BLAKE3 digest: the same fields, with
/// the model's SHA-256. A job checkpointed then resumes; its next save is format 2.
const STATE_FORMAT_SHA256: &str = "fedpo-server-state/1";

/// A checkpoint directory, and the background sync of its latest save.
pub(crate) struct CheckpointDir {
    dir: PathBuf,
    /// The slot the latest state names.
    current: Option<&'static str>,
    syncing: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

impl CheckpointDir {
    pub(crate) fn new(out: &Path) -> Self {
        Self { dir: out.join("checkpoint"), current: None, syncing: None }
    }

    /// The latest model, under the name readers open (a link to its slot).
    #[cfg(test)]
    fn model_path(&self) -> PathBuf {
        self.dir.join(LATEST)
    }

    pub(crate) fn state_path(&self) -> PathBuf {
        self.dir.join("state.cbor")
    }

    fn previous_state_path(&self) -> PathBuf {
        self.dir.join("state.prev.cbor")
    }

    pub(crate) fn exists(&self) -> bool {
        self.state_path().exists() || self.previous_state_path().exists()
    }

    /// Saves a round: whole on return (a killed process resumes from it), on disk once
    /// [`CheckpointDir::wait_durable`] returns or the next save starts. `public`: the
    /// downlink's public model, which `state.downlink` describes.
    pub(crate) fn save(
        &mut self,
        model: &GlobalModel,
        state: &ServerState,
        public: Option<&GlobalModel>,
    ) -> Result<()> {
        // The slot about to be rewritten belongs to the state before the current one; the
        // current pair must be on disk before that state is given up.
        self.wait_durable()?;
        std::fs::create_dir_all(&self.dir).with_context(|| format!("creating {}", self.dir.display()))?;
        let index = usize::from(self.current == Some(SLOTS[0]));
        let slot = SLOTS[index];
        let slot_path = self.dir.join(slot);
        model.overwrite_file(&slot_path)?;
        let mut record = ServerState { model_file: slot.to_string(), ..state.clone() };
        let mut files = vec![slot_path];
        if let (Some(public), Some(downlink)) = (public, record.downlink.as_mut()) {
            let path = self.dir.join(PUBLIC_SLOTS[index]);
            public.overwrite_file(&path)?;
            downlink.public_file = PUBLIC_SLOTS[index].to_string();
            files.push(path);
        } else {
            record.downlink = None;
        }
        let tmp = self.dir.join(".state.cbor.tmp");
        let bytes = serde_cbor::to_vec(&record).context("encoding server state")?;
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        let (path, kept) = (self.state_path(), self.previous_state_path());
        match std::fs::rename(&path, &kept) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("keeping {} as {}", path.display(), kept.display()))
            }
            _ => {}
        }
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
        self.current = Some(slot);
        link_latest(&self.dir, slot)?;
        files.push(path);
        let dir = self.dir.clone();
        let sync = move || -> std::io::Result<()> {
            for f in &files {
                std::fs::File::open(f)?.sync_all()?;
            }
            std::fs::File::open(&dir)?.sync_all() // the renames themselves
        };
        self.syncing = Some(std::thread::Builder::new().name("checkpoint-sync".into()).spawn(sync)?);
        Ok(())
    }

    /// Waits until the latest save is on disk.
    pub(crate) fn wait_durable(&mut self) -> Result<()> {
        match self.syncing.take().map(std::thread::JoinHandle::join) {
            None => Ok(()),
            Some(Ok(synced)) => synced.with_context(|| format!("syncing the checkpoint in {}", self.dir.display())),
            Some(Err(_)) => bail!("syncing the checkpoint in {} panicked", self.dir.display()),
        }
    }

    /// The newest complete checkpoint: the current state with its model, or else the kept
    /// state with its (a save interrupted before its state was in place, or files torn by
    /// a power cut). The pair found becomes the current one again.
    pub(crate) fn load(&mut self) -> Result<(GlobalModel, ServerState)> {
        let mut problems = Vec::new();
        for state_path in [self.state_path(), self.previous_state_path()] {
            if !state_path.exists() {
                continue;
            }
            match self.load_pair(&state_path) {
                Ok((model, state, slot)) => {
                    if state_path != self.state_path() {
                        tracing::warn!(
                            round = state.round,
                            "the last checkpoint was incomplete; resuming from round {}",
                            state.round
                        );
                        std::fs::rename(&state_path, self.state_path())
                            .with_context(|| format!("restoring {}", state_path.display()))?;
                    }
                    if let Some(slot) = slot {
                        link_latest(&self.dir, slot)?;
                    }
                    self.current = slot;
                    return Ok((model, state));
                }
                Err(e) => problems.push(format!("{e:#}")),
            }
        }
        bail!("no usable checkpoint in {}: {}", self.dir.display(), problems.join("; "))
    }

    /// The downlink's public model `state` names, checked against its digest with
    /// `global`'s frozen tensors. `None`, with a warning, when there is none or it does not
    /// check out: every device then gets the whole model next round, as after a restart.
    pub(crate) fn load_public(&self, state: &ServerState, global: &GlobalModel) -> Option<GlobalModel> {
        let record = state.downlink.as_ref()?;
        let load = || -> Result<GlobalModel> {
            let name = PUBLIC_SLOTS.iter().find(|s| **s == record.public_file).with_context(|| {
                format!("the state names public model file `{}`, which is not a slot", record.public_file)
            })?;
            let public = GlobalModel::load(&self.dir.join(name))?;
            let found = hex::encode(crate::downlink::public_digest(global, &public));
            if found != record.public_digest {
                bail!("{name} has digest {found}, and the state names {}", record.public_digest);
            }
            Ok(public)
        };
        match load() {
            Ok(public) => Some(public),
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "the downlink's public model is unusable; the next round sends the whole model");
                None
            }
        }
    }

    /// A state and the model it names, if that model is there and has its hash.
    fn load_pair(&self, state_path: &Path) -> Result<(GlobalModel, ServerState, Option<&'static str>)> {
        let bytes = std::fs::read(state_path).with_context(|| format!("reading {}", state_path.display()))?;
        let mut state: ServerState = serde_cbor::from_slice(&bytes)
            .with_context(|| format!("{}: not a fedpo server state", state_path.display()))?;
        let legacy = state.format == STATE_FORMAT_SHA256;
        if state.format != STATE_FORMAT && !legacy {
            bail!("{}: format `{}`, expected `{STATE_FORMAT}`", state_path.display(), state.format);
        }
        let slot =
            match state.model_file.as_str() {
                "" | LATEST => None,
                name => Some(*SLOTS.iter().find(|s| **s == name).with_context(|| {
                    format!("{}: model file `{name}` is not a checkpoint slot", state_path.display())
                })?),
            };
        let model_path = self.dir.join(slot.unwrap_or(LATEST));
        let model = GlobalModel::load(&model_path)?;
        let (kind, found) =
            if legacy { ("SHA-256", legacy_sha256_hex(&model)) } else { ("digest", model.digest_hex()) };
        if found != state.global_digest {
            bail!(
                "{} has {kind} {found}, and {} names {}",
                model_path.display(),
                state_path.display(),
                state.global_digest
            );
        }
        if legacy {
            tracing::info!(state = %state_path.display(), "converting a format-1 checkpoint state");
            state.format = STATE_FORMAT.into();
            state.global_digest = model.digest_hex();
        }
        Ok((model, state, slot))
    }
}

impl Drop for CheckpointDir {
    fn drop(&mut self) {
        if let Err(e) = self.wait_durable() {
            tracing::error!(error = %e, "the last checkpoint may not be on disk");
        }
    }
}

/// SHA-256 (hex) of a model's wire payload: how format-1 states name their model.
fn legacy_sha256_hex(model: &GlobalModel) -> String {
    let (_, chunks) = model.encode().into_transfer("");
    let mut hasher = Sha256::new();
    chunks.iter().for_each(|c| hasher.update(&c.bytes));
    hex::encode(hasher.finalize())
}

/// Points `global.safetensors` at `slot`, atomically (a new link renamed over the old).
fn link_latest(dir: &Path, slot: &str) -> Result<()> {
    let (tmp, latest) = (dir.join(".global.safetensors.link"), dir.join(LATEST));
    let _ = std::fs::remove_file(&tmp);
    #[cfg(unix)]
    std::os::unix::fs::symlink(slot, &tmp).with_context(|| format!("linking {}", tmp.display()))?;
    #[cfg(not(unix))]
    std::fs::copy(dir.join(slot), &tmp).with_context(|| format!("copying {slot}"))?;
    std::fs::rename(&tmp, &latest).with_context(|| format!("renaming {} to {}", tmp.display(), latest.display()))
}

#[cfg(test)]
mod tests {
    use fedpo_model::{Gpt2Config, Partition, PartitionPreset, PolicySpec};

    use super::*;
    use crate::global_model::GlobalTensor;

    fn model(v: f32) -> GlobalModel {
        let spec =
            PolicySpec { config: Gpt2Config::tiny(), lora: None, partition: Partition::new(PartitionPreset::Feddpo) };
        let t = |name: &str, shared| GlobalTensor { name: name.into(), shape: vec![2], values: vec![v, -v], shared };
        GlobalModel::new(spec, vec![t("z.weight", true), t("a.bias", false)])
    }

    fn state(model: &GlobalModel, round: u64) -> ServerState {
        ServerState {
            format: STATE_FORMAT.into(),
            job: "j".into(),
            run: 0x5eed,
            method: "feddpo".into(),
            round,
            global_digest: model.digest_hex(),
            devices: BTreeMap::from([(
                "dev-0".into(),
                DeviceRecord { pairs: 7, backend: "cpu".into(), online: true, connection: 2, holds: "ab".into() },
            )]),
            strategy: "fedavg".into(),
            strategy_state: vec![1, 2, 3],
            bytes_up: 10,
            bytes_down: 20,
            client_term_state: vec![4, 5],
            privacy: None,
            model_file: String::new(),
            downlink: None,
        }
    }

    /// Saves rounds 2 and 3: round 3 current, round 2 kept.
    fn two_rounds(dir: &Path) -> (CheckpointDir, GlobalModel, GlobalModel) {
        let mut ckpt = CheckpointDir::new(dir);
        let (round2, round3) = (model(0.25), model(0.5));
        ckpt.save(&round2, &state(&round2, 2), None).unwrap();
        ckpt.save(&round3, &state(&round3, 3), None).unwrap();
        ckpt.wait_durable().unwrap();
        (ckpt, round2, round3)
    }

    fn saved_round(path: PathBuf) -> u64 {
        serde_cbor::from_slice::<ServerState>(&std::fs::read(path).unwrap()).unwrap().round
    }

    #[test]
    fn checkpoint_round_trips_model_order_roles_and_state() {
        let dir = tempfile::tempdir().unwrap();
        let mut ckpt = CheckpointDir::new(dir.path());
        let m = model(0.5);
        ckpt.save(&m, &state(&m, 3), None).unwrap();
        let (back, st) = CheckpointDir::new(dir.path()).load().unwrap();
        assert_eq!(back.tensors, m.tensors, "values, shapes, roles and payload order survive");
        assert_eq!(back.digest_hex(), m.digest_hex());
        assert_eq!(st, ServerState { model_file: SLOTS[0].into(), ..state(&m, 3) });
        ckpt.wait_durable().unwrap();
    }

    #[test]
    fn rounds_alternate_slots_and_the_latest_name_follows_the_newest_model() {
        let dir = tempfile::tempdir().unwrap();
        let (mut ckpt, round2, round3) = two_rounds(dir.path());
        assert_eq!((saved_round(ckpt.state_path()), saved_round(ckpt.previous_state_path())), (3, 2));
        assert_eq!(GlobalModel::load(&ckpt.dir.join(SLOTS[0])).unwrap().tensors, round2.tensors);
        assert_eq!(GlobalModel::load(&ckpt.dir.join(SLOTS[1])).unwrap().tensors, round3.tensors);
        assert_eq!(GlobalModel::load(&ckpt.model_path()).unwrap().tensors, round3.tensors);
        let round4 = model(0.75);
        ckpt.save(&round4, &state(&round4, 4), None).unwrap();
        assert_eq!(GlobalModel::load(&ckpt.model_path()).unwrap().tensors, round4.tensors, "slot a again");
        let mut names: Vec<String> =
            std::fs::read_dir(&ckpt.dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        assert_eq!(names, [SLOTS[0], SLOTS[1], LATEST, "state.cbor", "state.prev.cbor"], "no temporary is left");
    }

    #[test]
    fn killed_while_rewriting_a_slot_resumes_from_the_last_complete_round() {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, _, round3) = two_rounds(dir.path());
        // Round 4 was being written into slot a (round 2's) when the process died.
        std::fs::write(ckpt.dir.join(SLOTS[0]), b"half a model").unwrap();
        let (back, st) = CheckpointDir::new(dir.path()).load().unwrap();
        assert_eq!((back.tensors, st.round), (round3.tensors, 3));
    }

    #[test]
    fn killed_between_the_state_renames_resumes_from_the_kept_state_and_carries_on() {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, _, _) = two_rounds(dir.path());
        // Round 4's model is whole in slot a; its state never took the current name.
        let round4 = model(0.75);
        round4.overwrite_file(&ckpt.dir.join(SLOTS[0])).unwrap();
        std::fs::rename(ckpt.state_path(), ckpt.previous_state_path()).unwrap();
        let mut resumed = CheckpointDir::new(dir.path());
        let (_, st) = resumed.load().unwrap();
        assert_eq!(st.round, 3, "round 3's state, kept, names slot b");
        assert!(resumed.state_path().exists(), "the kept state is current again");
        // The resumed job's next save rewrites slot a, not the slot round 3 lives in.
        resumed.save(&round4, &state(&round4, 4), None).unwrap();
        resumed.wait_durable().unwrap();
        assert_eq!(GlobalModel::load(&resumed.dir.join(SLOTS[1])).unwrap().digest_hex(), st.global_digest);
        assert_eq!(CheckpointDir::new(dir.path()).load().unwrap().1.round, 4);
    }

    #[test]
    fn newest_files_torn_by_a_power_cut_fall_back_to_the_kept_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, round2, _) = two_rounds(dir.path());
        // What a filesystem may show after losing power before the sync: empty files.
        std::fs::write(ckpt.dir.join(SLOTS[1]), b"").unwrap();
        std::fs::write(ckpt.state_path(), b"").unwrap();
        let (back, st) = CheckpointDir::new(dir.path()).load().unwrap();
        assert_eq!((back.tensors, st.round), (round2.tensors.clone(), 2));
        assert_eq!(GlobalModel::load(&ckpt.model_path()).unwrap().tensors, round2.tensors, "relinked");
    }

    #[test]
    fn a_checkpoint_with_no_matching_pair_is_refused_saying_why() {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, round2, round3) = two_rounds(dir.path());
        let other = model(0.9);
        for slot in SLOTS {
            other.overwrite_file(&ckpt.dir.join(slot)).unwrap();
        }
        let err = CheckpointDir::new(dir.path()).load().unwrap_err().to_string();
        assert!(err.contains("no usable checkpoint"), "{err}");
        assert!(err.contains(&round3.digest_hex()) && err.contains(&round2.digest_hex()), "{err}");
        assert!(err.contains("state.cbor") && err.contains("state.prev.cbor"), "{err}");
    }

    #[test]
    fn a_state_naming_a_file_outside_the_slots_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let (ckpt, round2, _) = two_rounds(dir.path());
        let bad = ServerState { model_file: "../../etc/passwd".into(), ..state(&round2, 9) };
        std::fs::write(ckpt.state_path(), serde_cbor::to_vec(&bad).unwrap()).unwrap();
        std::fs::remove_file(ckpt.previous_state_path()).unwrap();
        let err = CheckpointDir::new(dir.path()).load().unwrap_err().to_string();
        assert!(err.contains("not a checkpoint slot") && err.contains("../../etc/passwd"), "{err}");
    }

    #[test]
    fn a_state_from_before_the_slots_loads_its_model_from_the_latest_name() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = CheckpointDir::new(dir.path());
        std::fs::create_dir_all(&ckpt.dir).unwrap();
        let m = model(0.5);
        m.overwrite_file(&ckpt.model_path()).unwrap();
        std::fs::write(ckpt.state_path(), serde_cbor::to_vec(&state(&m, 3)).unwrap()).unwrap();
        let mut resumed = CheckpointDir::new(dir.path());
        assert_eq!(resumed.load().unwrap().0.tensors, m.tensors);
        resumed.save(&m, &state(&m, 4), None).unwrap(); // into slot a, relinking the latest name
        assert_eq!(CheckpointDir::new(dir.path()).load().unwrap().1.round, 4);
    }

    /// A state as format 1 wrote it: the model named by its SHA-256, under the old name.
    fn format1_state(model: &GlobalModel, round: u64) -> Vec<u8> {
        use serde_cbor::Value;
        let st = ServerState {
            format: STATE_FORMAT_SHA256.into(),
            global_digest: legacy_sha256_hex(model),
            ..state(model, round)
        };
        let Value::Map(mut fields) = serde_cbor::value::to_value(&st).unwrap() else { unreachable!("a struct") };
        let named = fields.remove(&Value::Text("global_digest".into())).unwrap();
        fields.insert(Value::Text("global_sha256".into()), named);
        serde_cbor::to_vec(&Value::Map(fields)).unwrap()
    }

    #[test]
    fn a_format_1_state_naming_its_model_by_sha256_resumes_as_format_2() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = CheckpointDir::new(dir.path());
        std::fs::create_dir_all(&ckpt.dir).unwrap();
        let m = model(0.5);
        m.overwrite_file(&ckpt.model_path()).unwrap();
        std::fs::write(ckpt.state_path(), format1_state(&m, 3)).unwrap();
        let (back, st) = CheckpointDir::new(dir.path()).load().unwrap();
        assert_eq!(back.tensors, m.tensors);
        assert_eq!((st.format.as_str(), st.round), (STATE_FORMAT, 3));
        assert_eq!(st.global_digest, m.digest_hex(), "named by its digest from now on");
        assert_ne!(st.global_digest, legacy_sha256_hex(&m));

        // A format-1 state is still checked: one naming another model is refused.
        std::fs::write(ckpt.state_path(), format1_state(&model(0.9), 3)).unwrap();
        let err = CheckpointDir::new(dir.path()).load().unwrap_err().to_string();
        assert!(err.contains("SHA-256") && err.contains(&legacy_sha256_hex(&m)), "{err}");
    }

    #[test]
    fn the_downlinks_public_model_resumes_with_its_slot_and_a_damaged_one_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let mut ckpt = CheckpointDir::new(dir.path());
        let global = model(0.5);
        let public = GlobalModel::new(
            global.spec.clone(),
            vec![GlobalTensor { values: vec![0.4, -0.4], ..global.tensors[0].clone() }],
        );
        let digest = hex::encode(crate::downlink::public_digest(&global, &public));
        let with_public = |round| ServerState {
            downlink: Some(DownlinkRecord { public_digest: digest.clone(), public_file: String::new() }),
            ..state(&global, round)
        };
        ckpt.save(&global, &with_public(3), Some(&public)).unwrap();
        ckpt.save(&global, &with_public(4), Some(&public)).unwrap();
        ckpt.wait_durable().unwrap();
        let (back, st) = CheckpointDir::new(dir.path()).load().unwrap();
        assert_eq!(st.downlink.as_ref().unwrap().public_file, PUBLIC_SLOTS[1], "beside model slot b");
        assert_eq!(ckpt.load_public(&st, &back).unwrap().tensors, public.tensors);
        assert!(ckpt.load_public(&state(&global, 4), &back).is_none(), "a state without a downlink has none");
        let mut wrong = st.clone();
        wrong.downlink.as_mut().unwrap().public_digest = "00".repeat(32);
        assert!(ckpt.load_public(&wrong, &back).is_none(), "a public model that does not match its digest is dropped");
        ckpt.save(&global, &with_public(5), None).unwrap();
        let (_, st) = CheckpointDir::new(dir.path()).load().unwrap();
        assert_eq!(st.downlink, None, "a save without the public model records none");
    }
}
