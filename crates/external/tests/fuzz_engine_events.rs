//! Fuzzing the decoder of vLLM's and SGLang's msgpack KV event batches
//! ([`decode_batch`], `src/events/codec/`), issue 12 §5.
//!
//! Inputs: arbitrary bytes (biased to msgpack markers); arbitrary msgpack values of any shape
//! (`rmpv`, an encoder independent of ours); generated batches in both wire shapes
//! ([`encode_batch`]), damaged at the byte level (bit flips, writes, truncation, extension,
//! insertion, 32-bit lengths claiming 4 G elements or bytes, nesting 10 000 deep) or at the
//! value level (the batch read back with `rmpv`, one node swapped for another type, an
//! extreme integer, a huge string, a lying container, then written again).
//!
//! Properties: no panic; a generated batch round-trips in both shapes; whatever decodes
//! re-encodes to a fixpoint (encode ∘ decode is idempotent on bytes, which also holds with a
//! NaN `ts`); the mirror accepts every decoded event without panicking; and a payload of
//! lying lengths is refused without reserving what it claims (see `lying_lengths_*`).
//!
//! The generator is `tandem_protocol::Rng` (proptest is not a dev-dependency of this
//! crate; the codec's own unit test fuzzes the same way): case `i` of seed `s` is
//! reproducible alone and a failure prints both with the input. `PROPTEST_CASES` sets the
//! number of cases (default 10 000, about a second), `TANDEM_FUZZ_SEED` the seed.

use rmpv::Value;

use tandem_external::events::{
    EngineBatch, EngineEvent, EngineHash, KvMirror, MAX_PAYLOAD_BYTES, WireShape, decode_batch,
    encode_batch,
};
use tandem_protocol::{BlockSize, Rng, WorkerId};

struct Gen(Rng);

impl Gen {
    fn below(&mut self, n: usize) -> usize {
        self.0.below(n)
    }

    fn odds(&mut self, num: usize, den: usize) -> bool {
        self.0.below(den) < num
    }

    fn u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    fn int(&mut self) -> i64 {
        match self.below(6) {
            0 => i64::MIN,
            1 => i64::MAX,
            2 => -(self.below(40) as i64),
            3 => self.u64() as i64,
            _ => self.below(300) as i64,
        }
    }

    fn string(&mut self) -> String {
        let words = [
            "GPU",
            "CPU",
            "DISK",
            "",
            "lora",
            "full_attention",
            "é😀",
            "BlockStored",
        ];
        let mut s = words[self.below(words.len())].to_string();
        if self.odds(1, 8) {
            s = s.repeat(1 + self.below(20));
        }
        s
    }

    fn hash(&mut self) -> EngineHash {
        match self.below(3) {
            0 => EngineHash::Int(self.int()),
            // Only values over i64::MAX decode as Uint.
            1 => EngineHash::Uint(self.u64() | (1 << 63)),
            _ => EngineHash::Bytes((0..self.below(40)).map(|_| self.u64() as u8).collect()),
        }
    }

    fn hashes(&mut self) -> Vec<EngineHash> {
        (0..self.below(6)).map(|_| self.hash()).collect()
    }

    fn opt<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> Option<T> {
        self.odds(1, 2).then(|| f(self))
    }

    /// An `extra_keys` value (ints and floats in the forms our encoder writes back exactly).
    fn value(&mut self, depth: u32) -> Value {
        match self.below(if depth == 0 { 7 } else { 9 }) {
            0 => Value::Nil,
            1 => Value::Boolean(self.odds(1, 2)),
            2 => Value::from(self.int()),
            3 => Value::F64(self.0.unit_f64() * 1e6),
            4 => Value::from(self.string()),
            5 => Value::Binary((0..self.below(20)).map(|_| self.u64() as u8).collect()),
            6 => Value::Ext(self.u64() as i8, vec![1; self.below(20)]),
            7 => Value::Array((0..self.below(4)).map(|_| self.value(depth - 1)).collect()),
            _ => Value::Map(
                (0..self.below(3))
                    .map(|_| (self.value(depth - 1), self.value(depth - 1)))
                    .collect(),
            ),
        }
    }

