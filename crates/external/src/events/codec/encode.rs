//! The writer half of the codec: what msgspec writes, byte for byte.

use super::{EngineBatch, EngineEvent, EngineHash, Value, WireShape};

/// Encodes a batch exactly as msgspec's `msgspec.msgpack.Encoder` encodes vLLM's classes in
/// the given shape: smallest integer forms (unsigned markers for non-negative ints), floats as
/// float64, `str8` from 32 bytes, tags first.
///
/// An [`EngineEvent::Unknown`] is written as a bare tag (`[tag]` or `{"type": tag}`).
pub fn encode_batch(batch: &EngineBatch, shape: WireShape) -> Vec<u8> {
    let mut w = Writer(Vec::with_capacity(64 + batch.events.len() * 32));
    match shape {
        WireShape::ArrayLike => {
            w.array(3);
            w.f64(batch.ts);
            w.events(&batch.events, shape);
            w.opt_i64(batch.data_parallel_rank);
        }
        WireShape::Map => {
            w.map(2 + usize::from(batch.data_parallel_rank.is_some()));
            w.str("ts");
            w.f64(batch.ts);
            w.str("events");
            w.events(&batch.events, shape);
            if let Some(dp) = batch.data_parallel_rank {
                w.str("data_parallel_rank");
                w.i64(dp);
            }
        }
    }
    w.0
}

struct Writer(Vec<u8>);

impl Writer {
    fn u64(&mut self, v: u64) {
        match v {
            0..=0x7f => self.0.push(v as u8),
            0x80..=0xff => self.0.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                self.0.push(0xcd);
                self.0.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(0xce);
                self.0.extend_from_slice(&(v as u32).to_be_bytes());
            }
            _ => {
                self.0.push(0xcf);
                self.0.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    fn i64(&mut self, v: i64) {
        if v >= 0 {
            return self.u64(v as u64);
        }
        if v >= -32 {
            self.0.push(v as u8);
        } else if v >= i64::from(i8::MIN) {
            self.0.extend_from_slice(&[0xd0, v as u8]);
        } else if v >= i64::from(i16::MIN) {
            self.0.push(0xd1);
            self.0.extend_from_slice(&(v as i16).to_be_bytes());
        } else if v >= i64::from(i32::MIN) {
            self.0.push(0xd2);
            self.0.extend_from_slice(&(v as i32).to_be_bytes());
        } else {
            self.0.push(0xd3);
            self.0.extend_from_slice(&v.to_be_bytes());
        }
    }

    fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_be_bytes());
    }

    fn nil(&mut self) {
        self.0.push(0xc0);
    }

    fn len_head(&mut self, len: usize, fix: Option<(u8, usize)>, m8: Option<u8>, m16: u8, m32: u8) {
        match (fix, m8) {
            (Some((base, max)), _) if len <= max => self.0.push(base | len as u8),
            (_, Some(m)) if len <= 0xff => self.0.extend_from_slice(&[m, len as u8]),
            _ if len <= 0xffff => {
                self.0.push(m16);
                self.0.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                self.0.push(m32);
                self.0.extend_from_slice(&(len as u32).to_be_bytes());
            }
        }
    }

    fn str_bytes(&mut self, s: &[u8]) {
        self.len_head(s.len(), Some((0xa0, 31)), Some(0xd9), 0xda, 0xdb);
        self.0.extend_from_slice(s);
    }

    fn str(&mut self, s: &str) {
        self.str_bytes(s.as_bytes());
    }

    fn bin(&mut self, b: &[u8]) {
        self.len_head(b.len(), None, Some(0xc4), 0xc5, 0xc6);
        self.0.extend_from_slice(b);
    }

    fn array(&mut self, len: usize) {
        self.len_head(len, Some((0x90, 15)), None, 0xdc, 0xdd);
    }

    fn map(&mut self, len: usize) {
        self.len_head(len, Some((0x80, 15)), None, 0xde, 0xdf);
    }

    fn opt_i64(&mut self, v: Option<i64>) {
        match v {
            Some(v) => self.i64(v),
            None => self.nil(),
        }
    }

    fn opt_str(&mut self, v: Option<&str>) {
        match v {
            Some(v) => self.str(v),
            None => self.nil(),
        }
    }

    fn hash(&mut self, h: &EngineHash) {
        match h {
            EngineHash::Int(v) => self.i64(*v),
            EngineHash::Uint(v) => self.u64(*v),
            EngineHash::Bytes(b) => self.bin(b),
        }
    }

