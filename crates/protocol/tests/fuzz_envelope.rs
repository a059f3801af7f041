//! Fuzzing the event plane's envelope decoder (`codec.rs`, [`Envelope::decode`]) with
//! proptest, for every type that travels in it here: `Vec<KvEvent>`, [`KvDump`],
//! [`LoadReport`], [`WorkerRecord`] (the router's `SyncMessage` has its own target in
//! `crates/router/tests/fuzz_sync.rs`).
//!
//! Properties:
//! - a valid encoding round-trips;
//! - arbitrary bytes, bare or behind a valid header of every kind, never panic;
//! - mutated valid encodings (bit flips, byte writes, truncation, extension, insertion,
//!   removal, and huge varint lengths spliced in) never panic, and whatever still decodes
//!   re-encodes to itself;
//! - a length prefix claiming up to 2^64 elements or bytes is an error, whatever the type
//!   (bincode's `with_limit` bounds every claim by the 64 MiB body limit before it reserves).
//!
//! Case counts are small by default (CI); `PROPTEST_CASES=200000` runs a long campaign.

use proptest::prelude::*;
use proptest::sample::Index;

use tandem_protocol::{
    BlockSize, CodecError, Envelope, KvDump, KvEvent, KvEventKind, LoadReport, LocalBlockHash,
    MessageKind, SequenceHash, StorageTier, StoredBlock, TierCapacity, WorkerAddresses, WorkerId,
    WorkerRecord, WorkerRole,
};

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

// --- values -----------------------------------------------------------------------------

fn tier() -> impl Strategy<Value = StorageTier> {
    prop_oneof![
        Just(StorageTier::Device),
        Just(StorageTier::Host),
        Just(StorageTier::Disk)
    ]
}

fn stored_block() -> impl Strategy<Value = StoredBlock> {
    (any::<u64>(), any::<u64>()).prop_map(|(s, l)| StoredBlock {
        sequence_hash: SequenceHash(s),
        local_hash: LocalBlockHash(l),
    })
}

fn event_kind() -> impl Strategy<Value = KvEventKind> {
    prop_oneof![
        (
            proptest::option::of(any::<u64>().prop_map(SequenceHash)),
            proptest::collection::vec(stored_block(), 0..12)
        )
            .prop_map(|(parent, blocks)| KvEventKind::Stored { parent, blocks }),
        proptest::collection::vec(any::<u64>().prop_map(SequenceHash), 0..12)
            .prop_map(|blocks| KvEventKind::Removed { blocks }),
        Just(KvEventKind::Cleared),
    ]
}

fn event() -> impl Strategy<Value = KvEvent> {
    (any::<u64>(), any::<u64>(), tier(), event_kind()).prop_map(|(worker, event_id, tier, kind)| {
        KvEvent {
            worker_id: WorkerId(worker),
            event_id,
            tier,
            kind,
        }
    })
}

fn events() -> impl Strategy<Value = Vec<KvEvent>> {
    proptest::collection::vec(event(), 0..8)
}

fn dump() -> impl Strategy<Value = KvDump> {
    (any::<u64>(), any::<u64>(), events()).prop_map(|(w, last, events)| KvDump {
        worker_id: WorkerId(w),
        last_event_id: last,
        events,
    })
}

fn load_report() -> impl Strategy<Value = LoadReport> {
    (
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<[u64; 4]>(),
        any::<[u64; 3]>(),
        (any::<u32>(), proptest::collection::vec(".{0,24}", 0..4)),
    )
        .prop_map(
            |(w, ts, running, waiting, [p, a, t, last], [pt, dt, busy], (max, resident))| {
                LoadReport {
                    worker_id: WorkerId(w),
                    timestamp_ms: ts,
                    running_requests: running,
                    waiting_requests: waiting,
                    pending_prefill_tokens: p,
                    kv_active_blocks: a,
                    kv_total_blocks: t,
                    last_kv_event_id: last,
                    prefill_tokens_total: pt,
                    decode_tokens_total: dt,
                    busy_us_total: busy,
                    adapters: tandem_protocol::AdapterLoad {
                        max_loaded: max,
                        resident,
                    },
                }
            },
        )
}

