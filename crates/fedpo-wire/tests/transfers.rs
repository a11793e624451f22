//! Chunked transfers: order, duplicates, corruption and size limits.

use fedpo_wire::*;

struct Named(&'static str, Vec<u64>, Vec<f32>);

impl ToWire for Named {
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

fn payload(values: usize) -> TensorPayload {
    let v: Vec<f32> = (0..values).map(|i| (i as f32 * 0.001).cos()).collect();
    let big = Named("h.0.attn.c_attn.weight", vec![values as u64 / 2, 2], v);
    let small = Named("ln_f.bias", vec![4], vec![0.5, -0.5, 1.0, 2.0]);
    let mut p = TensorPayload::encode([&big], WireDType::F32);
    p.tensors.extend(TensorPayload::encode([&small], WireDType::Bf16).tensors);
    p
}

/// Flips bits of one byte of a chunk, as a corrupted link would.
fn flip(chunk: &mut TransferChunk, at: usize, mask: u8) {
    let mut bytes = chunk.bytes.to_vec();
    bytes[at] ^= mask;
    chunk.bytes = bytes.into();
}

#[test]
fn chunks_in_reverse_order_with_duplicates_reassemble_the_exact_payload() {
    let p = payload(700_000); // 2.8 MB: three 1 MiB chunks
    let (manifest, chunks) = split_payload("r1/global", &p, DEFAULT_CHUNK_BYTES);
    assert_eq!(manifest.chunks, 3);
    let mut r = Reassembler::new(manifest.clone(), &Limits::default()).unwrap();
    let mut done = None;
    for chunk in chunks.iter().rev().chain(chunks.iter()) {
        // Every chunk crosses the wire as a message.
        let decoded = match Message::decode(&Message::Chunk(chunk.clone()).encode(), &Limits::default()).unwrap() {
            Message::Chunk(c) => c,
            other => panic!("{other:?}"),
        };
        match r.accept(decoded).unwrap() {
            ReassemblyProgress::Complete(bytes) => done = Some(bytes),
            ReassemblyProgress::Duplicate => assert!(done.is_some(), "a duplicate before completion"),
            ReassemblyProgress::Accepted { .. } => {}
            ReassemblyProgress::Kept(k) => panic!("kept without asking: {k:?}"),
        }
    }
    let bytes = done.expect("complete");
    assert_eq!(digest(&bytes), manifest.digest);
    assert_eq!(TensorPayload::from_bytes(&bytes, &Limits::default(), true).unwrap(), p);
}

#[test]
fn corrupted_chunk_fails_the_hash_and_a_clean_resend_succeeds() {
    let p = payload(600_000);
    let (manifest, chunks) = split_payload("r2/dev-1", &p, DEFAULT_CHUNK_BYTES);
    let mut r = Reassembler::new(manifest, &Limits::default()).unwrap();
    let mut bad = chunks.clone();
    flip(&mut bad[1], 10, 0xFF);
    let mut result = Ok(ReassemblyProgress::Duplicate);
    for c in bad {
        result = r.accept(c);
    }
    let err = result.unwrap_err();
    assert!(matches!(err, WireError::HashMismatch { .. }), "{err}");
    assert!(err.to_string().contains("r2/dev-1"));
    let last = chunks.into_iter().map(|c| r.accept(c).unwrap()).last().unwrap();
    assert!(matches!(last, ReassemblyProgress::Complete(_)));
}

#[test]
fn chunk_of_another_transfer_or_count_is_refused() {
    let (manifest, chunks) = split_payload("r1/global", &payload(1000), DEFAULT_CHUNK_BYTES);
    let mut r = Reassembler::new(manifest, &Limits::default()).unwrap();
    let mut other = chunks[0].clone();
    other.transfer = "r1/dev-9".into();
    assert!(matches!(r.accept(other), Err(WireError::WrongTransfer { .. })));
    let mut recount = chunks[0].clone();
    recount.count = 2;
    assert!(matches!(r.accept(recount), Err(WireError::BadChunk { .. })));
}

#[test]
fn chunks_carrying_more_bytes_than_announced_are_refused() {
    let (mut manifest, chunks) = split_payload("t", &payload(300_000), DEFAULT_CHUNK_BYTES);
    manifest.bytes -= 1;
    let mut r = Reassembler::new(manifest, &Limits::default()).unwrap();
    let errs: Vec<_> = chunks.into_iter().filter_map(|c| r.accept(c).err()).collect();
    assert!(matches!(errs.first(), Some(WireError::TransferTooLarge { .. })), "{errs:?}");
}

#[test]
fn distilgpt2_base_in_f32_needs_313_chunks_of_1_mib() {
    // 81,912,576 parameters x 4 bytes = 327.65 MB, above MQTT's 256 MB packet limit.
    let bytes: u64 = 81_912_576 * 4;
    let chunks = bytes.div_ceil(DEFAULT_CHUNK_BYTES as u64);
    assert_eq!(chunks, 313);
    let m =
        Manifest { transfer: "r1/global".into(), bytes, chunks: chunks as u32, digest: vec![0; 32], tensors: vec![] };
    m.validate(&Limits::default()).unwrap();
    let too_few = Manifest { chunks: 312, ..m };
    assert!(too_few.validate(&Limits::default()).is_err());
}

#[test]
fn a_spooled_transfer_reassembles_out_of_order_survives_a_corrupt_chunk_and_removes_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = payload(700_000);
    let (manifest, chunks) = split_payload("r3/dev-7", &p, DEFAULT_CHUNK_BYTES);
    let mut r = Reassembler::spooled(manifest.clone(), &Limits::default(), dir.path()).unwrap();
    let files = || std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files(), 1, "one spool file per transfer");

    let mut bad = chunks.clone();
    flip(&mut bad[0], 5, 0x0F);
    let results: Vec<_> = bad.into_iter().rev().map(|c| r.accept(c)).collect();
    assert!(matches!(results.last(), Some(Err(WireError::HashMismatch { .. }))), "{results:?}");

    let mut done = None;
    for c in chunks.iter().rev().chain(&chunks[..1]) {
        match r.accept(c.clone()).unwrap() {
            ReassemblyProgress::Complete(bytes) => done = Some(bytes),
            ReassemblyProgress::Duplicate => assert!(done.is_some(), "a duplicate before completion"),
            ReassemblyProgress::Accepted { .. } => {}
            ReassemblyProgress::Kept(k) => panic!("kept without asking: {k:?}"),
        }
    }
    let bytes = done.expect("complete after the clean resend");
    assert_eq!(TensorPayload::from_bytes(&bytes, &Limits::default(), true).unwrap(), p);
    drop(r);
    assert_eq!(files(), 0, "the spool file is removed with its reassembler");
}

