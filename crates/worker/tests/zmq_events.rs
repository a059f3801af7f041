//! The ZMQ KV event path end to end, on loopback.
//!
//! 1. Against an independent encoder (CONVENTIONS 13): a Python engine stand-in that defines
//!    vLLM's and SGLang's msgspec structs as they are written upstream (array-like, map, map
//!    events in a positional batch, SGLang's older schema), publishes them on a pyzmq PUB
//!    socket and serves replay like vLLM's `ZmqEventPublisher._service_replay`. Needs python3
//!    with msgspec and pyzmq (scripts/test.sh installs them); without them the tests fail.
//! 2. Rust publisher to Rust relay: a PUB drop repaired from replay, and an engine restart.
//!
//! Expected tandem hashes are computed here with `tandem_protocol::hashing`, from the tokens.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value as Json, json};
use tandem_protocol::hashing::{chain_sequence_hash, local_block_hash};
use tandem_protocol::{
    BlockSize, Envelope, HashSeed, KvEvent, KvEventKind, SequenceHash, StorageTier, StoredBlock,
    WorkerId,
};
use tandem_runtime::events::{EventPlane, MemoryEventPlane, Subscription};
use tandem_worker::external::events::{
    EngineBatch, EngineEvent, EngineHash, KvRelay, RelayConfig, WireShape, ZmqPublisher,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const WORKER: WorkerId = WorkerId(42);
const BLOCK: u32 = 4;
const SUBJECT: &str = "tandem.test.kv-events";
const WAIT: Duration = Duration::from_secs(20);

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().expect("local address").port()
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

/// vLLM's and SGLang's structs and publisher loop, written out from
/// vllm/distributed/kv_events.py and python/sglang/srt/disaggregation/kv_events.py.
const ENGINE_PY: &str = r#"
import json, queue, sys, threading, time
from collections import deque
from typing import Any, Optional, Union

import msgspec
import zmq

ExternalBlockHash = Union[bytes, int]


def vllm_classes(array_batch, array_events):
    class EventBatch(msgspec.Struct, array_like=array_batch, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(msgspec.Struct, array_like=array_events, omit_defaults=True,
                       gc=False, tag=True):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: Optional[ExternalBlockHash]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def sglang_classes():
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                       tag=True):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def service_replay(replay, buffer):
    # vLLM ZmqEventPublisher._service_replay
    frame = replay.recv_multipart()
    if len(frame) != 3:
        return
    client_id, _, start_seq_bytes = frame
    start_seq = int.from_bytes(start_seq_bytes, "big")
    for seq, buf in buffer:
        if seq >= start_seq:
            replay.send_multipart((client_id, b"", seq.to_bytes(8, "big"), buf))
    replay.send_multipart((client_id, b"", END_SEQ, b""))


def main():
    pub_endpoint, replay_endpoint, topic, shape = sys.argv[1:5]
    sglang = shape == "sglang"
    if sglang:
        KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared = sglang_classes()
    else:
        array_batch = shape in ("vllm-array", "vllm-map-events")
        array_events = shape == "vllm-array"
        KVEventBatch, BlockStored, BlockRemoved, AllBlocksCleared = vllm_classes(
            array_batch, array_events)

    def block_hash(v):
        return bytes.fromhex(v) if isinstance(v, str) else v

    def event(d):
        t = d["type"]
        if t == "BlockStored":
            kw = dict(
                block_hashes=[block_hash(h) for h in d["block_hashes"]],
                parent_block_hash=None if d.get("parent") is None else block_hash(d["parent"]),
                token_ids=d["token_ids"],
                block_size=d["block_size"],
                lora_id=d.get("lora_id"),
            )
            if not sglang:
                kw["medium"] = d.get("medium")
                kw["lora_name"] = d.get("lora_name")
                if d.get("extra_keys") is not None:
                    kw["extra_keys"] = [None if k is None else tuple(k) for k in d["extra_keys"]]
                if d.get("group_idx") is not None:
                    kw["group_idx"] = d["group_idx"]
                    kw["kv_cache_spec_kind"] = d.get("kv_cache_spec_kind")
            return BlockStored(**kw)
        if t == "BlockRemoved":
            hashes = [block_hash(h) for h in d["block_hashes"]]
            if sglang:
                return BlockRemoved(block_hashes=hashes)
            return BlockRemoved(block_hashes=hashes, medium=d.get("medium"))
        return AllBlocksCleared()

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(100_000)
    pub.bind(pub_endpoint)
    replay = None
    if replay_endpoint != "-":
        replay = ctx.socket(zmq.ROUTER)
        replay.bind(replay_endpoint)
    buffer = deque(maxlen=10_000)
    pack = msgspec.msgpack.Encoder()
    topic_bytes = topic.encode("utf-8")
    commands = queue.Queue()

    def read_commands():
        for line in sys.stdin:
            commands.put(line)
        commands.put(None)

    threading.Thread(target=read_commands, daemon=True).start()
    print("ready", flush=True)
    seq = 0
    while True:
        # vLLM ZmqEventPublisher._publisher_thread: replay first, then the queue.
        if replay is not None and replay.poll(0):
            service_replay(replay, buffer)
        try:
            line = commands.get(timeout=0.01)
        except queue.Empty:
            continue
        if line is None:
            break
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "reencode":
            # Typed decode (msgspec validates the schema), then msgspec's own encoding.
            decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(bytes.fromhex(cmd["payload"]))
            print("re " + pack.encode(decoded).hex(), flush=True)
            continue
        events = [event(e) for e in cmd["events"]]
        if sglang:
            batch = KVEventBatch(ts=time.time(), events=events)
        else:
            # vLLM's publish() fills in the publisher's data-parallel rank.
            batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)
        payload = pack.encode(batch)
        if not cmd.get("skip"):
            pub.send_multipart((topic_bytes, seq.to_bytes(8, "big"), payload))
        buffer.append((seq, payload))
        print(f"ok {seq}", flush=True)
        seq += 1
    pub.close(linger=0)
    if replay is not None:
        replay.close(linger=0)


