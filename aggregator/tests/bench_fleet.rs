//! `bench-fleet` end to end, small: a real aggregator process and 40 synthetic devices
//! through the embedded broker, every update aggregated, each model moved by exactly the
//! synthetic delta, and the aggregator's own peak memory reported.

use std::process::Command;

#[test]
fn a_small_synthetic_fleet_is_aggregated_whole_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("bench");
    let status = Command::new(env!("CARGO_BIN_EXE_fedpo-aggregator"))
        .args(["bench-fleet", "--devices", "40", "--rounds", "2", "--update-codec", "int8", "--deadline", "120"])
        .arg("--out")
        .arg(&out)
        .status()
        .unwrap();
    if !status.success() {
        let kept = dir.keep();
        panic!("bench-fleet failed: see {}", kept.join("bench/aggregator.log").display());
    }
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("fleet_bench.json")).unwrap()).unwrap();
    let rounds = report["rounds"].as_array().unwrap();
    assert_eq!(rounds.len(), 2);
    for r in rounds {
        assert_eq!(r["updates"], 40, "{r}");
        assert!(r["update_norm_gap"].as_f64().unwrap() < 1e-3, "{r}");
        assert!(r["updates_per_second"].as_f64().unwrap() > 0.0, "{r}");
    }
    // int8 carries about 1.07 bytes per value: 40 updates of the shared set.
    let shared_bytes = report["shared_set_mib"].as_f64().unwrap() * (1 << 20) as f64;
    let per_update = rounds[0]["bytes_up"].as_f64().unwrap() / 40.0;
    assert!((0.26..0.30).contains(&(per_update / shared_bytes)), "{per_update} bytes per update");
    let rss = report["aggregator_peak_rss_mib"].as_f64().unwrap();
    assert!(rss > 10.0, "the aggregator's peak RSS is reported: {rss}");
    assert!(!out.join("aggregator/spool").read_dir().unwrap().any(|_| true), "no spool file is left behind");
}
