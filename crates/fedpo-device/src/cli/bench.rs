//! `fedpo-device bench`: the DPO step benchmark, flag-for-flag with the peer script
//! `dpo_step_bench.py` (PyTorch + transformers + PEFT), printing one JSON object with the
//! same keys so the two can be compared as ratios in one session.
//!
//! A timed step is what the peer times: one forward of P chosen + P rejected sequences
//! (prompt + response tokens each, no padding), response log-probs, sigmoid DPO against
//! reference log-probs computed once, backward and an optimizer step. The model is
//! randomly initialised; LoRA r8 / alpha 16 on `c_attn`. By default the base trains too
//! (pFedDPO); `--base-frozen` trains the adapter only.

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device};
use clap::Args;
use fedpo_data::{collate, TokenizedPair};
use fedpo_model::{Gpt2Config, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec};
use fedpo_train::logps::BatchTensors;
use fedpo_train::{score_pairs, DpoSettings, LocalTrainer, LossKind, OptimConfig, OptimKind, PreferenceSet};
use rand::{Rng, SeedableRng};
use serde_json::json;

use fedpo_device::memory::{gpu_memory, gpu_peak_mib, reset_gpu_peak};
use fedpo_process::usage::peak_rss_mib as peak_rss_mb;
use fedpo_process::usage::process_cpu_seconds;

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// n_layer 2, n_embd 128, n_head 4 (vocab 50257) instead of the DistilGPT-2 shape.
    #[arg(long)]
    pub(crate) tiny: bool,
    /// Classic LoRA: only the adapter trains.
    #[arg(long)]
    pub(crate) base_frozen: bool,
    /// Preference pairs per step (batch = 2P sequences).
    #[arg(long, short = 'P', default_value_t = 4)]
    pub(crate) pairs: usize,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub(crate) prompt_len: usize,
    /// Response tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub(crate) resp_len: usize,
    /// Untimed warm-up steps.
    #[arg(long, short = 'W', default_value_t = 2)]
    pub(crate) warmup: usize,
    /// Timed steps.
    #[arg(long, short = 'N', default_value_t = 8)]
    pub(crate) steps: usize,
    /// Optimizer: sgd or adamw.
    #[arg(long, default_value = "sgd")]
    pub(crate) optim: OptimKind,
    /// Learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub(crate) lr: f64,
    /// DPO beta.
    #[arg(long, default_value_t = 0.2)]
    pub(crate) beta: f64,
    /// Seed of the model and the token batch.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// Also time the f32 matmul (candle's and fedpo's own, the faster counts) at 2048^3 and
    /// at the model's shapes (before the model exists) and report the compute-bound
    /// fraction, as the peer's `--gemm` does.
    #[arg(long)]
    pub(crate) gemm: bool,
    /// Where the step runs: cpu, cuda[:N], metal or auto (a GPU if the binary has one).
    /// On a GPU the report adds the driver's memory figures.
    #[arg(long, default_value = "cpu")]
    pub(crate) device: String,
    /// Precision of the matmuls, as `train-local --compute-dtype`: f32, bf16, f16 or auto.
    #[arg(long, default_value = "f32", value_parser = crate::cli::assemble::parse_compute_dtype)]
    pub(crate) compute_dtype: crate::cli::assemble::ComputeDtype,
}