    fn event(&mut self) -> EngineEvent {
        match self.below(5) {
            0 | 1 => {
                let blocks = self.below(4);
                let block_size = 1 + self.below(4) as u32;
                EngineEvent::BlockStored {
                    block_hashes: (0..blocks).map(|_| self.hash()).collect(),
                    parent_block_hash: self.opt(Self::hash),
                    token_ids: (0..blocks * block_size as usize + self.below(3))
                        .map(|_| self.u64() as u32 >> self.below(32))
                        .collect(),
                    block_size,
                    lora_id: self.opt(Self::int),
                    medium: self.opt(Self::string),
                    lora_name: self.opt(Self::string),
                    extra_keys: self.opt(|g| {
                        (0..blocks)
                            .map(|_| g.opt(|g| (0..g.below(3)).map(|_| g.value(3)).collect()))
                            .collect()
                    }),
                    group_idx: self.opt(Self::int),
                    kv_cache_spec_kind: self.opt(Self::string),
                    kv_cache_spec_sliding_window: self.opt(Self::int),
                }
            }
            2 => EngineEvent::BlockRemoved {
                block_hashes: self.hashes(),
                medium: self.opt(Self::string),
                group_idx: self.opt(Self::int),
            },
            3 => EngineEvent::AllBlocksCleared,
            _ => EngineEvent::Unknown {
                tag: format!("Block{}", self.string()),
            },
        }
    }

    fn batch(&mut self) -> EngineBatch {
        EngineBatch {
            ts: self.0.unit_f64() * 2e9,
            events: (0..self.below(6)).map(|_| self.event()).collect(),
            data_parallel_rank: self.opt(Self::int),
        }
    }

    fn shape(&mut self) -> WireShape {
        if self.odds(1, 2) {
            WireShape::ArrayLike
        } else {
            WireShape::Map
        }
    }

    /// Any msgpack value, for `rmpv` to encode (`depth` levels at most).
    fn any_value(&mut self, depth: u32) -> Value {
        match self.below(if depth == 0 { 8 } else { 11 }) {
            0 => Value::Nil,
            1 => Value::Boolean(true),
            2 => Value::from(self.int()),
            3 => Value::from(self.u64()),
            4 => Value::F32(self.0.unit_f64() as f32),
            5 => Value::F64(f64::from_bits(self.u64())),
            6 => Value::from(self.string()),
            7 => Value::Binary(vec![0; self.below(8)]),
            8 => Value::Array(
                (0..self.below(5))
                    .map(|_| self.any_value(depth - 1))
                    .collect(),
            ),
            9 => {
                // A map with the batch's and events' own keys.
                let keys = [
                    "ts",
                    "events",
                    "data_parallel_rank",
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "extra_keys",
                    "medium",
                ];
                Value::Map(
                    (0..self.below(5))
                        .map(|_| {
                            let k = Value::from(keys[self.below(keys.len())]);
                            (k, self.any_value(depth - 1))
                        })
                        .collect(),
                )
            }
            _ => Value::Ext(self.u64() as i8, vec![0; self.below(5)]),
        }
    }
}

fn rmpv_bytes(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("writing to a Vec cannot fail");
    out
}

/// msgpack heads whose length claims 4 G elements or bytes (array32, map32, str32, bin32,
/// ext32), and a 64 K one (array16).
const LIARS: [&[u8]; 6] = [
    &[0xdd, 0xff, 0xff, 0xff, 0xff],
    &[0xdf, 0xff, 0xff, 0xff, 0xff],
    &[0xdb, 0xff, 0xff, 0xff, 0xff],
    &[0xc6, 0xff, 0xff, 0xff, 0xff],
    &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
    &[0xdc, 0xff, 0xff],
];

fn damage_bytes(g: &mut Gen, bytes: &mut Vec<u8>) {
    for _ in 0..=g.below(3) {
        let len = bytes.len();
        match g.below(8) {
            0 | 1 if len > 0 => {
                let at = g.below(len);
                bytes[at] ^= 1 << g.below(8);
            }
            2 if len > 0 => {
                let at = g.below(len);
                bytes[at] = g.u64() as u8;
            }
            3 if len > 0 => bytes.truncate(g.below(len)),
            4 => bytes.extend((0..=g.below(8)).map(|_| g.u64() as u8)),
            5 => {
                let at = g.below(len + 1);
                let liar = LIARS[g.below(LIARS.len())];
                bytes.splice(at..at, liar.iter().copied());
            }
            6 => {
                let at = g.below(len + 1);
                let n = g.below(32);
                bytes.splice(at..at, (0..n).map(|_| g.u64() as u8));
            }
            _ if len > 0 => {
                let at = g.below(len);
                let n = (g.below(16)).min(len - at);
                bytes.drain(at..at + n);
            }
            _ => {}
        }
    }
}

