//! `fedpo-aggregator experiment`: deterministic for fixed seeds, resumable, and refusing a
//! bad grid before it runs anything.

use std::path::Path;

const MICRO: &str = r#"
name = "micro"
seeds = [5]
[defaults]
devices = 2
rounds = 1
train-pairs = 4
heldout-pairs = 4
batch-pairs = 4
local-steps = 1
max-len = 32
freeze-embeddings = true
diagnostics = true
[[study]]
name = "methods"
grid = { method = ["pfeddpo", "feddpo"] }
"#;

fn experiment(file: &Path, out: &Path) -> anyhow::Result<()> {
    fedpo_aggregator::run_cli([
        "fedpo-aggregator",
        "experiment",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ])
}

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

#[test]
fn experiment_runner_is_deterministic_for_a_fixed_seed_and_keeps_finished_runs() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("micro.toml");
    std::fs::write(&file, MICRO).unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    experiment(&file, &a).unwrap();
    experiment(&file, &b).unwrap();
    for name in ["results.csv", "devices.csv", "summary.csv"] {
        assert_eq!(read(&a, name), read(&b, name), "{name} differs between two runs with the same seed");
    }
    let results = read(&a, "results.csv");
    assert_eq!(results.lines().count(), 1 + 2 * 2, "header + 2 cells × (1 round + final evaluation)\n{results}");
    assert!(results.lines().nth(1).unwrap().starts_with("methods,\"method=pfeddpo\",pfeddpo,5,1,false,"), "{results}");
    for figure in ["methods-loss.png", "methods-kappa2.png", "methods-devices-method=pfeddpo.png"] {
        let bytes = std::fs::read(a.join("figures").join(figure)).unwrap();
        assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 10_000, "{figure}");
    }

    // Finished runs are kept, not run again.
    let summary = a.join("methods/method=feddpo/seed-5/summary.json");
    let before = std::fs::metadata(&summary).unwrap().modified().unwrap();
    experiment(&file, &a).unwrap();
    assert_eq!(std::fs::metadata(&summary).unwrap().modified().unwrap(), before);
    assert_eq!(read(&a, "results.csv"), results);
}

#[test]
fn invalid_grid_cell_is_refused_by_study_and_cell_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(
        &file,
        MICRO.replace("grid = { method = [\"pfeddpo\", \"feddpo\"] }", "grid = { per-round = [2, 0] }"),
    )
    .unwrap();
    let out = dir.path().join("out");
    let err = format!("{:#}", experiment(&file, &out).unwrap_err());
    assert!(err.contains("study `methods`") && err.contains("per-round=0") && err.contains("--per-round"), "{err}");
    assert!(!out.exists(), "nothing ran");
}

#[test]
fn a_cell_two_studies_share_runs_once_and_parallel_runs_give_the_same_results() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("shared.toml");
    let shared = format!("{MICRO}\n[[study]]\nname = \"again\"\nfixed = {{ method = \"pfeddpo\" }}\n");
    std::fs::write(&file, shared).unwrap();
    let (one, two) = (dir.path().join("one"), dir.path().join("two"));
    experiment(&file, &one).unwrap();
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_fedpo-aggregator"))
        .arg("experiment")
        .arg(&file)
        .arg("--out")
        .arg(&two)
        .args(["--parallel", "2"])
        .status()
        .unwrap();
    assert!(status.success());
    for out in [&one, &two] {
        assert!(!out.join("again").exists(), "the shared cell ran again in {}", out.display());
        let summary = read(out, "summary.csv");
        let rows: Vec<&str> = summary.lines().filter(|l| l.contains("pfeddpo") || l.starts_with("again")).collect();
        assert_eq!(rows.len(), 2, "both studies report the shared run\n{summary}");
        assert_eq!(rows[0].split(',').skip(3).collect::<Vec<_>>(), rows[1].split(',').skip(3).collect::<Vec<_>>());
    }
    assert!(two.join("methods/method=pfeddpo/seed-5/simulate.log").exists(), "a parallel run logs to its directory");
    // A run at once has all the cores; two at once have one thread each, and a different
    // split of the kernels' sums changes the last digits.
    for name in ["results.csv", "devices.csv", "summary.csv"] {
        assert_close_csv(&read(&one, name), &read(&two, name), name);
    }
}

fn assert_close_csv(a: &str, b: &str, name: &str) {
    assert_eq!(a.lines().count(), b.lines().count(), "{name}: rows differ");
    for (la, lb) in a.lines().zip(b.lines()) {
        let (fa, fb): (Vec<&str>, Vec<&str>) = (la.split(',').collect(), lb.split(',').collect());
        assert_eq!(fa.len(), fb.len(), "{name}: {la} / {lb}");
        for (x, y) in fa.iter().zip(&fb) {
            match (x.parse::<f64>(), y.parse::<f64>()) {
                (Ok(x), Ok(y)) => assert!((x - y).abs() <= 1e-5 * x.abs().max(1.0), "{name}: {la} / {lb}"),
                _ => assert_eq!(x, y, "{name}: {la} / {lb}"),
            }
        }
    }
}