/// f32 matmul GFLOP/s (best and median of 10 after 2 warm-ups) at `(m, k, n)`, through
/// candle's `matmul` and through fedpo's own gemm calls (`fedpo_model::ops::matmul`, which
/// the step's fused ops use), timed alternately. `gflops_best` and `gflops_median` are the
/// faster path's, so the compute bound is the best this machine's matmul was seen to do.
fn measure_gemm(shapes: &[(usize, usize, usize)], device: &Device) -> Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for &(m, k, n) in shapes {
        let a = candle_core::Tensor::randn(0f32, 1.0, (m, k), device)?;
        let b = candle_core::Tensor::randn(0f32, 1.0, (k, n), device)?;
        let paths: [&dyn Fn() -> candle_core::Result<candle_core::Tensor>; 2] =
            [&|| a.matmul(&b), &|| fedpo_model::ops::matmul(&a, &b)];
        for path in paths {
            for _ in 0..2 {
                path()?;
            }
        }
        let mut times = [Vec::new(), Vec::new()];
        for _ in 0..10 {
            for (path, times) in paths.iter().zip(&mut times) {
                let t0 = Instant::now();
                drop(path()?);
                device.synchronize()?;
                times.push(t0.elapsed().as_secs_f64());
            }
        }
        let flops = 2.0 * (m * k * n) as f64;
        let best = |times: &[f64]| flops / times.iter().copied().fold(f64::INFINITY, f64::min) / 1e9;
        let (candle, fedpo) = (best(&times[0]), best(&times[1]));
        let faster = if fedpo > candle { &times[1] } else { &times[0] };
        out.push(json!({ "m": m, "k": k, "n": n, "gflops_best": candle.max(fedpo),
                         "gflops_median": flops / median(faster) / 1e9,
                         "candle_gflops_best": candle, "fedpo_gflops_best": fedpo }));
    }
    Ok(out)
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Matmul FLOPs of one step (1 FMA = 2 FLOPs) by kind, forward and backward together: the
/// peer's formula, with the head applied to response positions only (as fedpo does).
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepFlops {
    /// `c_attn`, `c_proj` and the MLP's two layers.
    linear: f64,
    /// `q k^T` and `attention @ v`, causal (half the square on average).
    attention: f64,
    lora: f64,
    head: f64,
}

impl StepFlops {
    fn new(cfg: &Gpt2Config, r: usize, seqs: usize, seq_len: usize, head_tokens: usize, base_trainable: bool) -> Self {
        let (l, d, v) = (cfg.n_layer as f64, cfg.n_embd as f64, cfg.vocab_size as f64);
        let t = (seqs * seq_len) as f64;
        let forward = Self {
            linear: t * l * 2.0 * 12.0 * d * d,
            attention: t * l * 2.0 * 2.0 * d * (seq_len as f64 / 2.0),
            lora: t * l * 2.0 * (d * r as f64 + r as f64 * 3.0 * d),
            head: head_tokens as f64 * 2.0 * d * v,
        };
        // backward: an input gradient (1x forward) for every matmul, a weight gradient (1x)
        // where the weight trains; attention's scores and values both get gradients (2x)
        let base = if base_trainable { 3.0 } else { 2.0 };
        Self {
            linear: forward.linear * base,
            attention: forward.attention * 3.0,
            lora: forward.lora * 3.0,
            head: forward.head * base,
        }
    }

    fn total(&self) -> f64 {
        self.linear + self.attention + self.lora + self.head
    }

    /// Seconds the step's matmuls take if each runs at the speed measured at its own shape:
    /// the layers' at `(t, d, 3d)` (`c_attn`, and `c_proj`, a third as wide) and `(t, d, 4d)`
    /// (the MLP), attention and LoRA at the `c_attn` speed, the head at `(t, d, vocab)`.
    ///
    /// Against the bound at the 2048^3 speed this one does not count the time a skinny
    /// matmul loses to memory traffic (the tiny head's `k` is 128) as the step's own.
    fn seconds_at_shape_speeds(&self, attn_gflops: f64, mlp_gflops: f64, head_gflops: f64) -> f64 {
        let linear = self.linear * (4.0 / 12.0 / attn_gflops + 8.0 / 12.0 / mlp_gflops);
        (linear + (self.attention + self.lora) / attn_gflops + self.head / head_gflops) / 1e9
    }

    /// Seconds the step's matmuls take if each runs at the speed measured at its exact
    /// shape (`speeds` in GFLOP/s, in the order of [`step_matmul_shapes`]), attention and
    /// LoRA at the first one's (`c_attn`'s forward).
    fn seconds_at_step_shapes(&self, shapes: &[StepMatmul], speeds: &[f64]) -> f64 {
        let layers: f64 = shapes.iter().zip(speeds).map(|(s, gflops)| s.flops() / gflops).sum();
        (layers + (self.attention + self.lora) / speeds[0]) / 1e9
    }
}

