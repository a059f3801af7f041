//! An external engine's KV events, relayed as tandem's (docs/ARCHITECTURE.md §4, docs/CONVENTIONS.md §7 and 13).
//!
//! vLLM (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`) and SGLang
//! (`python/sglang/srt/disaggregation/kv_events.py`, same class) publish their KV cache
//! events on a ZeroMQ PUB socket as multipart `[topic, seq, payload]`: `seq` is an 8-byte
//! big-endian counter (`itertools.count()`, from 0, one per batch) and `payload` the msgspec
//! msgpack of a `KVEventBatch(ts, events, data_parallel_rank)`. An optional ROUTER socket
//! (`_service_replay`) resends the batches still in its `buffer_steps` ring from a requested
//! seq on, then an end marker. The engine's block hashes are its own; tandem's are recomputed
//! from the events' token ids.
//!
//! Layout, from the wire inwards:
//! - [`codec`]: the msgpack codec of a batch, both shapes (positional `array_like` structs and
//!   field-name maps, mixed freely), decode and encode.
//! - [`subscriber`]: the SUB socket, sequence tracking, gap repair from the replay socket and
//!   the `Reset` it yields when a gap cannot be repaired or the engine restarted.
//! - [`mirror`]: sans-IO; the engine's blocks by engine hash, turned into tandem
//!   `Stored`/`Removed`/`Cleared` changes with tandem's hashes.
//! - [`log`]: sans-IO; numbers the changes (ids from 1, no holes), keeps a bounded ring for
//!   range requests, dumps.
//! - [`relay`]: [`KvRelay`], the task that ties them together and publishes each numbered
//!   batch on the event plane.
//! - [`publisher`]: [`ZmqPublisher`], vLLM's publisher in Rust, for stand-in engines and tests.
//!
//! Invariants: tandem event ids increase by one per event with no holes, whatever the engine
//! stream does; the mirror never applies a batch past a gap it could not repair (it clears
//! first); every buffer (mirror, ring, replay, pending batches, payload size) is bounded.

pub mod codec;
pub mod log;
pub mod mirror;
pub mod publisher;
pub mod relay;
pub mod subscriber;

#[cfg(test)]
mod tests;

pub use codec::{
    EngineBatch, EngineEvent, EngineHash, MAX_PAYLOAD_BYTES, WireShape, decode_batch, encode_batch,
};
pub use log::RelayLog;
pub use mirror::{KvMirror, MirrorStats, tier_of_medium};
pub use publisher::ZmqPublisher;
pub use relay::{KvRelay, RelayConfig, RelayStats, RelayTuning};
pub use subscriber::{
    EngineSubscriber, ResetReason, SubscriberConfig, SubscriberItem, SubscriberProbe,
    SubscriberStats,
};

use tandem_protocol::ErrorClass;

/// Why KV event bytes or sockets failed.
#[derive(Debug, thiserror::Error)]
pub enum EventsError {
    /// A payload over the size limit; not decoded at all.
    #[error("KV event payload of {len} bytes is over the {limit}-byte limit")]
    TooLarge { len: usize, limit: usize },
    /// Bytes that are not msgpack (truncated, reserved marker, invalid UTF-8, trailing bytes).
    #[error("malformed msgpack at byte {offset}: {reason}")]
    Msgpack { offset: usize, reason: &'static str },
    /// Valid msgpack that is not a KV event batch as vLLM or SGLang define it.
    #[error("not a KV event batch: {at}: expected {expected}")]
    Schema {
        at: &'static str,
        expected: &'static str,
    },
    /// A ZeroMQ socket failed (bind, connect, send, receive).
    #[error("ZeroMQ: {0}")]
    Zmq(#[from] zeromq::ZmqError),
    /// The replay socket did not answer in time or answered out of protocol.
    #[error("replay: {0}")]
    Replay(String),
}

impl EventsError {
    /// Bad bytes are the engine's input problem; sockets and replay are a peer being away.
    pub fn class(&self) -> ErrorClass {
        match self {
            EventsError::TooLarge { .. }
            | EventsError::Msgpack { .. }
            | EventsError::Schema { .. } => ErrorClass::InvalidRequest,
            EventsError::Zmq(_) | EventsError::Replay(_) => ErrorClass::Unavailable,
        }
    }
}