#[test]
fn a_transfer_that_falls_out_of_order_midway_is_still_verified_whole() {
    let p = payload(1_500_000); // six 1 MiB chunks
    let (manifest, chunks) = split_payload("r4/dev-2", &p, DEFAULT_CHUNK_BYTES);
    assert_eq!(manifest.chunks, 6);
    let order = [0, 1, 4, 2, 5, 3]; // hashed while in order, then taken whole at the end
    let feed = |chunks: &[TransferChunk]| {
        let mut r = Reassembler::new(manifest.clone(), &Limits::default()).unwrap();
        let mut last = None;
        for &i in &order {
            last = Some(r.accept(chunks[i].clone()));
        }
        last.unwrap()
    };
    let Ok(ReassemblyProgress::Complete(bytes)) = feed(&chunks) else { panic!("not complete") };
    assert_eq!(TensorPayload::from_bytes(&bytes, &Limits::default(), true).unwrap(), p);
    for corrupt in [1, 3] {
        // one hashed in order, one that arrived after the order broke
        let mut bad = chunks.clone();
        flip(&mut bad[corrupt], 7, 0x01);
        assert!(matches!(feed(&bad), Err(WireError::HashMismatch { .. })), "chunk {corrupt}");
    }
}

#[test]
fn a_transfer_larger_than_memory_is_refused_naming_it_instead_of_aborting() {
    // Limits that admit the manifest, so only the reservation can fail.
    let limits = Limits { max_transfer_bytes: u64::MAX, max_chunk_bytes: 1 << 40, ..Limits::default() };
    let m = Manifest {
        transfer: "r1/global".into(),
        bytes: 1 << 62,
        chunks: 1 << 22,
        digest: vec![0; 32],
        tensors: vec![],
    };
    let err = Reassembler::new(m, &limits).err().expect("4 EiB cannot be reserved");
    assert!(matches!(err, WireError::OutOfMemory { bytes, .. } if bytes == 1 << 62), "{err}");
    assert!(err.to_string().contains("r1/global"), "{err}");
}

