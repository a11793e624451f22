//! Every message survives encoding, and hostile bytes are refused with a named reason.

use std::collections::BTreeMap;

use fedpo_wire::*;
use proptest::prelude::*;

fn manifest(transfer: &str, bytes: u64, chunks: u32) -> Manifest {
    Manifest {
        transfer: transfer.into(),
        bytes,
        chunks,
        digest: vec![7; 32],
        tensors: vec![TensorInfo { name: "h.0.ln_1.weight".into(), dtype: WireDType::F32, shape: vec![bytes / 4] }],
    }
}

fn finite() -> impl Strategy<Value = f64> {
    -1e6f64..1e6
}

fn name() -> impl Strategy<Value = String> {
    "[a-z0-9._/-]{1,40}"
}

prop_compose! {
    fn arb_manifest()(transfer in name(), n in 1u64..10_000) -> Manifest {
        let bytes = n * 4;
        manifest(&transfer, bytes, bytes.div_ceil(DEFAULT_CHUNK_BYTES as u64) as u32)
    }
}

prop_compose! {
    fn arb_metrics()(train_loss in finite(), reward_acc in 0.0f64..1.0, heldout in proptest::option::of(0.0f64..1.0),
                     grad_norm in 0.0f64..100.0, seconds in 0.0f64..1e4,
                     peak_rss_mib in proptest::option::of(0.0f64..1e6)) -> UpdateMetrics {
        UpdateMetrics { train_loss, reward_acc, heldout_acc: heldout, grad_norm, seconds, peak_rss_mib }
    }
}

fn arb_message() -> impl Strategy<Value = Message> {
    prop_oneof![
        (name(), any::<u64>(), name(), any::<u64>(), any::<u64>(), any::<u32>()).prop_map(
            |(device, pairs, backend, memory_mb, instance, connection)| Message::Hello(DeviceHello {
                device,
                pairs,
                backend,
                memory_mb,
                instance,
                connection,
                model: Vec::new(),
                tag: Vec::new(),
            })
        ),
        (
            0..=fedpo_wire::MAX_ROUND,
            proptest::collection::vec(name(), 0..8),
            1u32..100,
            finite(),
            finite(),
            1u32..64,
            arb_manifest(),
            proptest::collection::btree_map("[a-z_]{1,12}", finite(), 0..4),
            prop_oneof![Just(Vec::new()), proptest::collection::vec(any::<u8>(), 64)],
            proptest::option::of(arb_secagg_plan()),
            arb_codec()
        )
            .prop_map(
                |(
                    round,
                    selected,
                    local_steps,
                    lr,
                    beta,
                    batch_pairs,
                    global_model,
                    strategy,
                    signature,
                    secagg,
                    update_codec,
                )| {
                    Message::Plan(RoundPlan {
                        round,
                        selected,
                        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps, lr, beta, batch_pairs },
                        strategy,
                        model_spec: r#"{"config":{}}"#.into(),
                        global_model,
                        sections: Default::default(),
                        signature,
                        secagg,
                        update_codec,
                        downlink: (round % 3 == 0).then(|| Downlink {
                            codec: update_codec,
                            steps: vec![DeltaStep { base: vec![round as u8; 32], section: String::new() }],
                            model: vec![7; 32],
                        }),
                        sender_epoch: round.rotate_left(17),
                        job: "lab".into(),
                        run: round.rotate_left(29),
                    })
                }
            ),
        (any::<u64>(), name(), any::<u64>(), arb_metrics(), arb_manifest()).prop_map(
            |(round, device, pairs, metrics, update)| Message::Update(Update {
                round,
                device,
                pairs,
                metrics,
                update,
                sections: Default::default()
            })
        ),
        (name(), 1u32..1000, proptest::collection::vec(any::<u8>(), 0..2048)).prop_flat_map(
            |(transfer, count, bytes)| {
                (0..count).prop_map(move |index| {
                    Message::Chunk(TransferChunk {
                        transfer: transfer.clone(),
                        index,
                        count,
                        bytes: bytes.clone().into(),
                    })
                })
            }
        ),
        (
            0..=fedpo_wire::MAX_ROUND,
            proptest::collection::vec(name(), 0..8),
            finite(),
            proptest::collection::vec(any::<u8>(), 32),
            any::<bool>()
        )
            .prop_map(|(round, participants, train_loss, global_digest, finished)| {
                Message::Result(RoundResult {
                    round,
                    participants,
                    train_loss,
                    global_digest,
                    finished,
                    job: "lab".into(),
                    run: round ^ 0x5a,
                    signature: Vec::new(),
                })
            }),
        (name(), "[ -~]{0,80}").prop_map(|(device, reason)| Message::Bye(DeviceBye {
            device,
            reason,
            instance: 7,
            tag: Vec::new()
        })),
        arb_secagg_message().prop_map(Message::SecAgg),
        (name(), any::<u64>(), "[ -~]{0,80}").prop_map(|(device, round, reason)| Message::Declined(RoundDeclined {
            device,
            round,
            reason,
            needs_model: round % 2 == 0,
        })),
    ]
}