fn worker_record() -> impl Strategy<Value = WorkerRecord> {
    let role = prop_oneof![
        Just(WorkerRole::Prefill),
        Just(WorkerRole::Decode),
        Just(WorkerRole::Aggregated)
    ];
    (
        any::<u64>(),
        role,
        ".{0,24}",
        1u32..,
        any::<[u64; 3]>(),
        ".{0,24}",
        proptest::option::of(".{0,24}"),
        any::<[bool; 2]>(),
    )
        .prop_map(
            |(id, role, model, bs, [d, h, k], grpc, kv_transfer, [kv_events, takes_text])| {
                WorkerRecord {
                    id: WorkerId(id),
                    role,
                    model,
                    block_size: BlockSize::new(bs).expect("non-zero"),
                    kv_capacity: TierCapacity {
                        device_blocks: d,
                        host_blocks: h,
                        disk_blocks: k,
                    },
                    addresses: WorkerAddresses {
                        grpc,
                        kv_transfer,
                        metrics: None,
                        http: None,
                    },
                    kv_events,
                    placement: Default::default(),
                    takes_text,
                }
            },
        )
}

// --- mutations --------------------------------------------------------------------------

/// Bincode (standard config) varint length prefixes that claim far more than any body holds.
const HUGE: [u64; 8] = [
    1 << 60,
    u64::MAX,
    u32::MAX as u64,
    (64 << 20) - 1,
    64 << 20,
    1 << 26,
    1 << 40,
    usize::MAX as u64 / 16 + 1,
];

fn varint(v: u64) -> Vec<u8> {
    match v {
        0..=250 => vec![v as u8],
        251..=0xffff => [&[251u8][..], &(v as u16).to_le_bytes()].concat(),
        0x1_0000..=0xffff_ffff => [&[252u8][..], &(v as u32).to_le_bytes()].concat(),
        _ => [&[253u8][..], &v.to_le_bytes()].concat(),
    }
}

/// One edit of an encoding.
#[derive(Clone, Debug)]
enum Op {
    FlipBit(Index, u8),
    SetByte(Index, u8),
    Truncate(Index),
    Extend(Vec<u8>),
    Insert(Index, Vec<u8>),
    Remove(Index, u8),
    /// A huge varint (one of [`HUGE`]) written over the bytes at the index.
    HugeLen(Index, Index),
    /// The same, inserted.
    InsertHugeLen(Index, Index),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Op::FlipBit(i, b)),
        3 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Op::SetByte(i, b)),
        1 => any::<Index>().prop_map(Op::Truncate),
        1 => proptest::collection::vec(any::<u8>(), 1..16).prop_map(Op::Extend),
        1 => (any::<Index>(), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Op::Insert(i, b)),
        1 => (any::<Index>(), 1u8..16).prop_map(|(i, n)| Op::Remove(i, n)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(i, h)| Op::HugeLen(i, h)),
        2 => (any::<Index>(), any::<Index>()).prop_map(|(i, h)| Op::InsertHugeLen(i, h)),
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    proptest::collection::vec(op(), 1..5)
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
            Op::Remove(i, n) if len > 0 => {
                let at = i.index(len);
                let end = (at + usize::from(*n)).min(len);
                bytes.drain(at..end);
            }
            Op::HugeLen(i, h) if len > 0 => {
                let at = i.index(len);
                let v = varint(HUGE[h.index(HUGE.len())]);
                let end = (at + v.len()).min(len);
                bytes.splice(at..end, v);
            }
            Op::InsertHugeLen(i, h) => {
                let at = i.index(len + 1);
                bytes.splice(at..at, varint(HUGE[h.index(HUGE.len())]));
            }
            _ => {}
        }
    }
}

/// Decodes `bytes` as `T`; when that succeeds, the value re-encodes to bytes that decode to
/// it again (a decoder that accepts something must accept its own encoding of it).
fn decode_checked<T: Envelope + PartialEq + std::fmt::Debug>(bytes: &[u8]) -> Option<T> {
    let value = T::decode(bytes).ok()?;
    let again = value.encode().expect("a decoded value encodes");
    assert_eq!(
        T::decode(&again).as_ref(),
        Ok(&value),
        "re-encoding round trip"
    );
    Some(value)
}