/// One of the step's dense matmuls: `count` products of `(m, k, n)`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct StepMatmul {
    what: &'static str,
    mnk: (usize, usize, usize),
    count: usize,
}

impl StepMatmul {
    fn flops(&self) -> f64 {
        let (m, k, n) = self.mnk;
        2.0 * (m * k * n * self.count) as f64
    }
}

/// Every dense matmul of a step over `rows` token rows with the head on `head_rows` of them:
/// per layer the four projections' forward `(rows, in, out)`, input gradient
/// `(rows, out, in)` and, where the base trains, weight gradient `(in, rows, out)`; the
/// head's forward `(head_rows, d, vocab)`, hidden-state gradient `(head_rows, vocab, d)`
/// and embedding gradient `(vocab, head_rows, d)`. Their FLOPs are [`StepFlops`]'s linear
/// and head parts.
fn step_matmul_shapes(cfg: &Gpt2Config, rows: usize, head_rows: usize, base_trainable: bool) -> Vec<StepMatmul> {
    let (d, v, l) = (cfg.n_embd, cfg.vocab_size, cfg.n_layer);
    let mut out = Vec::new();
    let mut add = |name: [&'static str; 3], (i, o): (usize, usize), t: usize, count: usize, vocab_rows: bool| {
        out.push(StepMatmul { what: name[0], mnk: (t, i, o), count });
        out.push(StepMatmul { what: name[1], mnk: (t, o, i), count });
        if base_trainable {
            let mnk = if vocab_rows { (o, t, i) } else { (i, t, o) };
            out.push(StepMatmul { what: name[2], mnk, count });
        }
    };
    add(["c_attn", "c_attn dx", "c_attn dw"], (d, 3 * d), rows, l, false);
    add(["attn.c_proj", "attn.c_proj dx", "attn.c_proj dw"], (d, d), rows, l, false);
    add(["c_fc", "c_fc dx", "c_fc dw"], (d, 4 * d), rows, l, false);
    add(["mlp.c_proj", "mlp.c_proj dx", "mlp.c_proj dw"], (4 * d, d), rows, l, false);
    add(["head", "head dh", "head dwte"], (d, v), head_rows, 1, true);
    out
}