fn arb_codec() -> impl Strategy<Value = UpdateCodec> {
    prop_oneof![
        Just(UpdateCodec::F32),
        Just(UpdateCodec::Bf16),
        Just(UpdateCodec::F16),
        Just(UpdateCodec::Int8),
        (1e-4f32..=1.0).prop_map(UpdateCodec::TopK),
    ]
}

prop_compose! {
    fn arb_secagg_plan()(threshold in 2u16..255, scale in 1.0f64..1e9, range in 1e-3f32..1e3) -> SecAggPlan {
        SecAggPlan { threshold, fixed_point: fedpo_secagg::FixedPoint { scale, range } }
    }
}

prop_compose! {
    fn arb_keys()(channel in any::<[u8; 32]>(), mask in any::<[u8; 32]>()) -> fedpo_secagg::PublicKeys {
        fedpo_secagg::PublicKeys { channel, mask }
    }
}

prop_compose! {
    fn arb_bundle()(from in any::<u16>(), to in any::<u16>(), ciphertext in proptest::collection::vec(any::<u8>(), 0..100))
        -> fedpo_secagg::ShareBundle {
        fedpo_secagg::ShareBundle { from, to, ciphertext }
    }
}

fn arb_shares() -> impl Strategy<Value = Vec<(u16, Vec<u8>)>> {
    proptest::collection::vec((any::<u16>(), proptest::collection::vec(any::<u8>(), 33)), 0..5)
}

fn arb_secagg_message() -> impl Strategy<Value = SecAggMessage> {
    let parties = || proptest::collection::vec(any::<u16>(), 0..6);
    prop_oneof![
        (any::<u64>(), name(), arb_keys()).prop_map(|(round, device, keys)| SecAggMessage::Keys {
            round,
            device,
            keys
        }),
        (any::<u64>(), proptest::collection::vec(proptest::option::of(arb_keys()), 0..6))
            .prop_map(|(round, keys)| SecAggMessage::KeyList { round, keys }),
        (any::<u64>(), name(), proptest::collection::vec(arb_bundle(), 0..4))
            .prop_map(|(round, device, bundles)| SecAggMessage::Shares { round, device, bundles }),
        (any::<u64>(), proptest::collection::vec(arb_bundle(), 0..4), parties())
            .prop_map(|(round, bundles, sharing)| SecAggMessage::Relay { round, bundles, sharing }),
        (any::<u64>(), parties(), parties()).prop_map(|(round, survivors, dropped)| SecAggMessage::Unmask {
            round,
            request: fedpo_secagg::UnmaskRequest { survivors, dropped }
        }),
        (any::<u64>(), name(), any::<u16>(), arb_shares(), arb_shares()).prop_map(
            |(round, device, from, seed_shares, mask_shares)| SecAggMessage::Unmasked {
                round,
                device,
                response: fedpo_secagg::UnmaskResponse { from, seed_shares, mask_shares }
            }
        ),
    ]
}

proptest! {
    #[test]
    fn every_message_type_round_trips_through_cbor(msg in arb_message()) {
        let bytes = msg.encode();
        prop_assert_eq!(Message::decode(&bytes, &Limits::default()).unwrap(), msg);
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = Message::decode(&bytes, &Limits::default());
        let _ = TensorPayload::from_bytes(&bytes, &Limits::default(), true);
    }
}

#[test]
fn oversized_message_is_refused_before_parsing() {
    let limits = Limits { max_message_bytes: 100, ..Limits::default() };
    let err = Message::decode(&[0u8; 101], &limits).unwrap_err();
    assert_eq!(err, WireError::MessageTooLarge { size: 101, max: 100 });
    assert!(err.to_string().contains("100"));
}

#[test]
fn unknown_protocol_version_is_refused_naming_both_versions() {
    #[derive(serde::Serialize)]
    struct Future {
        version: u16,
        message: Message,
    }
    let hello = Message::Hello(DeviceHello {
        device: "d".into(),
        pairs: 1,
        backend: "cpu".into(),
        memory_mb: 1,
        instance: 1,
        connection: 1,
        model: Vec::new(),
        tag: Vec::new(),
    });
    let bytes = serde_cbor::to_vec(&Future { version: 9, message: hello }).unwrap();
    let err = Message::decode(&bytes, &Limits::default()).unwrap_err();
    assert_eq!(err, WireError::UnsupportedVersion { found: 9, supported: PROTOCOL_VERSION });
}

