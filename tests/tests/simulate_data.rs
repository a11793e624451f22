//! `simulate --data`: a fleet on the user's own pairs, in the layouts of the public data
//! sets (the HH-RLHF and SHP fixtures), dealt by each partitioner. Every device trains on
//! its share, and a partition that cannot give every device pairs is refused naming why.

use std::path::{Path, PathBuf};

const JOB: &str = "own-data";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/data").join(name)
}

fn simulate(out: &Path, data: &Path, extra: &[&str]) -> Result<(), String> {
    let mut args: Vec<String> = ["fedpo-aggregator", "simulate", "--job", JOB, "--rounds", "1", "--local-steps", "1"]
        .into_iter()
        .chain(["--batch-pairs", "2", "--freeze-embeddings", "--no-final-eval", "--max-len", "64"])
        .map(String::from)
        .collect();
    args.extend(["--data".into(), data.display().to_string(), "--out".into(), out.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    fedpo_aggregator::run_cli(args).map_err(|e| format!("{e:#}"))
}

fn participants(out: &Path) -> serde_json::Value {
    common::metrics_records(out)[0]["participants"].clone()
}

mod common;

fn domains(file: &Path) -> Vec<String> {
    let mut d: Vec<String> = std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["domain"].as_str().unwrap().to_string())
        .collect();
    d.sort();
    d.dedup();
    d
}

#[test]
fn shp_pairs_dealt_by_domain_give_each_device_process_one_domain_of_its_own() {
    let dir = fedpo_tests::TestDir::new();
    let out = dir.path().join("by-domain");
    simulate(&out, &fixture("shp-sample.jsonl"), &["--devices", "2", "--partition", "by-key:domain", "--processes"])
        .unwrap();
    assert_eq!(participants(&out), serde_json::json!(["dev-0", "dev-1"]));
    let devices = out.join("devices");
    let shares: Vec<Vec<String>> = ["dev-0", "dev-1"]
        .map(|id| {
            let mut d = domains(&devices.join(format!("{id}.train.jsonl")));
            d.extend(domains(&devices.join(format!("{id}.heldout.jsonl"))));
            d.dedup();
            d
        })
        .into();
    assert_eq!(shares, [["askculinary_train"], ["askscience_train"]]);
}

#[test]
fn device_processes_without_heldout_pairs_train_on_their_whole_share() {
    let dir = fedpo_tests::TestDir::new();
    let out = dir.path().join("no-heldout");
    let hh = fixture("hh-rlhf-sample.jsonl");
    simulate(&out, &hh, &["--devices", "2", "--heldout-fraction", "0", "--processes"]).unwrap();
    assert_eq!(participants(&out), serde_json::json!(["dev-0", "dev-1"]));
    let lines = |f: &str| std::fs::read_to_string(out.join("devices").join(f)).unwrap().lines().count();
    assert_eq!(lines("dev-0.train.jsonl") + lines("dev-1.train.jsonl"), 4);
}

#[test]
fn hh_rlhf_pairs_dealt_iid_or_by_dirichlet_train_every_device() {
    let dir = fedpo_tests::TestDir::new();
    for partition in ["iid", "dirichlet:0.5"] {
        let out = dir.path().join(partition.replace(':', "-"));
        simulate(&out, &fixture("hh-rlhf-sample.jsonl"), &["--devices", "2", "--partition", partition]).unwrap();
        assert_eq!(participants(&out), serde_json::json!(["dev-0", "dev-1"]), "{partition}");
    }
}

#[test]
fn a_partition_that_leaves_a_device_without_pairs_is_refused_naming_the_file_and_the_fix() {
    let dir = fedpo_tests::TestDir::new();
    let shp = fixture("shp-sample.jsonl");
    let e = simulate(&dir.path().join("a"), &shp, &["--devices", "3", "--partition", "by-key:domain"]).unwrap_err();
    assert!(e.contains("shp-sample.jsonl") && e.contains("2 distinct values") && e.contains("dirichlet"), "{e}");
    let e = simulate(&dir.path().join("b"), &shp, &["--devices", "5"]).unwrap_err();
    assert!(e.contains("4 pairs cannot give each of 5 devices"), "{e}");
    let e = simulate(&dir.path().join("c"), &shp, &["--devices", "2", "--partition", "by-key:user"]).unwrap_err();
    assert!(e.contains("4 of 4 pairs have no `user`"), "{e}");
}
