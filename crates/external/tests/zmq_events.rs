//! The ZMQ KV event path end to end, on loopback.
//!
//! 1. Against an independent encoder (docs/CONVENTIONS.md §13): a Python engine stand-in that defines
//!    vLLM's and SGLang's msgspec structs as they are written upstream (array-like, map, map
//!    events in a positional batch, SGLang's older schema), publishes them on a pyzmq PUB
//!    socket and serves replay like vLLM's `ZmqEventPublisher._service_replay`. Needs the zmq
//!    venv with msgspec and pyzmq (scripts/test.sh makes it); without them the tests fail.
//! 2. Rust publisher to Rust relay: a PUB drop repaired from replay, and an engine restart.
//!
//! Expected tandem hashes are computed here with `tandem_protocol::hashing`, from the tokens.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value as Json, json};
use tandem_external::events::{
    EngineBatch, EngineEvent, EngineHash, KvRelay, RelayConfig, WireShape, ZmqPublisher,
};
use tandem_protocol::hashing::{chain_sequence_hash, local_block_hash};
use tandem_protocol::{
    BlockSize, Envelope, HashSeed, KvEvent, KvEventKind, SequenceHash, StorageTier, StoredBlock,
    WorkerId,
};
use tandem_runtime::events::{EventPlane, MemoryEventPlane, Subscription};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const WORKER: WorkerId = WorkerId(42);
const BLOCK: u32 = 4;
const SUBJECT: &str = "tandem.test.kv-events";
const WAIT: Duration = Duration::from_secs(20);

fn free_port() -> u16 {
    tandem_runtime::external::free_port().expect("a free port")
}

fn endpoint(port: u16) -> String {
    format!("tcp://127.0.0.1:{port}")
}

/// Polls `cond` every 10 ms until it holds; panics with `what` after [`WAIT`].
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// --- the expected tandem side -----------------------------------------------------------------

/// Tandem's blocks for `tokens` chained onto `parent`, computed from the hashing functions.
fn chain(parent: Option<SequenceHash>, tokens: &[u32], seed: HashSeed) -> Vec<StoredBlock> {
    let mut prev = parent;
    tokens
        .chunks_exact(BLOCK as usize)
        .map(|block| {
            let local = local_block_hash(block, seed);
            let sequence = chain_sequence_hash(prev, local, seed);
            prev = Some(sequence);
            StoredBlock {
                sequence_hash: sequence,
                local_hash: local,
            }
        })
        .collect()
}

/// Tandem events published by the relay, in order.
struct Published {
    sub: Subscription,
    events: Vec<KvEvent>,
}

impl Published {
    async fn new(plane: &MemoryEventPlane) -> Published {
        Published {
            sub: plane.subscribe(SUBJECT).await.expect("subscribe"),
            events: Vec::new(),
        }
    }

    /// Reads envelopes until `n` events arrived; checks ids run 1, 2, 3, ... without holes.
    async fn until(&mut self, n: usize) -> &[KvEvent] {
        while self.events.len() < n {
            let payload = tokio::time::timeout(WAIT, self.sub.next())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "timed out waiting for {n} tandem events; got {:#?}",
                        self.events
                    )
                })
                .expect("event plane ended");
            let batch = Vec::<KvEvent>::decode(&payload).expect("a tandem event batch");
            for e in batch {
                assert_eq!(e.worker_id, WORKER);
                assert_eq!(
                    e.event_id,
                    self.events.len() as u64 + 1,
                    "ids without holes"
                );
                self.events.push(e);
            }
        }
        &self.events
    }

    fn kinds(&self) -> Vec<(StorageTier, KvEventKind)> {
        self.events
            .iter()
            .map(|e| (e.tier, e.kind.clone()))
            .collect()
    }
}

