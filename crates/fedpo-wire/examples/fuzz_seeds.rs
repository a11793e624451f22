//! Writes seed inputs for the cargo-fuzz targets in `fuzz/`: real messages, a payload and
//! a whole plan-plus-chunks transfer, so the fuzzer starts from valid structure.
//!
//!     cargo run -p fedpo-wire --example fuzz_seeds -- fuzz/seeds

use std::path::Path;

use fedpo_wire::{
    split_payload, DeviceHello, Hyperparameters, Message, RoundPlan, TensorPayload, ToWire, UpdateCodec, WireDType,
};

struct T(&'static str, Vec<u64>, Vec<f32>);

impl ToWire for T {
    fn wire_name(&self) -> &str {
        self.0
    }
    fn wire_shape(&self) -> Vec<u64> {
        self.1.clone()
    }
    fn wire_values(&self) -> &[f32] {
        &self.2
    }
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(name), bytes)
}

fn framed(messages: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        out.extend_from_slice(&(m.len() as u16).to_le_bytes());
        out.extend_from_slice(m);
    }
    out
}

fn main() -> std::io::Result<()> {
    let root = std::env::args().nth(1).unwrap_or_else(|| "fuzz/seeds".into());
    let root = Path::new(&root);
    let tensors = [
        T("h.0.attn.c_attn.weight", vec![4, 12], (0..48).map(|i| i as f32 * 0.01).collect()),
        T("ln_f.bias", vec![4], vec![0.5; 4]),
    ];
    let payload = TensorPayload::encode(&tensors, WireDType::F32);
    let (manifest, chunks) = split_payload("r1/global", &payload, 256);
    let plan = Message::Plan(RoundPlan {
        round: 1,
        selected: vec!["pi-7".into()],
        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 2, lr: 0.1, beta: 0.2, batch_pairs: 8 },
        strategy: Default::default(),
        model_spec: "{}".into(),
        global_model: manifest,
        sections: Default::default(),
        signature: Vec::new(),
        secagg: None,
        update_codec: UpdateCodec::TopK(0.05),
        downlink: None,
        sender_epoch: 0x5eed,
        job: "lab".into(),
        run: 0x7e57,
    });
    let hello = Message::Hello(DeviceHello {
        device: "pi-7".into(),
        pairs: 120,
        backend: "cpu".into(),
        memory_mb: 3000,
        instance: 7,
        connection: 1,
        model: Vec::new(),
        tag: Vec::new(),
    });
    let chunk_messages: Vec<Vec<u8>> = chunks.into_iter().map(|c| Message::Chunk(c).encode()).collect();

    write(&root.join("decode_message"), "plan", &plan.encode())?;
    write(&root.join("decode_message"), "hello", &hello.encode())?;
    write(&root.join("decode_message"), "chunk", &chunk_messages[0])?;
    write(&root.join("decode_payload"), "payload", &payload.to_bytes())?;
    for codec in [UpdateCodec::Int8, UpdateCodec::TopK(0.25)] {
        let compressed = TensorPayload::compress(&tensors, codec);
        write(
            &root.join("decode_payload"),
            &format!("payload_{}", compressed.tensors[0].dtype()),
            &compressed.to_bytes(),
        )?;
    }
    let mut transfer = vec![plan.encode()];
    transfer.extend(chunk_messages);
    write(&root.join("reassemble"), "plan_and_chunks", &framed(&transfer))?;
    println!("seeds written under {}", root.display());
    Ok(())
}
