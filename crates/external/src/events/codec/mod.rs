//! The msgpack codec of vLLM's and SGLang's `KVEventBatch`, both shapes, decode and encode.
//!
//! The classes (vLLM `vllm/distributed/kv_events.py`; SGLang
//! `python/sglang/srt/disaggregation/kv_events.py`) are msgspec structs:
//! `EventBatch(ts: float, events: list, data_parallel_rank: int | None = None)` and the
//! tagged union (`tag=True`, the tag is the class name) of
//! `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
//! lora_name, extra_keys=None, group_idx=None, kv_cache_spec_kind=None,
//! kv_cache_spec_sliding_window=None)`, `BlockRemoved(block_hashes, medium, group_idx=None)`
//! and `AllBlocksCleared()`. Fields were appended over time: SGLang and the first vLLM have
//! `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id)`,
//! `BlockRemoved(block_hashes)` and no `data_parallel_rank`.
//!
//! Two shapes, decoded at each level independently because releases mix them:
//! - `array_like=True` (SGLang, vLLM before PR #42892): a struct is a msgpack array of its
//!   fields in declaration order; a tagged struct starts with its tag. msgspec writes *every*
//!   field of an array-like struct, defaults included (`omit_defaults` has no effect there,
//!   msgspec issue #720), so the length tells the schema version; shorter arrays are older
//!   schemas and their missing trailing fields read as `None`.
//! - maps (vLLM after #42892): `{"type": tag, field: value, ...}`, in declaration order, with
//!   `omit_defaults=True` dropping the defaulted fields that hold their default (`None`).
//!   Unknown keys are ignored. Some releases kept the positional batch around map events.
//!
//! Block hashes are `ExternalBlockHash = bytes | int` (vLLM `vllm/v1/core/kv_cache_utils.py`):
//! ints from older vLLM and SGLang (Python `hash()`, any signed 64-bit value, or unsigned
//! 64-bit under `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`), the hash's bytes (sha256 by default)
//! from the newest vLLM.
//!
//! The decoder is a hand-written msgpack reader over the borrowed payload: no intermediate
//! value tree, every length checked against the bytes left before anything is reserved, a
//! depth limit on the free-form `extra_keys` values, and no panics on any input. The encoder
//! writes what msgspec writes, byte for byte (checked against msgspec itself in
//! `tests/zmq_events.rs`). Reader (here) and writer (`encode.rs`) are the two halves of one
//! wire contract and change together.

pub use rmpv::Value;
use xxhash_rust::xxh3::xxh3_64;

use super::EventsError;

mod encode;
pub use encode::encode_batch;

/// Largest payload decoded (16 MiB). A vLLM batch is one scheduler step: even a step that
/// finishes the prefill of a hundred long prompts stays in the low megabytes.
pub const MAX_PAYLOAD_BYTES: usize = 16 << 20;

/// Nesting allowed inside one `extra_keys` value (vLLM's are flat tuples of strings, bytes and
/// `(identifier, offset)` pairs).
const MAX_VALUE_DEPTH: u32 = 16;

/// A block hash as the engine sends it (`ExternalBlockHash = bytes | int`).
///
/// Integers that fit `i64` decode as [`EngineHash::Int`] whatever their sign; only values
/// above `i64::MAX` (unsigned 64-bit hashes) decode as [`EngineHash::Uint`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum EngineHash {
    Int(i64),
    Uint(u64),
    Bytes(Vec<u8>),
}

impl EngineHash {
    /// The mirror's key for this hash: an int's 64-bit pattern, or xxh3-64 of the bytes.
    pub fn key(&self) -> u64 {
        match self {
            EngineHash::Int(v) => *v as u64,
            EngineHash::Uint(v) => *v,
            EngineHash::Bytes(b) => xxh3_64(b),
        }
    }
}