#[test]
fn manifest_announcing_more_than_the_transfer_limit_is_refused() {
    let limits = Limits { max_transfer_bytes: 1 << 20, ..Limits::default() };
    let msg = Message::Update(Update {
        round: 1,
        device: "d".into(),
        pairs: 1,
        metrics: UpdateMetrics {
            train_loss: 0.5,
            reward_acc: 0.5,
            heldout_acc: None,
            grad_norm: 1.0,
            seconds: 1.0,
            peak_rss_mib: None,
        },
        update: manifest("r1/d", 2 << 20, 2),
        sections: Default::default(),
    });
    let err = Message::decode(&msg.encode(), &limits).unwrap_err();
    assert!(matches!(err, WireError::TransferTooLarge { size, max } if size == 2 << 20 && max == 1 << 20), "{err}");
}

#[test]
fn plan_with_non_finite_learning_rate_is_refused() {
    let msg = Message::Plan(RoundPlan {
        round: 1,
        selected: vec![],
        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 1, lr: f64::NAN, beta: 0.2, batch_pairs: 4 },
        strategy: BTreeMap::new(),
        model_spec: String::new(),
        global_model: manifest("r1/global", 4, 1),
        sections: Default::default(),
        signature: Vec::new(),
        secagg: None,
        update_codec: Default::default(),
        downlink: None,
        sender_epoch: 0,
        job: "lab".into(),
        run: 1,
    });
    let err = Message::decode(&msg.encode(), &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("lr"), "{err}");
}

#[test]
fn plan_with_an_oversized_model_spec_is_refused_naming_the_field() {
    let msg = Message::Plan(RoundPlan {
        round: 1,
        selected: vec![],
        hyper: Hyperparameters { method: "pfeddpo".into(), local_steps: 1, lr: 0.1, beta: 0.2, batch_pairs: 4 },
        strategy: BTreeMap::new(),
        model_spec: "x".repeat(100 << 10),
        global_model: manifest("r1/global", 4, 1),
        sections: Default::default(),
        signature: Vec::new(),
        secagg: None,
        update_codec: Default::default(),
        downlink: None,
        sender_epoch: 0,
        job: "lab".into(),
        run: 1,
    });
    let err = Message::decode(&msg.encode(), &Limits::default()).unwrap_err().to_string();
    assert!(err.contains("model_spec") && err.contains("65536"), "{err}");
}

#[test]
fn chunk_index_past_its_count_is_refused() {
    let msg = Message::Chunk(TransferChunk { transfer: "t".into(), index: 3, count: 3, bytes: vec![1].into() });
    assert!(matches!(Message::decode(&msg.encode(), &Limits::default()), Err(WireError::BadChunk { .. })));
}

proptest! {
    #[test]
    fn a_chunk_encoded_from_a_borrow_is_the_same_bytes_as_the_message(
        transfer in name(), index in 0u32..500, extra in 1u32..500, bytes in proptest::collection::vec(any::<u8>(), 0..2048)
    ) {
        let chunk = TransferChunk { transfer, index, count: index + extra, bytes: bytes.into() };
        let borrowed = Message::encode_chunk(&chunk);
        prop_assert_eq!(&borrowed, &Message::Chunk(chunk.clone()).encode());
        prop_assert_eq!(Message::decode(&borrowed, &Limits::default()).unwrap(), Message::Chunk(chunk));
    }

    #[test]
    fn a_chunk_decoded_in_place_is_the_decoded_chunk_with_its_bytes_left_in_the_message(
        transfer in name(), index in 0u32..500, extra in 1u32..500, bytes in proptest::collection::vec(any::<u8>(), 1..2048)
    ) {
        let chunk = TransferChunk { transfer, index, count: index + extra, bytes: bytes.into() };
        let received = Bytes::from(Message::encode_chunk(&chunk));
        let decoded = Message::decode_shared(&received, &Limits::default()).unwrap();
        let Message::Chunk(c) = &decoded else { panic!("not a chunk: {decoded:?}") };
        let (inside, at) = (received.as_ptr_range(), c.bytes.as_ptr_range());
        prop_assert!(inside.start <= at.start && at.end <= inside.end, "the chunk's bytes were copied");
        prop_assert_eq!(decoded, Message::Chunk(chunk));
    }
}