/// Every decoder on the same bytes: only one kind can match the header.
fn decode_all(bytes: &[u8]) -> usize {
    usize::from(decode_checked::<Vec<KvEvent>>(bytes).is_some())
        + usize::from(decode_checked::<KvDump>(bytes).is_some())
        + usize::from(decode_checked::<LoadReport>(bytes).is_some())
        + usize::from(decode_checked::<WorkerRecord>(bytes).is_some())
}

const KINDS: [MessageKind; 6] = [
    MessageKind::KvEvents,
    MessageKind::KvDump,
    MessageKind::LoadReport,
    MessageKind::WorkerRecord,
    MessageKind::RouterSync,
    MessageKind::RouterHello,
];

fn header(kind: u16, version: u16) -> Vec<u8> {
    let mut h = b"TDM1".to_vec();
    h.extend_from_slice(&version.to_le_bytes());
    h.extend_from_slice(&kind.to_le_bytes());
    h
}

// --- properties -------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn valid_encodings_round_trip(
        ev in events(),
        d in dump(),
        r in load_report(),
        w in worker_record(),
    ) {
        prop_assert_eq!(Vec::<KvEvent>::decode(&ev.encode().unwrap()), Ok(ev));
        prop_assert_eq!(KvDump::decode(&d.encode().unwrap()), Ok(d));
        prop_assert_eq!(LoadReport::decode(&r.encode().unwrap()), Ok(r));
        prop_assert_eq!(WorkerRecord::decode(&w.encode().unwrap()), Ok(w));
    }
}

proptest! {
    #![proptest_config(config(2048))]

    #[test]
    fn arbitrary_bytes_never_panic(
        body in proptest::collection::vec(any::<u8>(), 0..256),
        kind in 0usize..KINDS.len() + 1,
        version in prop_oneof![Just(0u16), Just(1), any::<u16>()],
    ) {
        // Bare, then behind a header of each kind (and an unknown kind 0 / 6..).
        prop_assert!(decode_all(&body) <= 1);
        let kind = KINDS.get(kind).map_or(0, |k| *k as u16);
        let mut framed = header(kind, version);
        framed.extend_from_slice(&body);
        prop_assert!(decode_all(&framed) <= 1);
    }

    #[test]
    fn mutated_events_never_panic(ev in events(), ops in ops()) {
        let mut bytes = ev.encode().unwrap();
        apply(&mut bytes, &ops);
        prop_assert!(decode_all(&bytes) <= 1);
    }

    #[test]
    fn mutated_dumps_never_panic(d in dump(), ops in ops()) {
        let mut bytes = d.encode().unwrap();
        apply(&mut bytes, &ops);
        prop_assert!(decode_all(&bytes) <= 1);
    }

    #[test]
    fn mutated_load_reports_never_panic(r in load_report(), ops in ops()) {
        let mut bytes = r.encode().unwrap();
        apply(&mut bytes, &ops);
        prop_assert!(decode_all(&bytes) <= 1);
    }

    #[test]
    fn mutated_worker_records_never_panic(w in worker_record(), ops in ops()) {
        let mut bytes = w.encode().unwrap();
        apply(&mut bytes, &ops);
        prop_assert!(decode_all(&bytes) <= 1);
    }

    /// A valid body under another kind's header is a typed `WrongKind`, never a misread.
    #[test]
    fn another_kind_is_refused(ev in events(), r in load_report()) {
        let wrong = |e: Result<(), CodecError>| matches!(e, Err(CodecError::WrongKind { .. }));
        let ev = ev.encode().unwrap();
        prop_assert!(wrong(LoadReport::decode(&ev).map(drop)));
        prop_assert!(wrong(KvDump::decode(&ev).map(drop)));
        let r = r.encode().unwrap();
        prop_assert!(wrong(Vec::<KvEvent>::decode(&r).map(drop)));
        prop_assert!(wrong(WorkerRecord::decode(&r).map(drop)));
    }
}

