//! Fuzzing the decoder of router replica sync ([`SyncMessage`] in the event plane's envelope,
//! `tracker.rs`) with proptest: a valid encoding round-trips; arbitrary bytes and mutated
//! valid encodings (bit flips, byte writes, truncation, extension, huge varint lengths) never
//! panic, and what still decodes re-encodes to itself; and whatever a peer's bytes decode to,
//! the tracker that applies it does not panic.
//!
//! Case counts are small by default (CI); `PROPTEST_CASES=200000` runs a long campaign.

use proptest::prelude::*;
use proptest::sample::Index;

use tandem_protocol::{CodecError, Envelope, MessageKind, RequestId, SequenceHash, WorkerId};
use tandem_router::{ActiveSequences, RouterId, SyncMessage, TrackerConfig};

/// proptest's defaults (which read `PROPTEST_CASES`), with `cases` unless the variable is set.
fn config(cases: u32) -> ProptestConfig {
    let mut c = ProptestConfig::default();
    // A test harness switch (proptest's own variable), not configuration of tandem.
    #[allow(clippy::disallowed_methods)]
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = cases;
    }
    c
}

/// u64 fields: small values (ids that collide), and the extremes.
fn word() -> impl Strategy<Value = u64> {
    prop_oneof![
        3 => 0u64..8,
        2 => any::<u64>(),
        1 => Just(u64::MAX),
        1 => Just(1u64 << 63),
    ]
}

fn message() -> impl Strategy<Value = SyncMessage> {
    prop_oneof![
        (
            word(),
            word(),
            word(),
            proptest::collection::vec(word().prop_map(SequenceHash), 0..16),
            word(),
            word()
        )
            .prop_map(
                |(router, request, worker, blocks, prefill_tokens, private_blocks)| {
                    SyncMessage::Add {
                        router: RouterId(router),
                        request: RequestId(request),
                        worker: WorkerId(worker),
                        blocks,
                        prefill_tokens,
                        private_blocks,
                    }
                }
            ),
        (word(), word()).prop_map(|(r, q)| SyncMessage::PrefillDone {
            router: RouterId(r),
            request: RequestId(q),
        }),
        (word(), word()).prop_map(|(r, q)| SyncMessage::Free {
            router: RouterId(r),
            request: RequestId(q),
        }),
    ]
}

const HUGE: [u64; 6] = [
    1 << 60,
    u64::MAX,
    u32::MAX as u64,
    (64 << 20) - 1,
    64 << 20,
    1 << 40,
];

fn varint(v: u64) -> Vec<u8> {
    match v {
        0..=250 => vec![v as u8],
        251..=0xffff => [&[251u8][..], &(v as u16).to_le_bytes()].concat(),
        0x1_0000..=0xffff_ffff => [&[252u8][..], &(v as u32).to_le_bytes()].concat(),
        _ => [&[253u8][..], &v.to_le_bytes()].concat(),
    }
}

#[derive(Clone, Debug)]
enum Op {
    FlipBit(Index, u8),
    SetByte(Index, u8),
    Truncate(Index),
    Extend(Vec<u8>),
    Insert(Index, Vec<u8>),
    HugeLen(Index, Index),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        3 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Op::FlipBit(i, b)),
        3 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Op::SetByte(i, b)),
        1 => any::<Index>().prop_map(Op::Truncate),
        1 => proptest::collection::vec(any::<u8>(), 1..16).prop_map(Op::Extend),
        1 => (any::<Index>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Op::Insert(i, b)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(i, h)| Op::HugeLen(i, h)),
    ];
    proptest::collection::vec(op, 1..5)
}

fn apply(bytes: &mut Vec<u8>, ops: &[Op]) {
    for op in ops {
        let len = bytes.len();
        match op {
            Op::FlipBit(i, b) if len > 0 => bytes[i.index(len)] ^= 1 << b,
            Op::SetByte(i, v) if len > 0 => bytes[i.index(len)] = *v,
            Op::Truncate(i) if len > 0 => bytes.truncate(i.index(len)),
            Op::Extend(tail) => bytes.extend_from_slice(tail),
            Op::Insert(i, b) => {
                let at = i.index(len + 1);
                bytes.splice(at..at, b.iter().copied());
            }
            Op::HugeLen(i, h) => {
                let at = i.index(len + 1);
                bytes.splice(at..at, varint(HUGE[h.index(HUGE.len())]));
            }
            _ => {}
        }
    }
}