/// A random node of a value tree.
fn random_node<'a>(g: &mut Gen, v: &'a mut Value) -> &'a mut Value {
    let mut node = v;
    loop {
        let len = match &*node {
            Value::Array(a) => a.len(),
            Value::Map(m) => m.len() * 2,
            _ => 0,
        };
        if len == 0 || g.odds(1, 3) {
            return node;
        }
        let i = g.below(len);
        node = match node {
            Value::Array(a) => &mut a[i],
            Value::Map(m) => {
                let (k, v) = &mut m[i / 2];
                if i.is_multiple_of(2) { k } else { v }
            }
            _ => unreachable!("len > 0"),
        };
    }
}

/// The batch read back as a value tree, one node replaced, written again.
fn damage_value(g: &mut Gen, bytes: &[u8]) -> Vec<u8> {
    let Ok(mut v) = rmpv::decode::read_value(&mut &bytes[..]) else {
        return bytes.to_vec();
    };
    let node = random_node(g, &mut v);
    // Sizes across the fix / 8 / 16 / 32-bit length forms; the 32-bit one is rare (slow).
    let forms = if g.odds(1, 10) { 4 } else { 3 };
    let size = [3, 40, 300, 70_000][g.below(forms)];
    *node = match g.below(7) {
        0 => g.any_value(2),
        1 => Value::from(i64::MIN),
        2 => Value::from(u64::MAX),
        3 => Value::from("x".repeat(size)),
        4 => Value::Array(vec![Value::Nil; size]),
        5 => Value::Array(vec![node.clone(); 2]),
        _ => Value::Nil,
    };
    let mut out = rmpv_bytes(&v);
    if g.odds(1, 4) {
        damage_bytes(g, &mut out);
    }
    out
}

fn arbitrary_bytes(g: &mut Gen) -> Vec<u8> {
    const MARKERS: [u8; 16] = [
        0x90, 0x92, 0x93, 0x80, 0x82, 0xa3, 0xc0, 0xc3, 0xcb, 0xcf, 0xd3, 0xdc, 0xdd, 0xdf, 0xc4,
        0xc7,
    ];
    (0..g.below(256))
        .map(|_| {
            if g.odds(1, 2) {
                MARKERS[g.below(MARKERS.len())]
            } else {
                g.u64() as u8
            }
        })
        .collect()
}

/// Decodes; whatever decodes goes through the mirror and re-encodes to a fixpoint.
fn exercise(bytes: &[u8], mirror: &mut KvMirror) -> Result<bool, String> {
    let Ok(batch) = decode_batch(bytes) else {
        return Ok(false);
    };
    for e in &batch.events {
        let _ = mirror.apply(e);
    }
    for shape in [WireShape::ArrayLike, WireShape::Map] {
        let once = encode_batch(&batch, shape);
        let again = decode_batch(&once).map_err(|e| format!("re-encoding fails to decode: {e}"))?;
        if encode_batch(&again, shape) != once {
            return Err(format!(
                "{shape:?} re-encoding is not a fixpoint: {batch:?}"
            ));
        }
    }
    Ok(true)
}

/// A test harness switch (`PROPTEST_CASES`, `TANDEM_FUZZ_SEED`), not configuration of
/// tandem: decimal or `0x` hex.
fn env_u64(name: &str) -> Option<u64> {
    #[allow(clippy::disallowed_methods)]
    let v = std::env::var(name).ok()?;
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().take(400).map(|b| format!("{b:02x}")).collect()
}