/// One event of a batch, with vLLM's field names.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// `BlockStored`: consecutive blocks of one request now cached; `token_ids` holds the
    /// tokens of all of them (`block_size` each), `parent_block_hash` names the block before
    /// the first (`None` at a sequence start).
    BlockStored {
        block_hashes: Vec<EngineHash>,
        parent_block_hash: Option<EngineHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        /// Deprecated in vLLM in favour of `lora_name`; SGLang's only LoRA field.
        lora_id: Option<i64>,
        /// `"GPU"` (vLLM `MEDIUM_GPU`), `"CPU"`, `"DISK"`; absent before vLLM PR #19737.
        medium: Option<String>,
        lora_name: Option<String>,
        /// One entry per block: the extra keys vLLM hashed with it
        /// (`generate_block_hash_extra_keys`: LoRA name, multimodal `(identifier, offset)`,
        /// cache salt on a request's first block, prompt-embedding digests).
        extra_keys: Option<Vec<Option<Vec<Value>>>>,
        /// The KV cache group (hybrid models have several).
        group_idx: Option<i64>,
        kv_cache_spec_kind: Option<String>,
        kv_cache_spec_sliding_window: Option<i64>,
    },
    /// `BlockRemoved`: blocks evicted from `medium`.
    BlockRemoved {
        block_hashes: Vec<EngineHash>,
        medium: Option<String>,
        group_idx: Option<i64>,
    },
    /// `AllBlocksCleared`: the prefix cache was reset.
    AllBlocksCleared,
    /// An event class this decoder does not know (a newer engine); kept so the batch's other
    /// events still apply, and counted by the mirror.
    Unknown { tag: String },
}

/// One `KVEventBatch`: the events of one engine step.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    pub ts: f64,
    pub events: Vec<EngineEvent>,
    /// Set by vLLM's publisher (its rank, 0 without data parallelism); absent in SGLang.
    pub data_parallel_rank: Option<i64>,
}

/// Which msgspec struct shape [`encode_batch`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WireShape {
    /// `array_like=True` on every struct, with the full current field list (vLLM just before
    /// PR #42892): every field written, defaults included.
    ArrayLike,
    /// Field-name maps everywhere, defaulted fields that are `None` omitted (vLLM's current
    /// `kv_events.py`).
    Map,
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// Decodes one `KVEventBatch` payload, in either shape (or a mix of them).
pub fn decode_batch(bytes: &[u8]) -> Result<EngineBatch, EventsError> {
    if bytes.len() > MAX_PAYLOAD_BYTES {
        return Err(EventsError::TooLarge {
            len: bytes.len(),
            limit: MAX_PAYLOAD_BYTES,
        });
    }
    let mut r = Reader { buf: bytes, pos: 0 };
    let batch = r.batch()?;
    if r.pos != bytes.len() {
        return Err(r.error("trailing bytes after the batch"));
    }
    Ok(batch)
}

