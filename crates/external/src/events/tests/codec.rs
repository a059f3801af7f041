//! Tests of the engine event codec: both wire shapes, golden bytes, older schemas, malformed
//! input.

use super::*;

fn sample_batch(bytes_hashes: bool) -> EngineBatch {
    let hash = |v: i64| {
        if bytes_hashes {
            EngineHash::Bytes(v.to_be_bytes().to_vec())
        } else {
            EngineHash::Int(v)
        }
    };
    EngineBatch {
        ts: 1_722_000_000.125,
        events: vec![
            EngineEvent::BlockStored {
                block_hashes: vec![hash(-5), hash(i64::MAX), EngineHash::Uint(u64::MAX)],
                parent_block_hash: Some(hash(-300_000)),
                token_ids: (0..48).map(|t| t * 70_000).collect(),
                block_size: 16,
                lora_id: Some(3),
                medium: Some("GPU".into()),
                lora_name: Some("a-lora-name-that-is-longer-than-31-bytes".into()),
                extra_keys: Some(vec![
                    Some(vec![
                        Value::from("salt"),
                        Value::Array(vec![Value::from("mm"), Value::from(-1)]),
                        Value::Binary(vec![0; 300]),
                        Value::F64(0.5),
                        Value::Boolean(true),
                        Value::Nil,
                    ]),
                    None,
                    None,
                ]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                kv_cache_spec_sliding_window: Some(4096),
            },
            EngineEvent::BlockStored {
                block_hashes: vec![hash(1)],
                parent_block_hash: None,
                token_ids: vec![1; 16],
                block_size: 16,
                lora_id: None,
                medium: None,
                lora_name: None,
                extra_keys: None,
                group_idx: None,
                kv_cache_spec_kind: None,
                kv_cache_spec_sliding_window: None,
            },
            EngineEvent::BlockRemoved {
                block_hashes: (0..20).map(hash).collect(),
                medium: Some("CPU".into()),
                group_idx: Some(1),
            },
            EngineEvent::BlockRemoved {
                block_hashes: vec![],
                medium: None,
                group_idx: None,
            },
            EngineEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    }
}

#[test]
fn both_shapes_round_trip() {
    for shape in [WireShape::ArrayLike, WireShape::Map] {
        for bytes_hashes in [false, true] {
            let batch = sample_batch(bytes_hashes);
            let encoded = encode_batch(&batch, shape);
            assert_eq!(decode_batch(&encoded).unwrap(), batch, "{shape:?}");
        }
    }
    let no_rank = EngineBatch {
        data_parallel_rank: None,
        ..sample_batch(false)
    };
    for shape in [WireShape::ArrayLike, WireShape::Map] {
        assert_eq!(
            decode_batch(&encode_batch(&no_rank, shape)).unwrap(),
            no_rank
        );
    }
}

/// A fixstr (the spec's `101xxxxx` head), for readable golden bytes.
fn fixstr(s: &str) -> Vec<u8> {
    assert!(s.len() < 32);
    let mut out = vec![0xa0 | s.len() as u8];
    out.extend_from_slice(s.as_bytes());
    out
}

fn golden_array() -> (EngineBatch, Vec<u8>) {
    let batch = EngineBatch {
        ts: 1.5,
        events: vec![
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash::Int(-1), EngineHash::Uint(u64::MAX)],
                medium: Some("GPU".into()),
                group_idx: None,
            },
            EngineEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    };
    let mut b = vec![0x93]; // fixarray(3): ts, events, data_parallel_rank
    b.extend([0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]); // float64 1.5
    b.push(0x92); // 2 events
    b.push(0x94); // BlockRemoved: tag + 3 fields, defaults written
    b.extend(fixstr("BlockRemoved"));
    b.extend([0x92, 0xff, 0xcf]); // [-1 (negative fixint), uint64 ...
    b.extend([0xff; 8]); // ... 2^64 - 1]
    b.extend(fixstr("GPU"));
    b.push(0xc0); // group_idx nil
    b.push(0x91); // AllBlocksCleared: tag only
    b.extend(fixstr("AllBlocksCleared"));
    b.push(0x00); // data_parallel_rank 0
    (batch, b)
}

fn golden_map() -> (EngineBatch, Vec<u8>) {
    let batch = EngineBatch {
        ts: 1.5,
        events: vec![EngineEvent::BlockStored {
            block_hashes: vec![EngineHash::Bytes(vec![0xab, 0xcd])],
            parent_block_hash: Some(EngineHash::Int(300)),
            token_ids: vec![1, 2],
            block_size: 2,
            lora_id: None,
            medium: Some("CPU".into()),
            lora_name: None,
            extra_keys: Some(vec![Some(vec![Value::from("s")])]),
            group_idx: Some(0),
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }],
        data_parallel_rank: None,
    };
    let mut b = vec![0x82]; // fixmap(2): data_parallel_rank None omitted
    b.extend(fixstr("ts"));
    b.extend([0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0]);
    b.extend(fixstr("events"));
    b.push(0x91);
    b.push(0x8a); // fixmap(10): type + 7 required + extra_keys + group_idx
    b.extend(fixstr("type"));
    b.extend(fixstr("BlockStored"));
    b.extend(fixstr("block_hashes"));
    b.extend([0x91, 0xc4, 0x02, 0xab, 0xcd]); // [bin8 of 2 bytes]
    b.extend(fixstr("parent_block_hash"));
    b.extend([0xcd, 0x01, 0x2c]); // uint16 300
    b.extend(fixstr("token_ids"));
    b.extend([0x92, 0x01, 0x02]);
    b.extend(fixstr("block_size"));
    b.push(0x02);
    b.extend(fixstr("lora_id"));
    b.push(0xc0);
    b.extend(fixstr("medium"));
    b.extend(fixstr("CPU"));
    b.extend(fixstr("lora_name"));
    b.push(0xc0);
    b.extend(fixstr("extra_keys"));
    b.extend([0x91, 0x91]); // [("s",)]
    b.extend(fixstr("s"));
    b.extend(fixstr("group_idx"));
    b.push(0x00);
    (batch, b)
}

#[test]
fn golden_bytes_from_the_msgpack_spec() {
    for (batch, bytes) in [golden_array(), golden_map()] {
        let shape = if bytes[0] == 0x93 {
            WireShape::ArrayLike
        } else {
            WireShape::Map
        };
        assert_eq!(encode_batch(&batch, shape), bytes, "{shape:?}");
        assert_eq!(decode_batch(&bytes).unwrap(), batch);
    }
}

#[test]
fn older_schemas_and_mixed_shapes_decode() {
    // SGLang / first vLLM: [ts, events], BlockStored(hashes, parent, tokens, size, lora_id),
    // BlockRemoved(hashes).
    let mut b = vec![0x92, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x92];
    b.push(0x96);
    b.extend(fixstr("BlockStored"));
    b.extend([0x91, 0xd3]); // [int64 -2^63]
    b.extend(i64::MIN.to_be_bytes());
    b.extend([0x05, 0x92, 0x01, 0x02, 0x02, 0x07]); // parent 5, tokens, size 2, lora_id 7
    b.push(0x92);
    b.extend(fixstr("BlockRemoved"));
    b.extend([0x91, 0x05]);
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.data_parallel_rank, None);
    assert_eq!(
        batch.events[0],
        EngineEvent::BlockStored {
            block_hashes: vec![EngineHash::Int(i64::MIN)],
            parent_block_hash: Some(EngineHash::Int(5)),
            token_ids: vec![1, 2],
            block_size: 2,
            lora_id: Some(7),
            medium: None,
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    );
    assert_eq!(batch.events[1], removed(&[5], None));

    // A positional batch around map events, keys out of order, unknown keys and positions.
    let mut b = vec![0x94, 0x01, 0x91]; // [ts as int, [event], rank, extra]
    b.push(0x86);
    b.extend(fixstr("cache_salt"));
    b.extend(fixstr("ignored"));
    b.extend(fixstr("block_size"));
    b.push(0x01);
    b.extend(fixstr("token_ids"));
    b.extend([0x91, 0x09]);
    b.extend(fixstr("parent_block_hash"));
    b.push(0xc0);
    b.extend(fixstr("type"));
    b.extend(fixstr("BlockStored"));
    b.extend(fixstr("block_hashes"));
    b.extend([0x91, 0x2a]);
    b.extend([0x03, 0x81, 0xa1, b'k', 0x90]); // rank 3, an unknown trailing element
    let batch = decode_batch(&b).unwrap();
    assert_eq!(batch.ts, 1.0);
    assert_eq!(batch.data_parallel_rank, Some(3));
    assert_eq!(batch.events, vec![stored(&[42], None, &[9], 1)]);
}

#[test]
fn malformed_batches_are_typed_errors() {
    use super::super::EventsError;
    let schema = |b: &[u8]| matches!(decode_batch(b), Err(EventsError::Schema { .. }));
    let msgpack = |b: &[u8]| matches!(decode_batch(b), Err(EventsError::Msgpack { .. }));
    assert!(msgpack(&[]));
    assert!(msgpack(&[0x92, 0xcb, 0x3f]));
    assert!(msgpack(&[0xc1]));
    assert!(schema(&[0xc0]));
    assert!(schema(&[0x91, 0x00]));
    // Trailing bytes after a valid batch.
    let mut b = encode_batch(&golden_array().0, WireShape::ArrayLike);
    b.push(0);
    assert!(msgpack(&b));
    // A map event without its parent field must not become a sequence start.
    let mut b = vec![0x92, 0x00, 0x91, 0x84];
    b.extend(fixstr("type"));
    b.extend(fixstr("BlockStored"));
    b.extend(fixstr("block_hashes"));
    b.push(0x90);
    b.extend(fixstr("token_ids"));
    b.push(0x90);
    b.extend(fixstr("block_size"));
    b.push(0x01);
    assert!(schema(&b));
    // A token id over 2^32.
    let mut b = vec![0x92, 0x00, 0x91, 0x95];
    b.extend(fixstr("BlockStored"));
    b.extend([0x90, 0xc0, 0x91, 0xcf, 0, 0, 0, 1, 0, 0, 0, 0, 0x01]);
    assert!(schema(&b));
    // Invalid UTF-8 in a tag.
    assert!(msgpack(&[0x92, 0x00, 0x91, 0x91, 0xa1, 0xff]));
    // A lying array length reserves nothing and fails cleanly.
    assert!(msgpack(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]));
    // An unknown event class is kept, not an error.
    let mut b = vec![0x92, 0x00, 0x91, 0x92];
    b.extend(fixstr("BlockTouched"));
    b.push(0x07);
    assert_eq!(
        decode_batch(&b).unwrap().events,
        vec![EngineEvent::Unknown {
            tag: "BlockTouched".into()
        }]
    );
    let too_big = vec![0u8; super::super::MAX_PAYLOAD_BYTES + 1];
    assert!(matches!(
        decode_batch(&too_big),
        Err(EventsError::TooLarge { .. })
    ));
}