#[test]
fn a_kept_transfer_is_verified_whole_stays_on_disk_until_read_and_is_checked_again_when_read() {
    let dir = tempfile::tempdir().unwrap();
    let p = payload(1_500_000); // six 1 MiB chunks
    let (manifest, chunks) = split_payload("r5/global", &p, DEFAULT_CHUNK_BYTES);
    let files = || std::fs::read_dir(dir.path()).unwrap().count();
    // In order (hashed as they come) and out of order (hashed from the file at the end).
    for order in [[0, 1, 2, 3, 4, 5], [5, 0, 4, 1, 3, 2]] {
        let feed = |chunks: &[TransferChunk]| {
            let mut r = Reassembler::kept(manifest.clone(), &Limits::default(), dir.path()).unwrap();
            let mut last = None;
            for &i in &order {
                last = Some(r.accept(chunks[i].clone()));
            }
            (r, last.unwrap())
        };
        let (r, last) = feed(&chunks);
        let Ok(ReassemblyProgress::Kept(kept)) = last else { panic!("{order:?}: not kept: {last:?}") };
        assert_eq!(kept.len(), manifest.bytes);
        drop(r);
        assert_eq!(files(), 1, "{order:?}: the kept file outlives its reassembler");
        assert_eq!(std::fs::metadata(kept.path()).unwrap().len(), manifest.bytes);
        let bytes = kept.read().unwrap();
        assert_eq!(TensorPayload::from_bytes(&bytes, &Limits::default(), true).unwrap(), p, "{order:?}");
        assert_eq!(files(), 0, "{order:?}: reading consumes the file");

        let mut bad = chunks.clone();
        flip(&mut bad[order[2]], 9, 0x10);
        let (_, last) = feed(&bad);
        assert!(matches!(last, Err(WireError::HashMismatch { .. })), "{order:?}: {last:?}");
    }

    // A file changed on disk while it waited is caught when read.
    let mut r = Reassembler::kept(manifest.clone(), &Limits::default(), dir.path()).unwrap();
    let kept = chunks.iter().find_map(|c| match r.accept(c.clone()).unwrap() {
        ReassemblyProgress::Kept(k) => Some(k),
        _ => None,
    });
    let kept = kept.expect("kept");
    let mut on_disk = std::fs::read(kept.path()).unwrap();
    on_disk[100] ^= 1;
    std::fs::write(kept.path(), on_disk).unwrap();
    let err = kept.read().unwrap_err().to_string();
    assert!(err.contains("r5/global") && err.contains("kept in"), "{err}");
    assert_eq!(files(), 0);
}

#[test]
fn a_kept_bundle_hands_over_its_main_transfer_and_sections_in_files() {
    let dir = tempfile::tempdir().unwrap();
    let (main, mut chunks) = split_payload("r2/global", &payload(400_000), DEFAULT_CHUNK_BYTES);
    let (control, control_chunks) = split_payload("r2/global/scaffold", &payload(300_000), DEFAULT_CHUNK_BYTES);
    chunks.extend(control_chunks);
    let sections = std::collections::BTreeMap::from([("scaffold.control".to_string(), control.clone())]);
    let mut bundle = Bundle::kept(main.clone(), &sections, &Limits::default(), dir.path()).unwrap();
    let last = chunks.pop().unwrap();
    for c in chunks {
        assert_eq!(bundle.accept(c).unwrap(), BundleProgress::Accepted);
    }
    let BundleProgress::Kept(kept) = bundle.accept(last).unwrap() else { panic!("not kept") };
    assert_eq!(kept.len(), main.bytes + control.bytes);
    drop(bundle);
    let bytes = kept.read().unwrap();
    assert_eq!(digest(&bytes.main), main.digest);
    assert_eq!(digest(&bytes.sections["scaffold.control"]), control.digest);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