/// One msgpack head: a scalar, or the length of what follows.
enum Head<'a> {
    Nil,
    Bool(bool),
    Int(i64),
    Uint(u64),
    F32(f32),
    F64(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext(i8, &'a [u8]),
}

fn schema(at: &'static str, expected: &'static str) -> EventsError {
    EventsError::Schema { at, expected }
}

/// The most bytes one list's first reservation takes (64 KiB); beyond it the list grows
/// with what is actually read.
const MAX_RESERVE_BYTES: usize = 64 << 10;

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn error(&self, reason: &'static str) -> EventsError {
        EventsError::Msgpack {
            offset: self.pos,
            reason,
        }
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], EventsError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| self.error("truncated"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn fixed<const N: usize>(&mut self) -> Result<[u8; N], EventsError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize, EventsError> {
        Ok(usize::from(self.fixed::<1>()?[0]))
    }

    fn len16(&mut self) -> Result<usize, EventsError> {
        Ok(usize::from(u16::from_be_bytes(self.fixed()?)))
    }

    fn len32(&mut self) -> Result<usize, EventsError> {
        Ok(u32::from_be_bytes(self.fixed()?) as usize)
    }

    fn int(v: i64) -> Head<'a> {
        if v >= 0 {
            Head::Uint(v as u64)
        } else {
            Head::Int(v)
        }
    }

    fn head(&mut self) -> Result<Head<'a>, EventsError> {
        let marker = self.fixed::<1>()?[0];
        Ok(match marker {
            0x00..=0x7f => Head::Uint(u64::from(marker)),
            0x80..=0x8f => Head::Map(usize::from(marker & 0x0f)),
            0x90..=0x9f => Head::Array(usize::from(marker & 0x0f)),
            0xa0..=0xbf => Head::Str(self.take(usize::from(marker & 0x1f))?),
            0xc0 => Head::Nil,
            0xc1 => return Err(self.error("reserved marker 0xc1")),
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4 => {
                let n = self.len8()?;
                Head::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.len16()?;
                Head::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.len32()?;
                Head::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = match marker {
                    0xc7 => self.len8()?,
                    0xc8 => self.len16()?,
                    _ => self.len32()?,
                };
                let ty = self.fixed::<1>()?[0] as i8;
                Head::Ext(ty, self.take(n)?)
            }
            0xca => Head::F32(f32::from_be_bytes(self.fixed()?)),
            0xcb => Head::F64(f64::from_be_bytes(self.fixed()?)),
            0xcc => Head::Uint(u64::from(self.fixed::<1>()?[0])),
            0xcd => Head::Uint(u64::from(u16::from_be_bytes(self.fixed()?))),
            0xce => Head::Uint(u64::from(u32::from_be_bytes(self.fixed()?))),
            0xcf => Head::Uint(u64::from_be_bytes(self.fixed()?)),
            0xd0 => Self::int(i64::from(self.fixed::<1>()?[0] as i8)),
            0xd1 => Self::int(i64::from(i16::from_be_bytes(self.fixed()?))),
            0xd2 => Self::int(i64::from(i32::from_be_bytes(self.fixed()?))),
            0xd3 => Self::int(i64::from_be_bytes(self.fixed()?)),
            0xd4..=0xd8 => {
                let n = 1usize << (marker - 0xd4);
                let ty = self.fixed::<1>()?[0] as i8;
                Head::Ext(ty, self.take(n)?)
            }
            0xd9 => {
                let n = self.len8()?;
                Head::Str(self.take(n)?)
            }
            0xda => {
                let n = self.len16()?;
                Head::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.len32()?;
                Head::Str(self.take(n)?)
            }
            0xdc => Head::Array(self.len16()?),
            0xdd => Head::Array(self.len32()?),
            0xde => Head::Map(self.len16()?),
            0xdf => Head::Map(self.len32()?),
            0xe0..=0xff => Head::Int(i64::from(marker as i8)),
        })
    }

    /// Skips one value of any shape, without recursion (unknown map keys, extra positions).
    fn skip(&mut self) -> Result<(), EventsError> {
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            match self.head()? {
                Head::Array(n) => pending = pending.saturating_add(n),
                Head::Map(n) => pending = pending.saturating_add(n.saturating_mul(2)),
                _ => {}
            }
        }
        Ok(())
    }

    /// An empty vector for `n` announced elements, reserving no more than the bytes left
    /// (each element takes at least one) and no more than [`MAX_RESERVE_BYTES`]: a lying
    /// length reserves nothing unreasonable, and a real list grows as it is read.
    fn vec_for<T>(&self, n: usize) -> Vec<T> {
        let most = MAX_RESERVE_BYTES / std::mem::size_of::<T>().max(1);
        Vec::with_capacity(n.min(self.remaining()).min(most))
    }

    fn utf8(&self, bytes: &'a [u8]) -> Result<&'a str, EventsError> {
        std::str::from_utf8(bytes).map_err(|_| self.error("invalid UTF-8 in a string"))
    }

    fn str(&mut self, at: &'static str) -> Result<&'a str, EventsError> {
        match self.head()? {
            Head::Str(s) => self.utf8(s),
            _ => Err(schema(at, "a string")),
        }
    }

    fn opt_str(&mut self, at: &'static str) -> Result<Option<String>, EventsError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Str(s) => Ok(Some(self.utf8(s)?.to_string())),
            _ => Err(schema(at, "a string or None")),
        }
    }

    fn opt_i64(&mut self, at: &'static str) -> Result<Option<i64>, EventsError> {
        match self.head()? {
            Head::Nil => Ok(None),
            Head::Int(v) => Ok(Some(v)),
            Head::Uint(v) => i64::try_from(v)
                .map(Some)
                .map_err(|_| schema(at, "an int in the signed 64-bit range")),
            _ => Err(schema(at, "an int or None")),
        }
    }

    fn u32(&mut self, at: &'static str) -> Result<u32, EventsError> {
        match self.head()? {
            Head::Uint(v) => u32::try_from(v).map_err(|_| schema(at, "an int below 2^32")),
            _ => Err(schema(at, "a non-negative int")),
        }
    }

    fn f64(&mut self, at: &'static str) -> Result<f64, EventsError> {
        match self.head()? {
            Head::F64(v) => Ok(v),
            Head::F32(v) => Ok(f64::from(v)),
            Head::Uint(v) => Ok(v as f64),
            Head::Int(v) => Ok(v as f64),
            _ => Err(schema(at, "a float")),
        }
    }

    fn array(&mut self, at: &'static str, expected: &'static str) -> Result<usize, EventsError> {
        match self.head()? {
            Head::Array(n) => Ok(n),
            _ => Err(schema(at, expected)),
        }
    }

    fn hash_from(&self, head: Head<'a>, at: &'static str) -> Result<EngineHash, EventsError> {
        match head {
            Head::Int(v) => Ok(EngineHash::Int(v)),
            Head::Uint(v) => Ok(i64::try_from(v).map_or(EngineHash::Uint(v), EngineHash::Int)),
            Head::Bin(b) => Ok(EngineHash::Bytes(b.to_vec())),
            _ => Err(schema(at, "a block hash (int or bytes)")),
        }
    }

    fn opt_hash(&mut self, at: &'static str) -> Result<Option<EngineHash>, EventsError> {
        match self.head()? {
            Head::Nil => Ok(None),
            h => self.hash_from(h, at).map(Some),
        }
    }

    fn hashes(&mut self, at: &'static str) -> Result<Vec<EngineHash>, EventsError> {
        let n = self.array(at, "a list of block hashes")?;
        let mut out = self.vec_for(n);
        for _ in 0..n {
            let h = self.head()?;
            out.push(self.hash_from(h, at)?);
        }
        Ok(out)
    }

    fn tokens(&mut self, at: &'static str) -> Result<Vec<u32>, EventsError> {
        let n = self.array(at, "a list of token ids")?;
        let mut out = self.vec_for(n);
        for _ in 0..n {
            out.push(self.u32(at)?);
        }
        Ok(out)
    }

    /// `extra_keys: list[tuple[Any, ...] | None] | None`.
    fn extra_keys(
        &mut self,
        at: &'static str,
    ) -> Result<Option<Vec<Option<Vec<Value>>>>, EventsError> {
        let n = match self.head()? {
            Head::Nil => return Ok(None),
            Head::Array(n) => n,
            _ => return Err(schema(at, "a list of extra-key tuples or None")),
        };
        let mut out = self.vec_for(n);
        for _ in 0..n {
            match self.head()? {
                Head::Nil => out.push(None),
                Head::Array(m) => {
                    let mut keys = self.vec_for(m);
                    for _ in 0..m {
                        keys.push(self.value(MAX_VALUE_DEPTH)?);
                    }
                    out.push(Some(keys));
                }
                _ => return Err(schema(at, "an extra-key tuple or None")),
            }
        }
        Ok(Some(out))
    }

    /// Any value, as an owned [`Value`] (inside `extra_keys`).
    fn value(&mut self, depth: u32) -> Result<Value, EventsError> {
        if depth == 0 {
            return Err(self.error("values nested too deeply"));
        }
        Ok(match self.head()? {
            Head::Nil => Value::Nil,
            Head::Bool(b) => Value::Boolean(b),
            Head::Int(v) => Value::from(v),
            Head::Uint(v) => Value::from(v),
            Head::F32(v) => Value::F32(v),
            Head::F64(v) => Value::F64(v),
            Head::Str(s) => Value::from(self.utf8(s)?),
            Head::Bin(b) => Value::Binary(b.to_vec()),
            Head::Ext(ty, b) => Value::Ext(ty, b.to_vec()),
            Head::Array(n) => {
                let mut items = self.vec_for(n);
                for _ in 0..n {
                    items.push(self.value(depth - 1)?);
                }
                Value::Array(items)
            }
            Head::Map(n) => {
                let mut items = self.vec_for(n);
                for _ in 0..n {
                    let k = self.value(depth - 1)?;
                    let v = self.value(depth - 1)?;
                    items.push((k, v));
                }
                Value::Map(items)
            }
        })
    }

    fn batch(&mut self) -> Result<EngineBatch, EventsError> {
        const AT: &str = "KVEventBatch";
        match self.head()? {
            Head::Array(n) => {
                if n < 2 {
                    return Err(schema(AT, "at least [ts, events]"));
                }
                let ts = self.f64("KVEventBatch.ts")?;
                let events = self.events()?;
                let data_parallel_rank = if n >= 3 {
                    self.opt_i64("KVEventBatch.data_parallel_rank")?
                } else {
                    None
                };
                for _ in 3..n {
                    self.skip()?;
                }
                Ok(EngineBatch {
                    ts,
                    events,
                    data_parallel_rank,
                })
            }
            Head::Map(n) => {
                let (mut ts, mut events, mut dp) = (None, None, None);
                for _ in 0..n {
                    match self.str("KVEventBatch key")? {
                        "ts" => ts = Some(self.f64("KVEventBatch.ts")?),
                        "events" => events = Some(self.events()?),
                        "data_parallel_rank" => {
                            dp = self.opt_i64("KVEventBatch.data_parallel_rank")?;
                        }
                        _ => self.skip()?,
                    }
                }
                Ok(EngineBatch {
                    ts: ts.ok_or(schema(AT, "a \"ts\" field"))?,
                    events: events.ok_or(schema(AT, "an \"events\" field"))?,
                    data_parallel_rank: dp,
                })
            }
            _ => Err(schema(AT, "an array or a map")),
        }
    }

    fn events(&mut self) -> Result<Vec<EngineEvent>, EventsError> {
        let n = self.array("KVEventBatch.events", "a list of events")?;
        let mut out = self.vec_for(n);
        for _ in 0..n {
            out.push(self.event()?);
        }
        Ok(out)
    }

    fn event(&mut self) -> Result<EngineEvent, EventsError> {
        match self.head()? {
            Head::Array(n) => {
                if n == 0 {
                    return Err(schema("event", "a tag as the first element"));
                }
                let tag = self.str("event tag")?;
                self.positional_event(tag, n - 1)
            }
            Head::Map(n) => self.map_event(n),
            _ => Err(schema("event", "an array or a map")),
        }
    }

    /// An array-like event after its tag: `n` fields in declaration order. Missing trailing
    /// fields are older schemas (absent, like `None`); extra ones are newer and skipped.
    fn positional_event(&mut self, tag: &str, n: usize) -> Result<EngineEvent, EventsError> {
        let order: &[Field] = match tag {
            "BlockStored" => &STORED_ORDER,
            "BlockRemoved" => &REMOVED_ORDER,
            _ => &[],
        };
        let mut f = MapFields::default();
        for &field in order.iter().take(n) {
            f.read(self, field)?;
        }
        for _ in order.len().min(n)..n {
            self.skip()?;
        }
        f.build(tag)
    }

    /// A map event: `{"type": tag, field: value, ...}` in any key order.
    fn map_event(&mut self, n: usize) -> Result<EngineEvent, EventsError> {
        let mut tag = None;
        let mut f = MapFields::default();
        for _ in 0..n {
            let key = self.str("event key")?;
            if key == "type" {
                tag = Some(self.str("event tag")?);
            } else if let Some(field) = Field::from_name(key) {
                f.read(self, field)?;
            } else {
                self.skip()?;
            }
        }
        let tag = tag.ok_or(schema("event", "a \"type\" key naming its class"))?;
        f.build(tag)
    }
}