#[test]
fn garbage_never_panics() {
    let mut rng = Rng::seed_from_u64(0x5eed);
    let valid: Vec<Vec<u8>> = [WireShape::ArrayLike, WireShape::Map]
        .iter()
        .flat_map(|&s| {
            [
                encode_batch(&sample_batch(false), s),
                encode_batch(&sample_batch(true), s),
            ]
        })
        .chain([golden_array().1, golden_map().1])
        .collect();
    let mut mirror = KvMirror::new(W, bs(16));
    let mut decoded = 0;
    for i in 0..20_000 {
        let mut bytes = if i % 4 == 0 {
            (0..rng.below(64)).map(|_| rng.next_u64() as u8).collect()
        } else {
            valid[rng.below(valid.len())].clone()
        };
        match rng.below(4) {
            0 if !bytes.is_empty() => {
                let cut = rng.below(bytes.len());
                bytes.truncate(cut);
            }
            1 | 2 if !bytes.is_empty() => {
                for _ in 0..=rng.below(4) {
                    let at = rng.below(bytes.len());
                    bytes[at] = rng.next_u64() as u8;
                }
            }
            _ => {}
        }
        if let Ok(batch) = decode_batch(&bytes) {
            decoded += 1;
            for e in &batch.events {
                mirror.apply(e);
            }
        }
    }
    assert!(decoded > 100, "mutations should leave some batches valid");
    let _ = mirror.dump();
}