main()
"#;

static SCRIPT_ID: AtomicU64 = AtomicU64::new(0);

/// The Python engine stand-in, driven over stdin.
struct PyEngine {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    script: std::path::PathBuf,
}

impl PyEngine {
    async fn start(shape: &str, pub_port: u16, replay_port: Option<u16>, topic: &str) -> Self {
        let check = Command::new("python3")
            .args(["-c", "import msgspec, zmq"])
            .output()
            .await;
        match check {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "these tests need python3 with msgspec and pyzmq, the independent encoder \
                 (`python3 -m pip install msgspec pyzmq`; scripts/test.sh installs them): {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => panic!(
                "these tests need python3 with msgspec and pyzmq (scripts/test.sh installs \
                 them); python3 did not start: {e}"
            ),
        }
        let script = std::env::temp_dir().join(format!(
            "tandem-zmq-engine-{}-{}.py",
            std::process::id(),
            SCRIPT_ID.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&script, ENGINE_PY).expect("write the engine script");
        let replay = replay_port.map_or("-".to_string(), endpoint);
        let mut child = Command::new("python3")
            .arg(&script)
            .args([
                endpoint(pub_port),
                replay,
                topic.to_string(),
                shape.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .expect("start python3");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut engine = PyEngine {
            _child: child,
            stdin,
            stdout,
            script,
        };
        assert_eq!(engine.line().await, "ready");
        engine
    }

    async fn line(&mut self) -> String {
        let mut line = String::new();
        let n = tokio::time::timeout(WAIT, self.stdout.read_line(&mut line))
            .await
            .expect("engine script answers")
            .expect("read from the engine script");
        assert!(n > 0, "the engine script exited");
        line.trim().to_string()
    }

    /// Publishes one batch (`skip`: buffered for replay but not sent on PUB); returns its seq.
    async fn publish(&mut self, events: Json, skip: bool) -> u64 {
        let cmd = json!({"op": "publish", "events": events, "skip": skip});
        self.stdin
            .write_all(format!("{cmd}\n").as_bytes())
            .await
            .expect("write to the engine script");
        self.stdin.flush().await.expect("flush");
        let line = self.line().await;
        line.strip_prefix("ok ")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("unexpected engine answer {line:?}"))
    }
}

impl PyEngine {
    /// msgspec's decoding and re-encoding of `payload` with this engine's classes.
    async fn reencode(&mut self, payload: &[u8]) -> Vec<u8> {
        let hex: String = payload.iter().map(|b| format!("{b:02x}")).collect();
        let cmd = json!({"op": "reencode", "payload": hex});
        self.stdin
            .write_all(format!("{cmd}\n").as_bytes())
            .await
            .expect("write to the engine script");
        self.stdin.flush().await.expect("flush");
        let line = self.line().await;
        let hex = line
            .strip_prefix("re ")
            .unwrap_or_else(|| panic!("msgspec refused our encoding: {line:?}"));
        (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
            .collect()
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.script);
    }
}

/// The scenario's batches in the script's JSON: `A` a salted two-block root, `B` its
/// continuation, `C` B's eviction and a new root. Hashes are bytes (hex) or ints.
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

    fn salt(&self) -> HashSeed {
        if self.sglang {
            // SGLang has no extra_keys: the LoRA id is the salt.
            HashSeed::from_salt(Some(b"3"))
        } else {
            HashSeed::from_salt(Some(b"tenant-a"))
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
            // vLLM: one extra-key entry per block, the cache salt on the first.
            e["extra_keys"] = json!([["tenant-a"], null]);
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
        chain(None, &(0..8).collect::<Vec<_>>(), self.salt())
    }

    fn expected_b(&self) -> Vec<StoredBlock> {
        chain(
            Some(self.expected_a()[1].sequence_hash),
            &[8, 9, 10, 11],
            self.salt(),
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
    if let EngineEvent::BlockStored { extra_keys, .. } = &mut a {
        *extra_keys = Some(vec![Some(vec!["tenant-a".into()]), None]);
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
    // zeromq's own reconnection (its backoff grows to 30 s) and connects afresh.
    tokio::time::sleep(Duration::from_millis(2500)).await;
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
            let ours = tandem_worker::external::events::encode_batch(b, shape);
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