fn start_relay(
    plane: &Arc<MemoryEventPlane>,
    pub_endpoint: String,
    replay: Option<String>,
    topic: &str,
) -> (KvRelay, TaskTracker, CancellationToken) {
    let tasks = TaskTracker::new();
    let cancel = CancellationToken::new();
    let relay = KvRelay::start(
        RelayConfig {
            worker_id: WORKER,
            block_size: BlockSize::new(BLOCK).expect("block size"),
            endpoint: pub_endpoint,
            replay_endpoint: replay,
            topic: topic.to_string(),
            ring_capacity: 1024,
            events: plane.clone() as Arc<dyn EventPlane>,
            subject: SUBJECT.to_string(),
        },
        &tasks,
        cancel.clone(),
    );
    (relay, tasks, cancel)
}

async fn stop_relay(tasks: TaskTracker, cancel: CancellationToken) {
    cancel.cancel();
    tasks.close();
    tokio::time::timeout(WAIT, tasks.wait())
        .await
        .expect("relay task stops");
}

/// Publishes empty batches until the relay has received one: a SUB socket only gets what
/// is published after its subscription reached the PUB (ZeroMQ's slow joiner), so a test
/// that counts batches starts once the path is known to work end to end. Returns how many
/// it published.
async fn warm_up(relay: &KvRelay, mut publish_empty: impl AsyncFnMut()) -> u64 {
    tokio::time::timeout(WAIT, relay.wait_connected())
        .await
        .expect("relay connects to the engine's PUB socket");
    let before = relay.stats().batches;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut published = 0;
    while relay.stats().batches == before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no batch reached the relay: {:?}",
            relay.stats()
        );
        publish_empty().await;
        published += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    published
}

// --- 1. the independent encoder ---------------------------------------------------------------

// (The Python stand-in lives in `zmq_support/`.)
mod zmq_support;
use zmq_support::PyEngine;

/// The scenario's batches in the script's JSON: `A` a salted two-block root on a LoRA
/// adapter, `B` its continuation, `C` B's eviction and a new unsalted root on the base model.
/// Hashes are bytes (hex) or ints.
struct Scenario {
    bytes_hashes: bool,
    sglang: bool,
}

impl Scenario {
    fn hash(&self, v: u64) -> Json {
        if self.bytes_hashes {
            json!(format!("{:064x}", u128::from(v) * 0x1_0000_0001))
        } else {
            // Python hash()-style values: signed, some negative.
            json!((v as i64).wrapping_mul(-0x5bd1_e995))
        }
    }

    /// `A`'s seed: what the frontend seeds a request with on that salt and adapter.
    fn seed(&self) -> HashSeed {
        if self.sglang {
            // SGLang has no extra_keys nor lora_name: the LoRA id, in decimal, names the
            // adapter.
            HashSeed::for_request(None, Some("3"))
        } else {
            HashSeed::for_request(Some(b"tenant-a"), Some("sql-lora"))
        }
    }

    fn a(&self) -> Json {
        let mut e = json!({
            "type": "BlockStored", "block_hashes": [self.hash(1), self.hash(2)],
            "parent": null, "token_ids": (0..9).collect::<Vec<u32>>(), "block_size": BLOCK,
            "medium": "GPU",
        });
        if self.sglang {
            e["lora_id"] = json!(3);
        } else {
            // vLLM: one extra-key entry per block, the LoRA name on each, the cache salt
            // after it on the first (`generate_block_hash_extra_keys`).
            e["lora_name"] = json!("sql-lora");
            e["extra_keys"] = json!([["sql-lora", "tenant-a"], ["sql-lora"]]);
            e["group_idx"] = json!(0);
            e["kv_cache_spec_kind"] = json!("full_attention");
        }
        json!([e])
    }

    fn b(&self) -> Json {
        json!([{
            "type": "BlockStored", "block_hashes": [self.hash(3)], "parent": self.hash(2),
            "token_ids": [8, 9, 10, 11], "block_size": BLOCK, "medium": "GPU",
        }])
    }