/// The fields of every event class, by name; the types agree across classes.
#[derive(Clone, Copy)]
enum Field {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
}

/// `BlockStored`'s fields in declaration order (array positions after the tag).
const STORED_ORDER: [Field; 11] = [
    Field::BlockHashes,
    Field::ParentBlockHash,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::SlidingWindow,
];

/// `BlockRemoved`'s fields in declaration order.
const REMOVED_ORDER: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

impl Field {
    fn from_name(name: &str) -> Option<Field> {
        Some(match name {
            "block_hashes" => Field::BlockHashes,
            "parent_block_hash" => Field::ParentBlockHash,
            "token_ids" => Field::TokenIds,
            "block_size" => Field::BlockSize,
            "lora_id" => Field::LoraId,
            "medium" => Field::Medium,
            "lora_name" => Field::LoraName,
            "extra_keys" => Field::ExtraKeys,
            "group_idx" => Field::GroupIdx,
            "kv_cache_spec_kind" => Field::SpecKind,
            "kv_cache_spec_sliding_window" => Field::SlidingWindow,
            _ => return None,
        })
    }
}

/// Fields read so far; the outer `Option` says whether the field was present at all.
#[derive(Default)]
struct MapFields {
    block_hashes: Option<Vec<EngineHash>>,
    parent_block_hash: Option<Option<EngineHash>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    lora_id: Option<Option<i64>>,
    medium: Option<Option<String>>,
    lora_name: Option<Option<String>>,
    extra_keys: Option<Option<Vec<Option<Vec<Value>>>>>,
    group_idx: Option<Option<i64>>,
    kv_cache_spec_kind: Option<Option<String>>,
    kv_cache_spec_sliding_window: Option<Option<i64>>,
}

