//! The compressed downlink through real jobs: after the first, whole download, each round
//! sends deltas of the shared tensors that devices add to the model they hold and verify
//! by digest; a device that sat rounds out catches up along the chain, and one whose
//! model is gone declines once and gets the whole model in its next plan.

mod common;

use std::collections::BTreeMap;

use common::fake_device::FakeDevice;
use common::Wiretap;
use fedpo_data::synthetic::{generate_device, SyntheticSpec};
use fedpo_transport::EmbeddedBroker;
use fedpo_wire::{Limits, Message, RoundPlan};

#[test]
fn real_devices_rebuild_every_round_from_int8_deltas_at_a_small_fraction_of_the_whole_model() {
    const JOB: &str = "downlink";
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let tap = Wiretap::start(&url, &format!("fedpo/{JOB}/down"));
    let out = dir.path().join("aggregator");
    // The downlink follows the update codec unless told otherwise.
    let extra = ["--rounds", "3", "--local-steps", "1", "--update-codec", "int8"];
    let args = common::serve_args(&url, JOB, &out, &extra);
    let aggregator = std::thread::spawn(move || fedpo_aggregator::run_cli(args));
    let spec = SyntheticSpec { heterogeneity: 1.0, train_pairs: 6, heldout_pairs: 4, seed: 0 };
    let shards = (0..3)
        .map(|k| {
            let d = generate_device(&spec, k).unwrap();
            (d.train, d.heldout)
        })
        .collect();
    let devices = common::start_devices(&url, JOB, dir.path(), shards, 48);
    aggregator.join().unwrap().expect("the aggregator finishes the job");
    devices.into_iter().for_each(|d| d.join().unwrap());

    let plans = plans_of(&tap.stop());
    let records = common::metrics_records(&out);
    assert_eq!(records.len(), 4, "three rounds and the closing evaluation");
    for r in &records {
        assert_eq!(r["participants"].as_array().unwrap().len(), 3, "every device took part in round {}", r["round"]);
    }
    assert!(plans[&1].downlink.is_none(), "the first round sends the whole model");
    for round in 2..=4 {
        let downlink = plans[&round].downlink.as_ref().expect("later rounds send deltas");
        assert_eq!(downlink.steps.len(), 1, "round {round}: every device holds the last model");
        assert_eq!(downlink.steps[0].base, plans[&(round - 1)].model_digest(), "round {round}");
    }
    let bytes = |round: usize| records[round - 1]["bytes_down"].as_u64().unwrap();
    for round in 2..=4 {
        assert!(bytes(round) * 10 < bytes(1), "round {round}: {} bytes down against {} whole", bytes(round), bytes(1));
    }
    // What each device trained last from is the model the closing plan names.
    for k in 0..3 {
        let info = std::fs::read(dir.path().join(format!("dev-{k}/global-model.json"))).unwrap();
        let info: serde_json::Value = serde_json::from_slice(&info).unwrap();
        assert_eq!(info["digest"], hex::encode(plans[&4].model_digest()), "dev-{k}");
    }
}

#[test]
fn a_device_that_lost_its_model_gets_the_whole_model_and_one_that_sat_out_follows_the_chain() {
    const JOB: &str = "downlink-faults";
    let dir = fedpo_tests::TestDir::new();
    let broker = EmbeddedBroker::start_on_free_port().unwrap();
    let url = broker.url();
    let out = dir.path().join("aggregator");
    let extra = ["--rounds", "5", "--local-steps", "1", "--no-final-eval", "--downlink-codec", "topk:0.1"];
    let args = common::serve_args(&url, JOB, &out, &extra);
    let aggregator = std::thread::spawn(move || fedpo_aggregator::run_cli(args));
    let [a, b, c] = FakeDevice::join_all(&url, JOB, ["dev-a", "dev-b", "dev-c"]);
    let mut seen: BTreeMap<u64, RoundPlan> = BTreeMap::new();
    std::thread::scope(|s| {
        let ha = s.spawn(|| run(a, &|_| Step::Train));
        let hb = s.spawn(|| run(b, &|round| if round == 4 { Step::LostModel } else { Step::Train }));
        let hc = s.spawn(|| run(c, &|round| if round == 2 { Step::SitOut } else { Step::Train }));
        for h in [ha, hb, hc] {
            for p in h.join().unwrap() {
                seen.insert(p.round, p);
            }
        }
    });
    aggregator.join().unwrap().expect("the aggregator finishes the job");

    assert!(seen[&1].downlink.is_none(), "round 1: no device holds a model yet");
    let downlink = seen[&2].downlink.as_ref().expect("round 2: every device holds round 1's model");
    assert_eq!(downlink.steps.len(), 1);
    let downlink = seen[&3].downlink.as_ref().expect("round 3: every device can follow the chain");
    assert_eq!(downlink.steps.len(), 2, "dev-c sat round 2 out and catches up from round 1's model");
    assert_eq!(downlink.steps[0].base, seen[&1].model_digest());
    assert_eq!(downlink.steps[0].section, "downlink.2");
    assert!(seen[&3].sections.contains_key("downlink.2"));
    assert_eq!(downlink.steps[1].base, seen[&2].model_digest());
    assert_eq!(seen[&4].downlink.as_ref().expect("round 4: deltas again").steps.len(), 1);
    assert!(seen[&5].downlink.is_none(), "round 5: dev-b said its model is gone, so the whole model goes down");
    let records = common::metrics_records(&out);
    let bytes = |round: usize| records[round - 1]["bytes_down"].as_u64().unwrap();
    assert!(bytes(3) > bytes(2) && bytes(3) < bytes(5) / 5, "two steps cost about twice one: {records:?}");
}

/// Five rounds of `fake` from its first plan, doing in each what `script` says; the plans
/// it got.
fn run((fake, first): (FakeDevice, RoundPlan), script: &dyn Fn(u64) -> Step) -> Vec<RoundPlan> {
    let mut plans = Vec::new();
    let mut first = Some(first);
    for round in 1..=5 {
        let plan = first.take().unwrap_or_else(|| fake.plan());
        assert_eq!(plan.round, round);
        match script(round) {
            Step::Train => fake.send(&plan, round, 0.01, false),
            Step::LostModel => fake.decline_needing_model(&plan),
            Step::SitOut => fake.decline(&plan, "busy"),
        }
        plans.push(plan);
    }
    assert!(fake.flush());
    plans
}

enum Step {
    Train,
    LostModel,
    SitOut,
}

/// The first plan of each round on the down topic.
fn plans_of(heard: &[fedpo_transport::Delivery]) -> BTreeMap<u64, RoundPlan> {
    let mut plans = BTreeMap::new();
    for d in heard {
        if let Ok(Message::Plan(p)) = Message::decode(&d.payload, &Limits::default()) {
            plans.entry(p.round).or_insert(p);
        }
    }
    plans
}
