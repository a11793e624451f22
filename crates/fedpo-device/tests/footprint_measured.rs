//! The footprint model behind `--max-memory` against the peaks `scripts/measure_footprint.sh`
//! measured (`fixtures/memory/peaks.jsonl`): benchmark steps, local training and federated
//! rounds. The estimate must cover every one of them, and stay close enough that a board is
//! not refused a configuration it could run.

use fedpo_device::memory::{ParamCounts, StepKernels, Workload, SAFETY_MARGIN, TOKENIZER_MIB};
use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset};
use fedpo_train::OptimKind;
use serde::Deserialize;

const PEAKS: &str = include_str!("../../../fixtures/memory/peaks.jsonl");

/// One line of the fixture.
#[derive(Debug, Deserialize)]
struct Measured {
    source: String,
    model: String,
    partition: String,
    freeze_embeddings: bool,
    optimizer: String,
    batch_pairs: usize,
    micro_batch_pairs: usize,
    seq_len: usize,
    response_len: usize,
    federated: bool,
    /// A round that kept its starting model on disk (measurements before it existed lack it).
    #[serde(default)]
    start_on_disk: bool,
    /// Whether the process loaded the tokenizer and data (the benchmark does not).
    tokenizer: bool,
    shared_prompt: bool,
    compute_dtype: String,
    peak_mib: f64,
}

impl Measured {
    fn workload(&self) -> Workload {
        let config = match self.model.as_str() {
            "tiny" => Gpt2Config::tiny(),
            "distilgpt2" => Gpt2Config::distilgpt2(),
            other => panic!("unknown model {other}"),
        };
        let preset: PartitionPreset = self.partition.parse().unwrap();
        let partition = Partition { preset, freeze_embeddings: self.freeze_embeddings };
        let lora = partition.uses_adapter().then(LoraConfig::default);
        Workload {
            params: ParamCounts::of(&config, lora.as_ref(), partition),
            micro_batch_pairs: self.micro_batch_pairs,
            batch_pairs: self.batch_pairs,
            seq_len: self.seq_len,
            logit_positions: self.response_len,
            optimizer: if self.optimizer == "adamw" { OptimKind::Adamw } else { OptimKind::Sgd },
            federated: self.federated,
            start_on_disk: self.start_on_disk,
            embeddings_train: partition.base_role("wte.weight").is_trainable(),
            kernels: if self.compute_dtype == "f32" { StepKernels::Fused } else { StepKernels::Composed },
            shared_prompt: self.shared_prompt,
            config,
        }
    }

    /// The estimate with its margin, less the tokenizer for a process that had none.
    fn estimate_mib(&self) -> f64 {
        let peak = self.workload().estimate().peak_mib();
        if self.tokenizer {
            peak
        } else {
            peak - TOKENIZER_MIB * SAFETY_MARGIN
        }
    }

    fn describe(&self) -> String {
        format!(
            "{} {} {} (frozen embeddings {}, {}, {} of {} pairs per pass, {} + {} tokens, federated {}, start on disk {}, shared prompt {}, {})",
            self.source,
            self.model,
            self.partition,
            self.freeze_embeddings,
            self.optimizer,
            self.micro_batch_pairs,
            self.batch_pairs,
            self.seq_len - self.response_len,
            self.response_len,
            self.federated,
            self.start_on_disk,
            self.shared_prompt,
            self.compute_dtype
        )
    }
}

fn measured() -> Vec<Measured> {
    let peaks: Vec<Measured> = PEAKS.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(peaks.len() >= 70, "the fixture holds {} measurements", peaks.len());
    peaks
}

#[test]
fn estimates_cover_every_measured_peak() {
    let mut failures = Vec::new();
    for m in measured() {
        let estimate = m.estimate_mib();
        // The composed kernels keep the fit from before the fused ones, which errs far on
        // the side of fitting.
        let slack = if m.compute_dtype == "f32" { 1.7 } else { 2.5 };
        if !(estimate >= m.peak_mib && estimate <= slack * m.peak_mib) {
            failures.push(format!("{}: measured {:.0} MiB, estimated {estimate:.0}", m.describe(), m.peak_mib));
        }
    }
    assert!(failures.is_empty(), "{} estimates off:\n{}", failures.len(), failures.join("\n"));
}

/// The fit is a least-squares line through steps from 50 MiB to 2 GB. Its worst point is
/// the smallest (tiny, shared LoRA, one pair of 32 + 32 tokens): +15 %, where a few tenths of
/// a MiB between two measurements of that 50 MiB process move the error by half a point.
#[test]
fn the_fused_fit_reproduces_each_benchmark_step_within_sixteen_percent() {
    let mut checked = 0;
    for m in measured().iter().filter(|m| m.source == "bench") {
        let unmargined = m.estimate_mib() / SAFETY_MARGIN;
        let err = unmargined / m.peak_mib - 1.0;
        assert!(err.abs() < 0.16, "{}: fit {unmargined:.0} MiB against {:.0} ({err:+.3})", m.describe(), m.peak_mib);
        checked += 1;
    }
    assert_eq!(checked, 64);
}

#[test]
fn distilgpt2_pfeddpo_rounds_fit_a_two_gigabyte_board() {
    // docs/edge-devices.md's claim: a federated pFedDPO round on DistilGPT-2 with the synthetic
    // pairs, in one pass, is planned (and measured) under 2 GiB.
    let rounds: Vec<Measured> = measured()
        .into_iter()
        .filter(|m| m.source == "round" && m.partition == "pfeddpo" && !m.freeze_embeddings)
        .collect();
    let one_pass = rounds.iter().find(|m| m.micro_batch_pairs == m.batch_pairs).expect("a one-pass round");
    assert!(one_pass.peak_mib < 2048.0 && one_pass.estimate_mib() < 2048.0, "{}", one_pass.describe());
    assert!(rounds.len() >= 4, "rounds in one pass and in passes of 1, 2 and 4 pairs");
}