    fn c(&self) -> Json {
        json!([
            {"type": "BlockRemoved", "block_hashes": [self.hash(3)], "medium": "GPU"},
            {"type": "BlockStored", "block_hashes": [self.hash(10)], "parent": null,
             "token_ids": [100, 101, 102, 103], "block_size": BLOCK, "medium": null},
        ])
    }

    fn expected_a(&self) -> Vec<StoredBlock> {
        chain(None, &(0..8).collect::<Vec<_>>(), self.seed())
    }

    fn expected_b(&self) -> Vec<StoredBlock> {
        chain(
            Some(self.expected_a()[1].sequence_hash),
            &[8, 9, 10, 11],
            self.seed(),
        )
    }

    fn expected_c(&self) -> Vec<StoredBlock> {
        chain(None, &[100, 101, 102, 103], HashSeed::UNSALTED)
    }
}

fn stored(parent: Option<SequenceHash>, blocks: Vec<StoredBlock>) -> (StorageTier, KvEventKind) {
    (StorageTier::Device, KvEventKind::Stored { parent, blocks })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_and_sglang_batches_from_msgspec_relay_with_gap_repair() {
    for shape in ["vllm-array", "vllm-map", "vllm-map-events", "sglang"] {
        let s = Scenario {
            bytes_hashes: shape.starts_with("vllm-map"),
            sglang: shape == "sglang",
        };
        let (pub_port, replay_port) = (free_port(), free_port());
        let topic = "kv-events";
        let mut engine = PyEngine::start(shape, pub_port, Some(replay_port), topic).await;
        let plane = Arc::new(MemoryEventPlane::new());
        let mut published = Published::new(&plane).await;
        let (relay, tasks, cancel) = start_relay(
            &plane,
            endpoint(pub_port),
            Some(endpoint(replay_port)),
            topic,
        );
        let warm = warm_up(&relay, async || {
            engine.publish(json!([]), false).await;
        })
        .await;
        engine.publish(s.a(), false).await;
        engine.publish(s.b(), true).await; // buffered for replay, never sent on PUB
        engine.publish(s.c(), false).await;
        let events = published.until(4).await.to_vec();
        let a = s.expected_a();
        assert_eq!(
            published.kinds(),
            vec![
                stored(None, a.clone()),
                stored(Some(a[1].sequence_hash), s.expected_b()),
                (
                    StorageTier::Device,
                    KvEventKind::Removed {
                        blocks: vec![s.expected_b()[0].sequence_hash]
                    }
                ),
                stored(None, s.expected_c()),
            ],
            "{shape}: {events:#?}"
        );
        wait_until("the relay to apply every batch", || {
            relay.stats().batches >= warm + 3
        })
        .await;
        let stats = relay.stats();
        assert!(stats.gaps_repaired >= 1, "{shape}: {stats:#?}");
        assert_eq!(stats.resets, 0, "{shape}: {stats:#?}");
        assert_eq!(stats.decode_errors, 0, "{shape}: {stats:#?}");
        assert_eq!(stats.last_event_id, 4);
        let dump = relay.dump();
        assert_eq!(dump.last_event_id, 4);
        let mut held: Vec<SequenceHash> = dump
            .events
            .iter()
            .flat_map(|e| match &e.kind {
                KvEventKind::Stored { blocks, .. } => {
                    blocks.iter().map(|b| b.sequence_hash).collect::<Vec<_>>()
                }
                other => panic!("a dump holds Stored events only, got {other:?}"),
            })
            .collect();
        held.sort();
        let mut expected = vec![
            a[0].sequence_hash,
            a[1].sequence_hash,
            s.expected_c()[0].sequence_hash,
        ];
        expected.sort();
        assert_eq!(held, expected, "{shape}");
        assert_eq!(relay.events_since(2).map(|e| e.len()), Some(2));
        stop_relay(tasks, cancel).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replay_a_gap_clears_the_relayed_state() {
    let s = Scenario {
        bytes_hashes: true,
        sglang: false,
    };
    let pub_port = free_port();
    // vLLM's default topic: "".
    let mut engine = PyEngine::start("vllm-map", pub_port, None, "").await;
    let plane = Arc::new(MemoryEventPlane::new());
    let mut published = Published::new(&plane).await;
    let (relay, tasks, cancel) = start_relay(&plane, endpoint(pub_port), None, "");
    warm_up(&relay, async || {
        engine.publish(json!([]), false).await;
    })
    .await;
    engine.publish(s.a(), false).await;
    engine.publish(s.b(), true).await;
    engine.publish(s.c(), false).await;
    published.until(3).await;
    assert_eq!(
        published.kinds(),
        vec![
            stored(None, s.expected_a()),
            // The lost continuation cannot be repaired: forget everything, go on.
            (StorageTier::Device, KvEventKind::Cleared),
            // C's removal is of a block the relay never saw; its new root is announced.
            stored(None, s.expected_c()),
        ]
    );
    let stats = relay.stats();
    assert_eq!(stats.subscriber.resets, 1, "{stats:#?}");
    assert_eq!(stats.gaps_repaired, 0);
    assert_eq!(stats.unknown_removed, 1);
    let dump = relay.dump();
    assert_eq!(dump.last_event_id, 3);
    assert_eq!(dump.events.len(), 1);
    assert_eq!(dump.events[0].kind, stored(None, s.expected_c()).1);
    stop_relay(tasks, cancel).await;
}

// --- 2. Rust publisher to Rust relay ----------------------------------------------------------

/// The scenario's batches as Rust values (same tokens and salts as [`Scenario`]).
fn rust_batches(shape: WireShape) -> [EngineBatch; 3] {
    let hash = |v: u64| match shape {
        WireShape::Map => EngineHash::Bytes([v.to_be_bytes(); 4].concat()),
        WireShape::ArrayLike => EngineHash::Int((v as i64).wrapping_mul(-0x5bd1_e995)),
    };
    let block = |hashes: Vec<EngineHash>, parent, tokens: Vec<u32>, medium: Option<&str>| {
        EngineEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: BLOCK,
            lora_id: None,
            medium: medium.map(str::to_string),
            lora_name: None,
            extra_keys: None,
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
        }
    };
    let mut a = block(vec![hash(1), hash(2)], None, (0..9).collect(), Some("GPU"));
    if let EngineEvent::BlockStored {
        extra_keys,
        lora_name,
        ..
    } = &mut a
    {
        *lora_name = Some("sql-lora".into());
        *extra_keys = Some(vec![
            Some(vec!["sql-lora".into(), "tenant-a".into()]),
            Some(vec!["sql-lora".into()]),
        ]);
    }
    let b = block(
        vec![hash(3)],
        Some(hash(2)),
        vec![8, 9, 10, 11],
        Some("GPU"),
    );
    let c = vec![
        EngineEvent::BlockRemoved {
            block_hashes: vec![hash(3)],
            medium: Some("GPU".into()),
            group_idx: None,
        },
        block(vec![hash(10)], None, vec![100, 101, 102, 103], None),
    ];
    let batch = |events| EngineBatch {
        ts: 1.0,
        events,
        data_parallel_rank: Some(0),
    };
    [batch(vec![a]), batch(vec![b]), batch(c)]
}

fn empty_batch() -> EngineBatch {
    EngineBatch {
        ts: 0.0,
        events: Vec::new(),
        data_parallel_rank: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_batch_is_repaired_from_the_rust_publishers_replay() {
    let s = Scenario {
        bytes_hashes: false,
        sglang: false,
    };
    for shape in [WireShape::ArrayLike, WireShape::Map] {
        let publisher = ZmqPublisher::bind(
            "tcp://127.0.0.1:0",
            Some("tcp://127.0.0.1:0"),
            "kv",
            100,
            shape,
        )
        .await
        .expect("bind on free ports");
        let plane = Arc::new(MemoryEventPlane::new());
        let mut published = Published::new(&plane).await;
        let (relay, tasks, cancel) = start_relay(
            &plane,
            publisher.pub_endpoint().to_string(),
            publisher.replay_endpoint().map(str::to_string),
            "kv",
        );
        let warm = warm_up(&relay, async || {
            publisher.publish(empty_batch()).await.expect("publish");
        })
        .await;
        let [a, b, c] = rust_batches(shape);
        publisher.publish(a).await.expect("publish");
        publisher.drop_next();
        publisher.publish(b).await.expect("publish");
        publisher.publish(c).await.expect("publish");
        published.until(4).await;
        let ea = s.expected_a();
        assert_eq!(
            published.kinds(),
            vec![
                stored(None, ea.clone()),
                stored(Some(ea[1].sequence_hash), s.expected_b()),
                (
                    StorageTier::Device,
                    KvEventKind::Removed {
                        blocks: vec![s.expected_b()[0].sequence_hash]
                    }
                ),
                stored(None, s.expected_c()),
            ],
            "{shape:?}"
        );
        wait_until("every batch applied", || relay.stats().batches >= warm + 3).await;
        let stats = relay.stats();
        assert!(stats.gaps_repaired >= 1, "{shape:?}: {stats:#?}");
        assert_eq!(stats.resets, 0, "{shape:?}: {stats:#?}");
        stop_relay(tasks, cancel).await;
        publisher.close().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_clears_and_starts_fresh() {
    let s = Scenario {
        bytes_hashes: true,
        sglang: false,
    };
    let (pub_port, replay_port) = (free_port(), free_port());
    let bind = async || {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            match ZmqPublisher::bind(
                &endpoint(pub_port),
                Some(&endpoint(replay_port)),
                "",
                100,
                WireShape::Map,
            )
            .await
            {
                Ok(p) => return p,
                Err(e) => {
                    assert!(tokio::time::Instant::now() < deadline, "rebinding: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    let first = bind().await;
    let plane = Arc::new(MemoryEventPlane::new());
    let mut published = Published::new(&plane).await;
    let (relay, tasks, cancel) =
        start_relay(&plane, endpoint(pub_port), Some(endpoint(replay_port)), "");
    warm_up(&relay, async || {
        first.publish(empty_batch()).await.expect("publish");
    })
    .await;
    let [a, _, c] = rust_batches(WireShape::Map);
    first.publish(a).await.expect("publish");
    published.until(1).await;
    let seq_before = first.next_seq().await;
    assert!(seq_before >= 2);

    // The engine goes away and a new one (seq from 0 again) comes up on the same ports.
    first.close().await;
    wait_until("the relay to see the engine go", || !relay.connected()).await;
    // The outage itself: longer than the 2 s after which the subscriber stops waiting for
    // zeromq's own reconnection (its backoff grows to 30 s) and connects afresh, with 1.5 s
    // to spare for a stalled machine.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let second = bind().await;
    tokio::time::timeout(WAIT, relay.wait_connected())
        .await
        .expect("the relay reconnects");
    warm_up(&relay, async || {
        second.publish(empty_batch()).await.expect("publish");
    })
    .await;
    second.publish(c).await.expect("publish");
    published.until(3).await;
    assert_eq!(
        published.kinds(),
        vec![
            stored(None, s.expected_a()),
            (StorageTier::Device, KvEventKind::Cleared),
            stored(None, s.expected_c()),
        ]
    );
    let stats = relay.stats();
    assert!(stats.resets >= 1, "{stats:#?}");
    assert_eq!(stats.subscriber.connects, 2, "{stats:#?}");
    let dump = relay.dump();
    assert_eq!(dump.last_event_id, 3);
    assert_eq!(dump.events.len(), 1);
    assert_eq!(dump.events[0].kind, stored(None, s.expected_c()).1);
    stop_relay(tasks, cancel).await;
    second.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_encoding_is_byte_identical_to_msgspecs() {
    let batch = EngineBatch {
        ts: 1_722_000_000.125,
        events: vec![
            EngineEvent::BlockStored {
                block_hashes: vec![
                    EngineHash::Int(-5),
                    EngineHash::Int(i64::MAX),
                    EngineHash::Uint(u64::MAX),
                    EngineHash::Bytes(vec![7; 32]),
                ],
                parent_block_hash: Some(EngineHash::Int(-300_000)),
                token_ids: (0..40).map(|t| t * 70_001).collect(),
                block_size: BLOCK,
                lora_id: Some(3),
                medium: Some("GPU".into()),
                lora_name: Some("a-lora-name-that-is-longer-than-31-bytes".into()),
                extra_keys: Some(vec![
                    Some(vec![
                        "a-lora-name-that-is-longer-than-31-bytes".into(),
                        rmpv::Value::Array(vec!["mm-hash".into(), 0.into()]),
                        "salt".into(),
                        rmpv::Value::Binary(vec![1; 300]),
                    ]),
                    None,
                ]),
                group_idx: Some(0),
                kv_cache_spec_kind: Some("full_attention".into()),
                kv_cache_spec_sliding_window: Some(70_000),
            },
            rust_batches(WireShape::Map)[0].events[0].clone(),
            EngineEvent::BlockRemoved {
                block_hashes: (0..300).map(EngineHash::Int).collect(),
                medium: Some("CPU".into()),
                group_idx: Some(1),
            },
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash::Int(-129)],
                medium: None,
                group_idx: None,
            },
            EngineEvent::AllBlocksCleared,
        ],
        data_parallel_rank: Some(0),
    };
    let no_rank = EngineBatch {
        data_parallel_rank: None,
        ..batch.clone()
    };
    for (shape, py_shape) in [
        (WireShape::ArrayLike, "vllm-array"),
        (WireShape::Map, "vllm-map"),
    ] {
        let mut engine = PyEngine::start(py_shape, free_port(), None, "").await;
        for b in [&batch, &no_rank] {
            let ours = tandem_external::events::encode_batch(b, shape);
            assert_eq!(engine.reencode(&ours).await, ours, "{shape:?}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_payloads_are_counted_and_the_relay_goes_on() {
    let s = Scenario {
        bytes_hashes: true,
        sglang: false,
    };
    let publisher = ZmqPublisher::bind("tcp://127.0.0.1:0", None, "", 10, WireShape::Map)
        .await
        .expect("bind");
    let plane = Arc::new(MemoryEventPlane::new());
    let mut published = Published::new(&plane).await;
    let (relay, tasks, cancel) =
        start_relay(&plane, publisher.pub_endpoint().to_string(), None, "");
    warm_up(&relay, async || {
        publisher.publish(empty_batch()).await.expect("publish");
    })
    .await;
    let [a, _, c] = rust_batches(WireShape::Map);
    publisher.publish(a).await.expect("publish");
    for garbage in [
        &b"\xc1"[..],
        b"\x92\xcb\x3f",
        b"not msgpack at all",
        &[0x91; 64],
    ] {
        publisher
            .publish_payload(bytes::Bytes::copy_from_slice(garbage))
            .await
            .expect("publish");
    }
    publisher.publish(c).await.expect("publish");
    published.until(3).await;
    assert_eq!(
        published.kinds(),
        vec![
            stored(None, s.expected_a()),
            // Undecodable batches are lost batches: forget, go on.
            (StorageTier::Device, KvEventKind::Cleared),
            stored(None, s.expected_c()),
        ]
    );
    let stats = relay.stats();
    assert_eq!(stats.decode_errors, 4, "{stats:#?}");
    stop_relay(tasks, cancel).await;
    publisher.close().await;
}