    fn hashes(&mut self, hs: &[EngineHash]) {
        self.array(hs.len());
        for h in hs {
            self.hash(h);
        }
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::Nil => self.nil(),
            Value::Boolean(b) => self.0.push(if *b { 0xc3 } else { 0xc2 }),
            Value::Integer(i) => match (i.as_u64(), i.as_i64()) {
                (Some(u), _) => self.u64(u),
                (None, Some(s)) => self.i64(s),
                (None, None) => self.nil(),
            },
            Value::F32(f) => {
                self.0.push(0xca);
                self.0.extend_from_slice(&f.to_be_bytes());
            }
            Value::F64(f) => self.f64(*f),
            Value::String(s) => self.str_bytes(s.as_bytes()),
            Value::Binary(b) => self.bin(b),
            Value::Array(items) => {
                self.array(items.len());
                for item in items {
                    self.value(item);
                }
            }
            Value::Map(items) => {
                self.map(items.len());
                for (k, v) in items {
                    self.value(k);
                    self.value(v);
                }
            }
            Value::Ext(ty, data) => {
                match data.len() {
                    1 => self.0.push(0xd4),
                    2 => self.0.push(0xd5),
                    4 => self.0.push(0xd6),
                    8 => self.0.push(0xd7),
                    16 => self.0.push(0xd8),
                    n => self.len_head(n, None, Some(0xc7), 0xc8, 0xc9),
                }
                self.0.push(*ty as u8);
                self.0.extend_from_slice(data);
            }
        }
    }

    fn extra_keys(&mut self, keys: Option<&Vec<Option<Vec<Value>>>>) {
        let Some(keys) = keys else {
            return self.nil();
        };
        self.array(keys.len());
        for entry in keys {
            match entry {
                None => self.nil(),
                Some(values) => {
                    self.array(values.len());
                    for v in values {
                        self.value(v);
                    }
                }
            }
        }
    }

    fn events(&mut self, events: &[EngineEvent], shape: WireShape) {
        self.array(events.len());
        let map = shape == WireShape::Map;
        for e in events {
            self.event(e, map);
        }
    }

    /// A struct's head: its length, then its tag (first element, or the `"type"` entry).
    fn tagged(&mut self, map: bool, len: usize, tag: &str) {
        if map {
            self.map(len);
            self.str("type");
        } else {
            self.array(len);
        }
        self.str(tag);
    }

    /// A field's key, in map form only.
    fn key(&mut self, map: bool, name: &str) {
        if map {
            self.str(name);
        }
    }

    /// One event in either shape: array-like writes every field in declaration order, maps
    /// name them and leave out the defaulted ones that are `None` (`omit_defaults=True`).
    fn event(&mut self, e: &EngineEvent, map: bool) {
        match e {
            EngineEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium,
                lora_name,
                extra_keys,
                group_idx,
                kv_cache_spec_kind,
                kv_cache_spec_sliding_window,
            } => {
                // Written unless `map` and `None`: the four fields with a default.
                let write = [
                    !map || extra_keys.is_some(),
                    !map || group_idx.is_some(),
                    !map || kv_cache_spec_kind.is_some(),
                    !map || kv_cache_spec_sliding_window.is_some(),
                ];
                let defaulted = write.iter().filter(|&&w| w).count();
                self.tagged(map, 8 + defaulted, "BlockStored");
                self.key(map, "block_hashes");
                self.hashes(block_hashes);
                self.key(map, "parent_block_hash");
                match parent_block_hash {
                    Some(h) => self.hash(h),
                    None => self.nil(),
                }
                self.key(map, "token_ids");
                self.tokens(token_ids);
                self.key(map, "block_size");
                self.u64(u64::from(*block_size));
                self.key(map, "lora_id");
                self.opt_i64(*lora_id);
                self.key(map, "medium");
                self.opt_str(medium.as_deref());
                self.key(map, "lora_name");
                self.opt_str(lora_name.as_deref());
                if write[0] {
                    self.key(map, "extra_keys");
                    self.extra_keys(extra_keys.as_ref());
                }
                if write[1] {
                    self.key(map, "group_idx");
                    self.opt_i64(*group_idx);
                }
                if write[2] {
                    self.key(map, "kv_cache_spec_kind");
                    self.opt_str(kv_cache_spec_kind.as_deref());
                }
                if write[3] {
                    self.key(map, "kv_cache_spec_sliding_window");
                    self.opt_i64(*kv_cache_spec_sliding_window);
                }
            }
            EngineEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => {
                let write_group = !map || group_idx.is_some();
                self.tagged(map, 3 + usize::from(write_group), "BlockRemoved");
                self.key(map, "block_hashes");
                self.hashes(block_hashes);
                self.key(map, "medium");
                self.opt_str(medium.as_deref());
                if write_group {
                    self.key(map, "group_idx");
                    self.opt_i64(*group_idx);
                }
            }
            EngineEvent::AllBlocksCleared => self.tagged(map, 1, "AllBlocksCleared"),
            EngineEvent::Unknown { tag } => self.tagged(map, 1, tag),
        }
    }

    fn tokens(&mut self, tokens: &[u32]) {
        self.array(tokens.len());
        for &t in tokens {
            self.u64(u64::from(t));
        }
    }
}
