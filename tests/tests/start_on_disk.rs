//! A device that keeps each round's starting model on disk while it trains uploads the
//! same updates, bit for bit, as one that holds it in memory, and leaves no scratch file.

mod common;

use std::path::Path;

use common::{decode_rounds, Wiretap};
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_device::participant::{self, ParticipantSummary};
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::TensorPayload;

/// Two pFedDPO rounds of one device whose embeddings train (the largest shared tensor);
/// returns each round's update and the device's summary.
fn run_job(dir: &Path, start_on_disk: bool) -> (Vec<TensorPayload>, ParticipantSummary) {
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, "fedpo/#");
    let out = dir.join("aggregator");
    let args: Vec<String> = [
        "fedpo-aggregator",
        "serve",
        "--broker",
        &url.to_string(),
        "--job",
        "disk",
        "--method",
        "pfeddpo",
        "--rounds",
        "2",
        "--local-steps",
        "2",
        "--batch-pairs",
        "4",
        "--no-final-eval",
        "--out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let aggregator = std::thread::spawn(move || fedpo_aggregator::run_cli(args));
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 4, heldout_pairs: 4, seed: 0 };
    let data = generate_device(&spec, 0).unwrap();
    let mut cfg = common::participant_config(&url, "disk", "pi-4", dir.join("pi-4"), (data.train, data.heldout), 48);
    cfg.start_on_disk = start_on_disk;
    let device = std::thread::spawn(move || participant::run(cfg));
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    let summary = device.join().unwrap().expect("the device finishes the job");
    let mut rounds = decode_rounds(&tap.stop());
    let updates = (1..=2)
        .map(|r| rounds.get_mut(&r).and_then(|w| w.updates.remove("pi-4")).expect("an update each round").1)
        .collect();
    (updates, summary)
}

#[test]
fn updates_formed_against_a_start_kept_on_disk_match_those_formed_in_memory() {
    let dir = fedpo_tests::TestDir::new();
    let (in_memory, held) = run_job(&dir.path().join("memory"), false);
    let (on_disk, spilled) = run_job(&dir.path().join("disk"), true);
    assert!(held.rounds_with_start_on_disk.is_empty(), "{held:?}");
    assert_eq!(spilled.rounds_with_start_on_disk, vec![1, 2], "{spilled:?}");
    for (round, (a, b)) in in_memory.iter().zip(&on_disk).enumerate() {
        let names: Vec<&str> = a.tensors.iter().map(|t| t.name()).collect();
        assert!(names.contains(&"wte.weight"), "round {}: the embedding trains and is shared: {names:?}", round + 1);
        assert_eq!(names, b.tensors.iter().map(|t| t.name()).collect::<Vec<_>>(), "round {}", round + 1);
        let mut moved = 0;
        for (x, y) in a.tensors.iter().zip(&b.tensors) {
            let (name, x, y) = (x.name(), x.values(), y.values());
            moved += usize::from(x.iter().any(|v| *v != 0.0));
            let same = x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits());
            assert!(same, "round {}: `{name}` differs", round + 1);
        }
        assert!(moved > names.len() / 2, "round {}: training moved {moved} of {} tensors", round + 1, names.len());
    }
    let scratch: Vec<_> = std::fs::read_dir(dir.path().join("disk/pi-4"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("start"))
        .collect();
    assert!(scratch.is_empty(), "the scratch file is removed after each round: {scratch:?}");
}
