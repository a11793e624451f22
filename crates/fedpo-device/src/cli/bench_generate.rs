//! `fedpo-device bench-generate`: generation speed, flag for flag with the peer script
//! `scripts/generate_bench.py` (transformers' `generate` with `use_cache=True`, PEFT for the
//! adapter), printing one JSON object with the same keys so that the two compare as ratios
//! in one session.
//!
//! One timed repeat is what the peer times: a prefill of `--prompt-tokens` random tokens,
//! then `--new-tokens` greedy tokens, batch 1. The model is randomly initialised, with a
//! LoRA adapter r8 / alpha 16 on `c_attn` whose B is non-zero, as a trained private
//! adapter is (`--no-adapter` leaves it out).

use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Args;
use fedpo_model::{
    generate, GenerateSettings, Gpt2Config, LoraConfig, Partition, PartitionPreset, Policy, PolicySpec, Sampling,
    TensorSource,
};
use rand::{Rng, SeedableRng};
use serde_json::json;

use fedpo_process::usage::peak_rss_mib;

use crate::cli::assemble::parse_device;

#[derive(Debug, Args)]
pub(crate) struct BenchGenerateArgs {
    /// n_layer 2, n_embd 128, n_head 4 (vocab 50257) instead of the DistilGPT-2 shape.
    #[arg(long)]
    tiny: bool,
    /// The base alone, without the adapter.
    #[arg(long)]
    no_adapter: bool,
    /// Prompt tokens (random ids).
    #[arg(long, default_value_t = 64)]
    prompt_tokens: usize,
    /// Tokens generated greedily after the prompt.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    /// Untimed warm-up repeats.
    #[arg(long, short = 'W', default_value_t = 1)]
    warmup: usize,
    /// Timed repeats.
    #[arg(long, short = 'N', default_value_t = 5)]
    repeats: usize,
    /// Weights in f32 or bf16; activations, the cache and the logits stay f32.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Compute device: auto, cpu, cuda[:N] or metal.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Seed of the model and the prompt.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

pub(crate) fn run(args: BenchGenerateArgs) -> Result<()> {
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    let device: Device = parse_device(&args.device)?;
    let dtype = match args.dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        other => anyhow::bail!("--dtype `{other}`: expected f32 or bf16"),
    };
    let config = if args.tiny { Gpt2Config::tiny() } else { Gpt2Config::distilgpt2() };
    anyhow::ensure!(
        args.prompt_tokens + args.new_tokens <= config.n_positions,
        "--prompt-tokens {} and --new-tokens {} exceed the model's {} positions",
        args.prompt_tokens,
        args.new_tokens,
        config.n_positions
    );
    let lora = (!args.no_adapter).then(|| LoraConfig::new(8, 16.0, &["c_attn"])).transpose()?;
    let spec = PolicySpec { config: config.clone(), lora, partition: Partition::new(PartitionPreset::SharedLora) };
    let t_build = Instant::now();
    let random = Policy::build(spec.clone(), None, None, args.seed, DType::F32, &device)?;
    // A trained adapter's B is not zero; a fresh one's is, and would add nothing but time.
    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed + 2);
    let tensors = random
        .params
        .iter()
        .map(|p| {
            let t = if p.name.contains("lora_B") {
                let n = p.tensor().elem_count();
                let values: Vec<f32> = (0..n).map(|_| rng.random_range(-0.02..0.02)).collect();
                Tensor::from_vec(values, p.tensor().shape(), &device)?
            } else {
                p.tensor().clone()
            };
            Ok((p.name.clone(), t))
        })
        .collect::<Result<_>>()?;
    let source = TensorSource { tensors, description: "the benchmark's random model".into() };
    drop(random);
    let mut policy = Policy::build(spec, Some(&source), Some(&source), args.seed, dtype, &device)?;
    policy.model.set_compute_dtype(DType::F32);
    drop(source);
    let build_s = t_build.elapsed().as_secs_f64();

    let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed + 1);
    let prompt: Vec<u32> = (0..args.prompt_tokens).map(|_| rng.random_range(0..config.vocab_size as u32)).collect();
    let settings = GenerateSettings { max_new_tokens: args.new_tokens, sampling: Sampling::GREEDY, end_of_text: None };
    for k in 1..=args.warmup {
        let g = generate(&policy.model, &prompt, &settings, |_| true)?;
        tracing::info!(
            seconds = format_args!("{:.3}", (g.prefill + g.decode).as_secs_f64()),
            "warm-up {k}/{}",
            args.warmup
        );
    }
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    let mut generated = Vec::new();
    for k in 1..=args.repeats {
        let g = generate(&policy.model, &prompt, &settings, |_| true)?;
        prefill.push(g.prefill.as_secs_f64());
        decode.push(g.decode.as_secs_f64());
        tracing::info!(
            prefill = format_args!("{:.3}", g.prefill.as_secs_f64()),
            decode = format_args!("{:.3}", g.decode.as_secs_f64()),
            "repeat {k}/{}",
            args.repeats
        );
        generated = g.ids;
    }
    // The peer counts every generated token against the time after the prefill; the first
    // token's choice is in that time, its forward pass in the prefill's.
    let (prefill_s, decode_s) = (median(&prefill), median(&decode));
    let report = json!({
        "implementation": "fedpo",
        "config": if args.tiny { "tiny" } else { "distilgpt2" },
        "adapter": !args.no_adapter,
        "dtype": args.dtype,
        "device": args.device,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "generated_tokens": generated.len(),
        "warmup": args.warmup,
        "repeats": args.repeats,
        "build_seconds": build_s,
        "prefill_seconds_median": prefill_s,
        "decode_seconds_median": decode_s,
        "prefill_tokens_per_s": args.prompt_tokens as f64 / prefill_s,
        "decode_tokens_per_s": generated.len() as f64 / decode_s,
        "total_seconds_median": median(&prefill.iter().zip(&decode).map(|(a, b)| a + b).collect::<Vec<_>>()),
        "peak_rss_mib": peak_rss_mib(),
        "cores": std::thread::available_parallelism().map_or(1, |n| n.get()),
    });
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