pub(crate) fn run(args: BenchArgs) -> Result<()> {
    anyhow::ensure!(args.pairs > 0 && args.steps > 0, "--pairs and --steps must be at least 1");
    anyhow::ensure!(args.prompt_len > 0 && args.resp_len > 0, "--prompt-len and --resp-len must be at least 1");
    let device = crate::cli::assemble::parse_device(&args.device)?;
    let config = if args.tiny { Gpt2Config::tiny() } else { Gpt2Config::distilgpt2() };
    anyhow::ensure!(
        args.prompt_len + args.resp_len <= config.n_positions,
        "--prompt-len + --resp-len = {} exceeds the model's {} positions",
        args.prompt_len + args.resp_len,
        config.n_positions
    );
    let preset = if args.base_frozen { PartitionPreset::SharedLora } else { PartitionPreset::Pfeddpo };
    let spec =
        PolicySpec { config: config.clone(), lora: Some(LoraConfig::default()), partition: Partition::new(preset) };
    // the rows the model runs: the 2P rows, or one sequence per pair sharing its prompt
    let (sequences, width) = {
        let pair = TokenizedPair {
            prompt: vec![0; args.prompt_len],
            chosen: vec![0; args.resp_len],
            rejected: vec![0; args.resp_len],
        };
        BatchTensors::for_width(
            &collate(&vec![&pair; args.pairs], 0),
            (config.n_embd, config.n_positions),
            DType::F32,
            &Device::Cpu,
        )?
        .grid()?
    };
    let head_rows = 2 * args.pairs * args.resp_len;
    let step_shapes = step_matmul_shapes(&config, sequences * width, head_rows, !args.base_frozen);
    let gemm = if args.gemm {
        tracing::info!(shapes = 4 + step_shapes.len(), "timing the matmul alone, at 2048^3 and at the step's shapes");
        // the peer's shapes: 2048^3, then c_attn, c_fc and the head at the step's token count
        let (d, v, t) = (config.n_embd, config.vocab_size, 2 * args.pairs * (args.prompt_len + args.resp_len));
        let peer_shapes = measure_gemm(&[(2048, 2048, 2048), (t, d, 3 * d), (t, d, 4 * d), (t, d, v)], &device)?;
        let mnks: Vec<_> = step_shapes.iter().map(|s| s.mnk).collect();
        Some((peer_shapes, measure_gemm(&mnks, &device)?))
    } else {
        None
    };
    let t_build = Instant::now();
    let mut policy = Policy::build(spec, None, None, args.seed, DType::F32, &device)?;
    let compute_dtype = args.compute_dtype.on(&device);
    policy.set_compute_dtype(compute_dtype)?;
    let build_s = t_build.elapsed().as_secs_f64();
    tracing::info!(config = %if args.tiny { "tiny" } else { "distilgpt2" }, seconds = format_args!("{build_s:.2}"), "model built");

    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed + 1);
    let vocab = config.vocab_size as u32;
    let mut ids = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(0..vocab)).collect() };
    let pairs: Vec<TokenizedPair> = (0..args.pairs)
        .map(|_| TokenizedPair {
            prompt: ids(args.prompt_len),
            chosen: ids(args.resp_len),
            rejected: ids(args.resp_len),
        })
        .collect();
    let settings = DpoSettings {
        beta: args.beta,
        loss: LossKind::default(),
        batch_pairs: args.pairs,
        micro_batch_pairs: args.pairs,
        pad_id: vocab - 1,
    };
    let t_ref = Instant::now();
    let reference = score_pairs(&policy, &pairs, args.pairs, settings.pad_id)?;
    let ref_s = t_ref.elapsed().as_secs_f64();
    let data = PreferenceSet { pairs, reference };
    let mut trainer = LocalTrainer::new(settings, OptimConfig::new(args.optim, args.lr), args.seed)?;

    let mut losses = Vec::new();
    for k in 1..=args.warmup {
        let m = trainer.step(&policy, &data)?;
        tracing::info!(seconds = format_args!("{:.3}", m.seconds), "warm-up step {k}/{}", args.warmup);
        losses.push(m.loss);
    }
    let rss_before_timed = peak_rss_mb();
    let gpu_peak_before_timed = gpu_peak_mib(&device);
    reset_gpu_peak(&device);
    let mut times = Vec::with_capacity(args.steps);
    let cpu_before = process_cpu_seconds();
    for _ in 0..args.steps {
        let t0 = Instant::now();
        losses.push(trainer.step(&policy, &data)?.loss);
        // the step ends with a read of its metrics; this makes the timing not depend on it
        device.synchronize()?;
        times.push(t0.elapsed().as_secs_f64());
        tracing::info!(
            seconds = format_args!("{:.3}", times[times.len() - 1]),
            "timed step {}/{}",
            times.len(),
            args.steps
        );
    }
    let cpu_timed = process_cpu_seconds().zip(cpu_before).map(|(after, before)| after - before);
    let med = median(&times);
    let seq_len = args.prompt_len + args.resp_len;
    let tokens = 2 * args.pairs * seq_len;
    let step_flops = StepFlops::new(&config, 8, sequences, width, head_rows, !args.base_frozen);
    let flops = step_flops.total();
    let n_total: usize = policy.params.iter().map(|p| p.tensor().elem_count()).sum();
    let n_train: usize = policy.params.trainable().map(|p| p.tensor().elem_count()).sum();
    let mut report = json!({
        "implementation": "fedpo",
        "config": if args.tiny { "tiny" } else { "distilgpt2" },
        "model": { "n_layer": config.n_layer, "n_embd": config.n_embd, "n_head": config.n_head,
                   "vocab_size": config.vocab_size, "n_positions": config.n_positions },
        "base_trainable": !args.base_frozen,
        "params_total": n_total, "params_trainable": n_train,
        "optimizer": args.optim, "lr": args.lr, "beta": args.beta,
        "pairs": args.pairs, "prompt_len": args.prompt_len, "resp_len": args.resp_len,
        "seqs_per_step": 2 * args.pairs, "tokens_per_step": tokens, "logits_to_keep": true,
        "shared_prompt": sequences < 2 * args.pairs, "model_sequences_per_step": sequences,
        "model_tokens_per_step": sequences * width,
        "warmup_steps": args.warmup, "timed_steps": args.steps,
        "seconds_per_step_median": med,
        "seconds_per_step_min": times.iter().copied().fold(f64::INFINITY, f64::min),
        "seconds_per_step_max": times.iter().copied().fold(0.0, f64::max),
        "step_times": times.iter().map(|t| (t * 1e4).round() / 1e4).collect::<Vec<_>>(),
        "pairs_per_second": args.pairs as f64 / med,
        "tokens_per_second": tokens as f64 / med,
        "response_tokens_per_second": (2 * args.pairs * args.resp_len) as f64 / med,
        "ref_logps_precompute_seconds": ref_s,
        "model_build_seconds": build_s,
        "loss_first": losses.first(), "loss_last": losses.last(),
        "peak_rss_mb": peak_rss_mb(),
        "peak_rss_mb_before_timed_steps": rss_before_timed,
        "threads": rayon_threads(),
        // Threads busy on average over the timed steps: below "threads" by the time the
        // cores waited on each other (or on anything else) instead of computing.
        "threads_busy": cpu_timed.map(|cpu| cpu / times.iter().sum::<f64>()),
        "flops_per_step": flops,
        "flops_detail": { "linear": step_flops.linear, "attention": step_flops.attention,
                          "lora": step_flops.lora, "lm_head": step_flops.head },
        "achieved_gflops": flops / med / 1e9,
        "device": device_name(&device),
        "compute_dtype": format!("{compute_dtype:?}").to_lowercase(),
        "bf16_engine": format!("{:?}", fedpo_model::ops::Bf16Engine::detect()),
    });
    // Beside bf16_engine; set here because one more key overflows json!'s recursion limit.
    report["f16_engine"] = json!(format!("{:?}", fedpo_model::ops::F16Engine::detect()));
    if let Some(memory) = gpu_memory(&device) {
        // the pool's peak over the timed steps, and over model building and warm-up
        report["gpu_peak_mib"] = json!(gpu_peak_mib(&device));
        report["gpu_peak_mib_before_timed_steps"] = json!(gpu_peak_before_timed);
        report["gpu_total_mib"] = json!(memory.total_mib);
        report["gpu_in_use_mib_after"] = json!(memory.total_mib - memory.free_mib);
    }
    if let Some((gemm, at_step_shapes)) = gemm {
        let peak = gemm[0]["gflops_best"].as_f64().unwrap_or(f64::NAN);
        let bound = flops / (peak * 1e9);
        report["gemm"] = json!(gemm);
        report["lower_bound_seconds_per_step_at_2048_sgemm"] = json!(bound);
        report["fraction_of_sgemm_bound"] = json!(bound / med);
        let speed = |i: usize| gemm[i]["gflops_best"].as_f64().unwrap_or(f64::NAN);
        let shape_bound = step_flops.seconds_at_shape_speeds(speed(1), speed(2), speed(3));
        report["lower_bound_seconds_per_step_at_shape_sgemm"] = json!(shape_bound);
        report["fraction_of_shape_bound"] = json!(shape_bound / med);
        let speeds: Vec<f64> = at_step_shapes.iter().map(|g| g["gflops_best"].as_f64().unwrap_or(f64::NAN)).collect();
        let step_bound = step_flops.seconds_at_step_shapes(&step_shapes, &speeds);
        let detail: Vec<_> = step_shapes
            .iter()
            .zip(&at_step_shapes)
            .map(|(s, g)| {
                json!({ "matmul": s.what, "per_step": s.count, "m": s.mnk.0, "k": s.mnk.1, "n": s.mnk.2,
                                  "gflops_best": g["gflops_best"] })
            })
            .collect();
        report["gemm_step_shapes"] = json!(detail);
        report["lower_bound_seconds_per_step_at_step_shapes"] = json!(step_bound);
        report["fraction_of_step_shape_bound"] = json!(step_bound / med);
    }
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}