/// Every length prefix of every message type, replaced by each huge claim: always an error,
/// never an allocation of the claimed size (which would abort the test process).
#[test]
fn huge_length_prefixes_are_errors() {
    // `Vec<KvEvent>`: the outer length is the first body byte.
    for &claim in &HUGE {
        let mut bytes = header(MessageKind::KvEvents as u16, 1);
        bytes.extend(varint(claim));
        bytes.extend([0u8; 32]);
        assert!(
            matches!(Vec::<KvEvent>::decode(&bytes), Err(CodecError::Corrupt(_))),
            "claim {claim}"
        );
    }
    // `KvDump.events`: after two varints.
    for &claim in &HUGE {
        let mut bytes = header(MessageKind::KvDump as u16, 1);
        bytes.extend([7, 9]);
        bytes.extend(varint(claim));
        assert!(
            matches!(KvDump::decode(&bytes), Err(CodecError::Corrupt(_))),
            "claim {claim}"
        );
    }
    // `WorkerRecord.model`: a string after the id and the role.
    for &claim in &HUGE {
        let mut bytes = header(MessageKind::WorkerRecord as u16, 1);
        bytes.extend([3, 1]);
        bytes.extend(varint(claim));
        bytes.extend(b"mocker");
        assert!(
            matches!(WorkerRecord::decode(&bytes), Err(CodecError::Corrupt(_))),
            "claim {claim}"
        );
    }
    // A `Stored` event's blocks: worker, id, tier, variant 0, no parent, then the length.
    for &claim in &HUGE {
        let mut bytes = header(MessageKind::KvEvents as u16, 1);
        bytes.extend([1, 7, 1, 0, 0, 0]);
        bytes.extend(varint(claim));
        assert!(
            matches!(Vec::<KvEvent>::decode(&bytes), Err(CodecError::Corrupt(_))),
            "claim {claim}"
        );
    }
}

/// A string length beyond what the body's size class allows is refused by bincode's claim
/// check, before `vec![0; len]` reserves it (`LimitExceeded`, not `UnexpectedEnd`): a
/// 20-byte message no longer makes the decoder reserve up to 64 MiB.
#[test]
fn claims_beyond_the_size_class_are_refused_before_reserving() {
    for claim in [(64 << 10) + 1, 1 << 20, 32 << 20, (64 << 20) - 64] {
        let mut bytes = header(MessageKind::WorkerRecord as u16, 1);
        bytes.extend([3, 1]);
        bytes.extend(varint(claim));
        match WorkerRecord::decode(&bytes) {
            Err(CodecError::Corrupt(why)) => assert!(why.contains("LimitExceeded"), "{why}"),
            other => panic!("claim {claim}: {other:?}"),
        }
    }
}

/// Valid messages large enough for every size class, with the most claim per wire byte
/// (small ids in one-byte varints), still decode: the limits refuse only lies.
#[test]
fn large_valid_messages_decode_in_every_size_class() {
    for n in [10, 3_000, 40_000, 700_000] {
        let events: Vec<KvEvent> = (0..n)
            .map(|i| KvEvent {
                worker_id: WorkerId(1),
                event_id: i % 200,
                tier: StorageTier::Device,
                kind: if i % 2 == 0 {
                    KvEventKind::Cleared
                } else {
                    KvEventKind::Removed {
                        blocks: vec![SequenceHash(3)],
                    }
                },
            })
            .collect();
        let bytes = events.encode().unwrap();
        assert_eq!(
            Vec::<KvEvent>::decode(&bytes).as_ref(),
            Ok(&events),
            "{n} events"
        );
    }
    for len in [100, 5_000, 100_000, 2_000_000] {
        let record = WorkerRecord {
            id: WorkerId(1),
            role: WorkerRole::Decode,
            model: "m".repeat(len),
            block_size: BlockSize::DEFAULT,
            kv_capacity: TierCapacity::default(),
            addresses: WorkerAddresses::default(),
            kv_events: true,
            placement: Default::default(),
            takes_text: false,
        };
        let bytes = record.encode().unwrap();
        assert_eq!(
            WorkerRecord::decode(&bytes),
            Ok(record),
            "model of {len} bytes"
        );
    }
}