impl MapFields {
    fn read(&mut self, r: &mut Reader<'_>, field: Field) -> Result<(), EventsError> {
        match field {
            Field::BlockHashes => self.block_hashes = Some(r.hashes("event.block_hashes")?),
            Field::ParentBlockHash => {
                self.parent_block_hash = Some(r.opt_hash("BlockStored.parent_block_hash")?);
            }
            Field::TokenIds => self.token_ids = Some(r.tokens("BlockStored.token_ids")?),
            Field::BlockSize => self.block_size = Some(r.u32("BlockStored.block_size")?),
            Field::LoraId => self.lora_id = Some(r.opt_i64("BlockStored.lora_id")?),
            Field::Medium => self.medium = Some(r.opt_str("event.medium")?),
            Field::LoraName => self.lora_name = Some(r.opt_str("BlockStored.lora_name")?),
            Field::ExtraKeys => self.extra_keys = Some(r.extra_keys("BlockStored.extra_keys")?),
            Field::GroupIdx => self.group_idx = Some(r.opt_i64("event.group_idx")?),
            Field::SpecKind => {
                self.kv_cache_spec_kind = Some(r.opt_str("BlockStored.kv_cache_spec_kind")?);
            }
            Field::SlidingWindow => {
                self.kv_cache_spec_sliding_window =
                    Some(r.opt_i64("BlockStored.kv_cache_spec_sliding_window")?);
            }
        }
        Ok(())
    }