fn device_name(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_shapes_are_every_linear_and_head_flop_of_the_step_once() {
        // a shared-prompt step (4 sequences of 192) and a two-row one, trainable and frozen
        for cfg in [Gpt2Config::distilgpt2(), Gpt2Config::tiny()] {
            for (seqs, width, trainable) in [(4, 192, true), (4, 192, false), (8, 128, true)] {
                let flops = StepFlops::new(&cfg, 8, seqs, width, 512, trainable);
                let shapes = step_matmul_shapes(&cfg, seqs * width, 512, trainable);
                assert_eq!(shapes.len(), if trainable { 15 } else { 10 });
                let counted: f64 = shapes.iter().map(StepMatmul::flops).sum();
                let expected = flops.linear + flops.head;
                assert!((counted / expected - 1.0).abs() < 1e-12, "{counted} against {expected}");
                // at one speed everywhere the bound is the plain one
                let speeds = vec![200.0; shapes.len()];
                let at_one = flops.seconds_at_step_shapes(&shapes, &speeds);
                assert!((at_one / (flops.total() / 200e9) - 1.0).abs() < 1e-12);
                // a slower head shape costs exactly its own FLOPs' extra time
                let mut slow_head = speeds.clone();
                let head = shapes.iter().position(|s| s.what == "head").unwrap();
                slow_head[head] = 100.0;
                let extra = flops.seconds_at_step_shapes(&shapes, &slow_head) - at_one;
                assert!((extra - shapes[head].flops() / 200e9).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn step_flops_reproduce_the_reference_bounds_of_the_distilgpt2_step() {
        // the reference figures: 2.69 s trainable with every position's logits, about 2.07 s
        // with response-only logits, 1.80 s frozen, all at 187 GFLOP/s
        let cfg = Gpt2Config::distilgpt2();
        let seconds = |head_tokens, trainable| StepFlops::new(&cfg, 8, 8, 128, head_tokens, trainable).total() / 187e9;
        assert!((seconds(1024, true) - 2.69).abs() < 0.01, "{}", seconds(1024, true));
        assert!((seconds(512, true) - 2.07).abs() < 0.03, "{}", seconds(512, true));
        assert!((seconds(1024, false) - 1.80).abs() < 0.01, "{}", seconds(1024, false));
    }

    #[test]
    fn the_shape_bound_prices_each_kind_of_matmul_at_its_own_speed() {
        let flops = StepFlops { linear: 12e9, attention: 1e9, lora: 2e9, head: 5e9 };
        // all at one speed, the bound is the total over it
        assert!((flops.seconds_at_shape_speeds(100.0, 100.0, 100.0) - 0.2).abs() < 1e-12);
        // a slow head costs only the head's share
        let slow_head = flops.seconds_at_shape_speeds(100.0, 100.0, 50.0);
        assert!((slow_head - (0.15 + 0.1)).abs() < 1e-12, "{slow_head}");
        // the MLP's two thirds of the layers at half speed
        let slow_mlp = flops.seconds_at_shape_speeds(100.0, 50.0, 100.0);
        assert!((slow_mlp - (0.04 + 0.16 + 0.03 + 0.05)).abs() < 1e-12, "{slow_mlp}");
    }
}
