#!/usr/bin/env python3
"""Peer of `fedpo-device bench-generate`: generation speed with transformers + PEFT, CPU.

    python3 -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install torch transformers peft safetensors
    /tmp/peer-venv/bin/python scripts/generate_bench.py [--tiny] [--no-adapter]

What one timed repeat does (the thing fedpo is measured against), batch 1:
  * prefill: one forward of --prompt-tokens random ids with use_cache=True, up to the first
    token's logits;
  * decode: `model.generate(..., max_new_tokens=N, min_new_tokens=N, do_sample=False,
    use_cache=True)` from the prompt, timed whole; the decode time is that minus the
    prefill, and decode tokens/s counts the N generated tokens against it.

Model: GPT2LMHeadModel(GPT2Config(...)) with seeded random init (no hub downloads), dropout 0,
tied head; DistilGPT-2's shape (6 layers, 768 wide, 12 heads, vocab 50257, 1024 positions) or
--tiny's (2 layers, 128 wide, 4 heads). LoRA (PEFT) r 8, alpha 16 on c_attn, fan_in_fan_out,
with a non-zero B as a trained adapter has, unless --no-adapter. Eager attention, f32 (or
all bf16 with --dtype bf16; fedpo's bf16 keeps activations f32 and only weights bf16).

Prints one JSON object with the keys fedpo's bench-generate prints.
"""
import argparse
import json
import os
import resource
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

parser = argparse.ArgumentParser()
parser.add_argument("--tiny", action="store_true")
parser.add_argument("--no-adapter", action="store_true")
parser.add_argument("--prompt-tokens", type=int, default=64)
parser.add_argument("--new-tokens", type=int, default=128)
parser.add_argument("-W", "--warmup", type=int, default=1)
parser.add_argument("-N", "--repeats", type=int, default=5)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
parser.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="bf16: the whole model in bfloat16 (weights and activations)")
args = parser.parse_args()

if args.threads:
    torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)
shape = dict(n_layer=2, n_embd=128, n_head=4) if args.tiny else dict(n_layer=6, n_embd=768, n_head=12)
cfg = GPT2Config(vocab_size=50257, n_positions=1024, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **shape)
cfg._attn_implementation = "eager"
model = GPT2LMHeadModel(cfg).eval()
if not args.no_adapter:
    from peft import LoraConfig, get_peft_model

    lcfg = LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn"], fan_in_fan_out=True,
                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(model, lcfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.uniform_(-0.02, 0.02)

if args.dtype == "bf16":
    model = model.to(torch.bfloat16)

g = torch.Generator().manual_seed(args.seed + 1)
prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_tokens), generator=g)
mask = torch.ones_like(prompt)


def repeat():
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(input_ids=prompt, attention_mask=mask, use_cache=True)
        out.logits[:, -1].argmax(-1)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                             eos_token_id=None, pad_token_id=0)
        whole = time.perf_counter() - t0
    return prefill, whole - prefill, ids.shape[1] - args.prompt_tokens


for _ in range(args.warmup):
    repeat()
prefills, decodes = [], []
for _ in range(args.repeats):
    p, d, generated = repeat()
    prefills.append(p)
    decodes.append(d)
prefill_s, decode_s = statistics.median(prefills), statistics.median(decodes)
print(json.dumps({
    "implementation": "pytorch",
    "config": "tiny" if args.tiny else "distilgpt2",
    "adapter": not args.no_adapter,
    "dtype": args.dtype,
    "device": "cpu",
    "prompt_tokens": args.prompt_tokens,
    "new_tokens": args.new_tokens,
    "generated_tokens": generated,
    "warmup": args.warmup,
    "repeats": args.repeats,
    "prefill_seconds_median": prefill_s,
    "decode_seconds_median": decode_s,
    "prefill_tokens_per_s": args.prompt_tokens / prefill_s,
    "decode_tokens_per_s": generated / decode_s,
    "total_seconds_median": statistics.median(p + d for p, d in zip(prefills, decodes)),
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "threads": torch.get_num_threads(),
    "torch": torch.__version__,
}, indent=2))
