//! The Python engine stand-in of `zmq_events.rs`: vLLM's and SGLang's msgspec structs and
//! publisher loop, run by python3, driven over stdin and stdout.

use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value as Json, json};

use super::{WAIT, endpoint};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// vLLM's and SGLang's structs and publisher loop, written out from
/// vllm/distributed/kv_events.py and python/sglang/srt/disaggregation/kv_events.py.
pub(crate) const ENGINE_PY: &str = r#"
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

pub(crate) static SCRIPT_ID: AtomicU64 = AtomicU64::new(0);

/// The Python engine stand-in, driven over stdin.
pub(crate) struct PyEngine {
    _child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    script: std::path::PathBuf,
}

/// The interpreter of the `zmq` venv, `target/python/zmq` (scripts/test.sh makes one venv per
/// Python tool: two tools' packages installed together can overwrite each other's files).
fn python() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/python/zmq/bin/python3")
}

impl PyEngine {
    pub(crate) async fn start(
        shape: &str,
        pub_port: u16,
        replay_port: Option<u16>,
        topic: &str,
    ) -> Self {
        let check = Command::new(python())
            .args(["-c", "import msgspec, zmq"])
            .output()
            .await;
        match check {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!(
                "these tests need the zmq venv with msgspec and pyzmq, the independent encoder \
                 (scripts/test.sh makes it): {}",
                String::from_utf8_lossy(&out.stderr)
            ),
            Err(e) => panic!(
                "these tests need the zmq venv with msgspec and pyzmq (scripts/test.sh makes \
                 it); its python3 did not start: {e}"
            ),
        }
        let script = std::env::temp_dir().join(format!(
            "tandem-zmq-engine-{}-{}.py",
            std::process::id(),
            SCRIPT_ID.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&script, ENGINE_PY).expect("write the engine script");
        let replay = replay_port.map_or("-".to_string(), endpoint);
        let mut child = Command::new(python())
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

    pub(crate) async fn line(&mut self) -> String {
        let mut line = String::new();
        let n = tokio::time::timeout(WAIT, self.stdout.read_line(&mut line))
            .await
            .expect("engine script answers")
            .expect("read from the engine script");
        assert!(n > 0, "the engine script exited");
        line.trim().to_string()
    }

    /// Publishes one batch (`skip`: buffered for replay but not sent on PUB); returns its seq.
    pub(crate) async fn publish(&mut self, events: Json, skip: bool) -> u64 {
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
    pub(crate) async fn reencode(&mut self, payload: &[u8]) -> Vec<u8> {
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