    fn build(self, tag: &str) -> Result<EngineEvent, EventsError> {
        Ok(match tag {
            "BlockStored" => EngineEvent::BlockStored {
                block_hashes: self
                    .block_hashes
                    .ok_or(schema("BlockStored", "a block_hashes field"))?,
                // Required (no default) in every version: a missing parent must not silently
                // turn a continuation into a sequence start, which would hash differently.
                parent_block_hash: self
                    .parent_block_hash
                    .ok_or(schema("BlockStored", "a parent_block_hash field"))?,
                token_ids: self
                    .token_ids
                    .ok_or(schema("BlockStored", "a token_ids field"))?,
                block_size: self
                    .block_size
                    .ok_or(schema("BlockStored", "a block_size field"))?,
                lora_id: self.lora_id.flatten(),
                medium: self.medium.flatten(),
                lora_name: self.lora_name.flatten(),
                extra_keys: self.extra_keys.flatten(),
                group_idx: self.group_idx.flatten(),
                kv_cache_spec_kind: self.kv_cache_spec_kind.flatten(),
                kv_cache_spec_sliding_window: self.kv_cache_spec_sliding_window.flatten(),
            },
            "BlockRemoved" => EngineEvent::BlockRemoved {
                block_hashes: self
                    .block_hashes
                    .ok_or(schema("BlockRemoved", "a block_hashes field"))?,
                medium: self.medium.flatten(),
                group_idx: self.group_idx.flatten(),
            },
            "AllBlocksCleared" => EngineEvent::AllBlocksCleared,
            other => EngineEvent::Unknown {
                tag: other.to_string(),
            },
        })
    }
}