/// Decodes; a decoded message re-encodes to bytes that decode to it again.
fn decode_checked(bytes: &[u8]) -> Option<SyncMessage> {
    let msg = SyncMessage::decode(bytes).ok()?;
    let again = msg.encode().expect("a decoded message encodes");
    assert_eq!(SyncMessage::decode(&again).as_ref(), Ok(&msg));
    Some(msg)
}

fn header() -> Vec<u8> {
    let mut h = b"TDM1".to_vec();
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&(MessageKind::RouterSync as u16).to_le_bytes());
    h
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn valid_messages_round_trip(msg in message()) {
        prop_assert_eq!(SyncMessage::decode(&msg.encode().unwrap()), Ok(msg));
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..128)) {
        let _ = decode_checked(&body);
        let mut framed = header();
        framed.extend_from_slice(&body);
        let _ = decode_checked(&framed);
    }

    #[test]
    fn mutated_messages_never_panic(msg in message(), ops in ops()) {
        let mut bytes = msg.encode().unwrap();
        apply(&mut bytes, &ops);
        let _ = decode_checked(&bytes);
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// A peer's messages, valid or mutated, whatever they decode to, applied in any order:
    /// the tracker never panics and keeps its counts (freeing everything empties them).
    /// (It found two `Add`s whose `prefill_tokens` summed past `u64::MAX` overflowing the
    /// tracker: peers' absurd numbers are now dropped and its sums saturate.)
    #[test]
    fn applied_peer_messages_never_panic(
        msgs in proptest::collection::vec((message(), proptest::option::of(ops())), 1..24),
    ) {
        let mut tracker = ActiveSequences::new(RouterId(u64::MAX - 7), TrackerConfig { ttl_ms: 10, tombstone_ms: 10 });
        let mut applied = Vec::new();
        for (now, (msg, ops)) in msgs.into_iter().enumerate() {
            let mut bytes = msg.encode().unwrap();
            if let Some(ops) = ops {
                apply(&mut bytes, &ops);
            }
            if let Some(msg) = decode_checked(&bytes) {
                tracker.apply(&msg, now as u64);
                applied.push(msg);
            }
        }
        for msg in &applied {
            tracker.apply(&SyncMessage::Free { router: msg.router(), request: msg.request() }, 1 << 20);
        }
        prop_assert_eq!(tracker.active_requests(), 0);
    }
}

/// Two peers' `Add`s on one worker whose prefill tokens sum past `u64::MAX`: the minimal
/// case of the finding above. Dropped, so nothing counts.
#[test]
fn huge_prefill_tokens_from_peers_do_not_panic() {
    let mut tracker = ActiveSequences::new(
        RouterId(1),
        TrackerConfig {
            ttl_ms: 1000,
            tombstone_ms: 1000,
        },
    );
    for request in 0..2 {
        let msg = SyncMessage::Add {
            router: RouterId(2),
            request: RequestId(request),
            worker: WorkerId(7),
            blocks: vec![],
            prefill_tokens: u64::MAX,
            private_blocks: 0,
        };
        let decoded = SyncMessage::decode(&msg.encode().unwrap()).unwrap();
        tracker.apply(&decoded, 0);
    }
    assert_eq!(tracker.load(WorkerId(7)).active_prefill_tokens, 0);
    assert_eq!(tracker.active_requests(), 0);
}

/// A block list claiming 2^60 hashes (or any huge count) is an error, not an allocation.
#[test]
fn huge_block_counts_are_errors() {
    for &claim in &HUGE {
        // Variant 0 (Add), router, request, worker, then the blocks' length.
        let mut bytes = header();
        bytes.extend([0, 1, 2, 3]);
        bytes.extend(varint(claim));
        bytes.extend([0u8; 16]);
        assert!(
            matches!(SyncMessage::decode(&bytes), Err(CodecError::Corrupt(_))),
            "claim {claim}"
        );
    }
}