#[test]
fn decoding_in_place_refuses_and_accepts_what_decoding_does() {
    let limits = Limits::default();
    let bad_index = Message::Chunk(TransferChunk { transfer: "t".into(), index: 3, count: 3, bytes: vec![1].into() });
    let hello = Message::Hello(DeviceHello {
        device: "dev-0".into(),
        pairs: 8,
        backend: "cpu".into(),
        memory_mb: 512,
        instance: 1,
        connection: 1,
        model: Vec::new(),
        tag: Vec::new(),
    });
    let chunk =
        Message::Chunk(TransferChunk { transfer: "r1/global".into(), index: 0, count: 1, bytes: vec![9; 10].into() });
    let chunk_bytes = chunk.encode();
    for message in [bad_index, hello, chunk] {
        let bytes = message.encode();
        assert_eq!(Message::decode_shared(&bytes.clone().into(), &limits), Message::decode(&bytes, &limits));
    }
    // A chunk from another protocol version is refused by name, not decoded.
    let mut envelope: serde_cbor::Value = serde_cbor::from_slice(&chunk_bytes).unwrap();
    let serde_cbor::Value::Map(fields) = &mut envelope else { panic!("an envelope is a map") };
    fields.insert(
        serde_cbor::Value::Text("version".into()),
        serde_cbor::Value::Integer(i128::from(PROTOCOL_VERSION) + 1),
    );
    let other = Bytes::from(serde_cbor::to_vec(&envelope).unwrap());
    assert_eq!(
        Message::decode_shared(&other, &limits),
        Err(WireError::UnsupportedVersion { found: PROTOCOL_VERSION + 1, supported: PROTOCOL_VERSION })
    );
    let small = Limits { max_message_bytes: 4, ..Limits::default() };
    assert!(matches!(
        Message::decode_shared(&Bytes::from(vec![0u8; 5]), &small),
        Err(WireError::MessageTooLarge { size: 5, max: 4 })
    ));
}

#[test]
fn a_goodbye_or_decline_with_a_long_reason_is_cut_to_what_receivers_accept() {
    let limits = Limits::default();
    // Multi-byte characters straddle the cut: it must fall on a character boundary.
    let long = format!("--max-memory 1000 MiB cannot hold this training: {}", "é".repeat(400));
    let raw =
        Message::Bye(DeviceBye { device: "pi-4".into(), reason: long.clone(), instance: 0, tag: Vec::new() }).encode();
    assert!(Message::decode(&raw, &limits).is_err(), "an uncut reason is refused by the receiver");
    for msg in [Message::Bye(DeviceBye::new("pi-4", &long)), Message::Declined(RoundDeclined::new("pi-4", 3, &long))] {
        let reason = match Message::decode(&msg.encode(), &limits).expect("decodes") {
            Message::Bye(b) => b.reason,
            Message::Declined(d) => d.reason,
            other => panic!("{other:?}"),
        };
        assert!(reason.len() <= limits.max_name_len && reason.ends_with('…'), "{} bytes", reason.len());
        assert!(long.starts_with(reason.trim_end_matches('…')));
    }
    let short = DeviceBye::new("pi-4", "done");
    assert_eq!(short.reason, "done", "a reason that fits is kept whole");
}

#[test]
fn a_last_will_survives_the_wire_as_not_deliberate_and_a_devices_own_goodbye_as_deliberate() {
    let limits = Limits::default();
    let decoded = |bye: DeviceBye| match Message::decode(&Message::Bye(bye).encode(), &limits).expect("decodes") {
        Message::Bye(b) => b,
        other => panic!("{other:?}"),
    };
    assert!(!decoded(DeviceBye::last_will("pi-4")).is_deliberate());
    assert!(decoded(DeviceBye::new("pi-4", "round 1: --max-memory 40 MiB cannot hold this training")).is_deliberate());
    assert!(decoded(DeviceBye::new("pi-4", "done")).is_deliberate());
}

#[test]
fn a_manifest_must_announce_exactly_the_chunks_its_bytes_take() {
    let limits = Limits::default();
    let mib = 1u64 << 20;
    assert!(manifest("r1/dev-0", 3 * mib, 3).validate(&limits).is_ok());
    assert!(manifest("r1/dev-0", 3 * mib + 4, 4).validate(&limits).is_ok());
    assert!(manifest("r1/dev-0", 0, 1).validate(&limits).is_ok(), "an empty transfer is one empty chunk");
    for (bytes, chunks) in [(3 * mib, 2), (3 * mib, 4), (4, u32::MAX), (0, 0)] {
        let err = manifest("r1/dev-0", bytes, chunks).validate(&limits).unwrap_err().to_string();
        assert!(err.contains("chunks") && err.contains(&chunks.to_string()), "{bytes} bytes, {chunks} chunks: {err}");
    }
}

#[test]
fn a_result_beyond_the_highest_round_is_refused_as_it_is_decoded() {
    let at_limit = Message::Result(RoundResult { round: fedpo_wire::MAX_ROUND, ..RoundResult::default() });
    assert!(Message::decode(&at_limit.encode(), &Limits::default()).is_ok());
    let beyond = Message::Result(RoundResult { round: fedpo_wire::MAX_ROUND + 1, ..RoundResult::default() });
    let e = Message::decode(&beyond.encode(), &Limits::default()).unwrap_err().to_string();
    assert!(e.contains("round") && e.contains("beyond the highest round"), "{e}");
}