#[test]
fn engine_event_batches_never_panic_and_round_trip() {
    let cases = env_u64("PROPTEST_CASES").unwrap_or(10_000);
    let seed = env_u64("TANDEM_FUZZ_SEED").unwrap_or(0x6b76_e7e5);
    let started = std::time::Instant::now();
    let mut mirror = KvMirror::new(WorkerId(1), BlockSize::new(2).expect("non-zero"));
    let (mut decoded, mut failures) = (0u64, Vec::new());
    let mut spent = std::collections::BTreeMap::<&str, (u32, std::time::Duration)>::new();
    for i in 0..cases {
        let t0 = std::time::Instant::now();
        let mut g = Gen(Rng::seed_from_u64(
            seed ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ));
        let (what, bytes) = match g.below(10) {
            0 => ("bytes", arbitrary_bytes(&mut g)),
            1 => ("rmpv value", rmpv_bytes(&g.any_value(4))),
            2 => {
                let n = g.below(10_000);
                let mut b = vec![0x91; n];
                b.push(0xc0);
                ("deep nesting", b)
            }
            kind => {
                let batch = g.batch();
                let shape = g.shape();
                let bytes = encode_batch(&batch, shape);
                match decode_batch(&bytes) {
                    Ok(back) if back == batch => {}
                    other => failures.push(format!(
                        "case {i}: {shape:?} round trip: {other:?} for {batch:?}"
                    )),
                }
                if kind < 7 {
                    let mut b = bytes;
                    damage_bytes(&mut g, &mut b);
                    ("damaged bytes", b)
                } else {
                    ("damaged value", damage_value(&mut g, &bytes))
                }
            }
        };
        match exercise(&bytes, &mut mirror) {
            Ok(ok) => decoded += u64::from(ok),
            Err(why) => failures.push(format!("case {i} ({what}): {why}: {}", hex(&bytes))),
        }
        let e = spent.entry(what).or_default();
        e.0 += 1;
        e.1 += t0.elapsed();
        if mirror.len() > 100_000 {
            mirror = KvMirror::new(WorkerId(1), BlockSize::new(2).expect("non-zero"));
        }
    }
    eprintln!(
        "{cases} cases (seed {seed:#x}) in {:.2} s, {decoded} decoded; {spent:?}",
        started.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} failures (seed {seed:#x}):\n{}",
        failures.len(),
        failures[..failures.len().min(10)].join("\n")
    );
    assert!(
        decoded > cases / 20,
        "damage should leave some batches valid"
    );
}

/// Lying lengths at every level of a batch: each is refused (truncated), and the decoder
/// does not reserve what the heads claim (`Reader::capacity` caps a reservation at the bytes
/// left): 4 G events reserved would abort the process.
#[test]
fn lying_lengths_are_refused_without_reserving_them() {
    let started = std::time::Instant::now();
    // [ts, events<4G>]
    let mut events = vec![0x92, 0x00];
    events.extend(LIARS[0]);
    // [ts, [["BlockStored", hashes<4G>]]]
    let mut hashes = vec![0x92, 0x00, 0x91, 0x92, 0xab];
    hashes.extend(b"BlockStored");
    hashes.extend(LIARS[0]);
    // {"ts": 0, "events": [{"type": <str of 4G>}]}
    let mut tag = vec![0x82, 0xa2, b't', b's', 0x00, 0xa6];
    tag.extend(b"events");
    tag.extend([0x91, 0x81, 0xa4]);
    tag.extend(b"type");
    tag.extend(LIARS[2]);
    // A map batch with 4 G keys.
    let keys = LIARS[1].to_vec();
    for bytes in [events, hashes, tag, keys] {
        for tail in [0, 64, 4096] {
            let mut b = bytes.clone();
            b.resize(b.len() + tail, 0xc0);
            assert!(decode_batch(&b).is_err(), "{}", hex(&b));
        }
    }
    eprintln!("lying lengths refused in {:?}", started.elapsed());
}

/// The largest payload the decoder takes (16 MiB), all of it one lying list of nils.
///
/// (It found the decoder reserving 224 times the payload — `Vec::<EngineEvent>` sized by
/// the bytes left, counted in elements: one 3.76 GB allocation for 16 MiB; reservations are
/// now capped in bytes.)
#[test]
fn the_largest_lying_payload_is_refused() {
    let mut big = vec![0x92, 0x00];
    big.extend(LIARS[0]);
    big.resize(MAX_PAYLOAD_BYTES, 0xc0);
    assert!(decode_batch(&big).is_err());
}
