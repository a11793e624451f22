//! Round plans for the participant's unit tests.

use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset, PolicySpec};
use fedpo_wire::{Hyperparameters, Manifest, RoundPlan, UpdateCodec, DEFAULT_CHUNK_BYTES};

/// Round 1 of job `lab`, run 1, selecting `pi-7`, for the tiny model with a pFedDPO
/// adapter; its model transfer announces `model_bytes`, and a SCAFFOLD control section
/// `section_bytes` if given.
pub(crate) fn plan_announcing(model_bytes: u64, section_bytes: Option<u64>) -> RoundPlan {
    let spec = PolicySpec {
        config: Gpt2Config::tiny(),
        lora: Some(LoraConfig::default()),
        partition: Partition::new(PartitionPreset::Pfeddpo),
    };
    let manifest = |transfer: &str, bytes: u64| Manifest {
        transfer: transfer.into(),
        bytes,
        chunks: bytes.div_ceil(DEFAULT_CHUNK_BYTES as u64).max(1) as u32,
        digest: vec![0; 32],
        tensors: Vec::new(),
    };
    RoundPlan {
        round: 1,
        selected: vec!["pi-7".into()],
        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 1, lr: 0.1, beta: 0.2, batch_pairs: 4 },
        strategy: Default::default(),
        model_spec: serde_json::to_string(&spec).unwrap(),
        global_model: manifest("r1/global", model_bytes),
        sections: section_bytes
            .map(|b| ("scaffold.control".to_string(), manifest("r1/scaffold", b)))
            .into_iter()
            .collect(),
        signature: Vec::new(),
        secagg: None,
        update_codec: UpdateCodec::F32,
        downlink: None,
        sender_epoch: 1,
        job: "lab".into(),
        run: 1,
    }
}
