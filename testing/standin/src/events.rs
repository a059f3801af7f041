//! The stand-in's KV events in vLLM's shape: tandem's engine announces blocks by their
//! sequence hashes; vLLM announces them by its own hashes with their token ids. The
//! stand-in remembers the tokens of every block its requests could store and translates.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use hashbrown::HashMap;
use tandem_external::events::codec::Value;
use tandem_external::events::{EngineBatch, EngineEvent, EngineHash, WireShape};
use tandem_protocol::{
    BlockSize, Envelope, HashSeed, KvEvent, KvEventKind, SequenceHash, StorageTier,
    TokenBlockHasher,
};
use tandem_runtime::events::Subscription;
use tokio_util::sync::CancellationToken;

use crate::Shared;

/// What the stand-in knows of a block it may have stored.
#[derive(Clone, Debug)]
struct Known {
    tokens: Vec<u32>,
    /// The cache salt of the chain's request, on first blocks only (vLLM's `extra_keys`).
    salt: Option<String>,
    /// The LoRA adapter of the chain's request, on every block (vLLM's `extra_keys` start
    /// with it on each block).
    lora: Option<String>,
}

/// Tokens of the blocks requests could store, by sequence hash; bounded (oldest forgotten).
#[derive(Debug)]
pub struct BlockRegistry {
    block_size: BlockSize,
    blocks: HashMap<SequenceHash, Known>,
    order: VecDeque<SequenceHash>,
    capacity: usize,
}

impl BlockRegistry {
    pub fn new(block_size: BlockSize, capacity: usize) -> Self {
        BlockRegistry {
            block_size,
            blocks: HashMap::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Remembers every full block of `tokens` hashed with the seed of `salt` and `lora`
    /// ([`HashSeed::for_request`], as the engine hashes the request).
    pub fn learn(&mut self, tokens: &[u32], salt: Option<&str>, lora: Option<&str>) {
        let seed = HashSeed::for_request(salt.map(str::as_bytes), lora);
        let mut hasher = TokenBlockHasher::new(self.block_size, seed);
        let mut hashes = Vec::new();
        hasher.extend(tokens, &mut hashes);
        let bs = self.block_size.get() as usize;
        for (i, h) in hashes.iter().enumerate() {
            if self.blocks.contains_key(&h.sequence) {
                continue;
            }
            self.blocks.insert(
                h.sequence,
                Known {
                    tokens: tokens[i * bs..(i + 1) * bs].to_vec(),
                    salt: if i == 0 {
                        salt.map(str::to_string)
                    } else {
                        None
                    },
                    lora: lora.map(str::to_string),
                },
            );
            self.order.push_back(h.sequence);
            while self.order.len() > self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.blocks.remove(&old);
                }
            }
        }
    }

    fn get(&self, h: SequenceHash) -> Option<&Known> {
        self.blocks.get(&h)
    }
}

/// vLLM-style hash of a block: not tandem's (the sidecar must not be able to use it as is).
pub fn engine_hash(h: SequenceHash, wire: WireShape) -> EngineHash {
    let x = xxhash_rust::xxh3::xxh3_64_with_seed(&h.0.to_le_bytes(), 0x5354_414e_4449_4e00);
    match wire {
        // Older vLLM and SGLang: Python ints (signed 64-bit here).
        WireShape::ArrayLike => EngineHash::Int(x as i64),
        // Newest vLLM: bytes.
        WireShape::Map => EngineHash::Bytes(x.to_be_bytes().to_vec()),
    }
}

fn medium(tier: StorageTier) -> &'static str {
    match tier {
        StorageTier::Device => "GPU",
        StorageTier::Host => "CPU",
        StorageTier::Disk => "DISK",
    }
}

/// Translates one tandem event; blocks whose tokens are unknown end the chain there.
fn translate_event(shared: &Shared, ev: &KvEvent, out: &mut Vec<EngineEvent>) {
    let wire = shared.config.wire;
    let bs = shared.config.block_size;
    match &ev.kind {
        KvEventKind::Stored { parent, blocks } => {
            let reg = shared.registry.lock();
            let mut hashes = Vec::new();
            let mut tokens = Vec::new();
            let mut salt = None;
            let mut lora = None;
            for (i, b) in blocks.iter().enumerate() {
                let Some(k) = reg.get(b.sequence_hash) else {
                    shared
                        .counters
                        .untranslated_blocks
                        .fetch_add((blocks.len() - i) as u64, Ordering::Relaxed);
                    break;
                };
                if i == 0 && parent.is_none() {
                    salt = k.salt.clone();
                }
                if i == 0 {
                    lora = k.lora.clone();
                }
                hashes.push(engine_hash(b.sequence_hash, wire));
                tokens.extend_from_slice(&k.tokens);
            }
            if hashes.is_empty() {
                return;
            }
            let n = hashes.len();
            out.push(EngineEvent::BlockStored {
                block_hashes: hashes,
                parent_block_hash: parent.map(|p| engine_hash(p, wire)),
                token_ids: tokens,
                block_size: bs,
                lora_id: None,
                medium: Some(medium(ev.tier).to_string()),
                lora_name: lora.clone(),
                extra_keys: extra_keys(n, lora.as_deref(), salt.as_deref()),
                group_idx: None,
                kv_cache_spec_kind: None,
                kv_cache_spec_sliding_window: None,
            });
        }
        KvEventKind::Removed { blocks } => out.push(EngineEvent::BlockRemoved {
            block_hashes: blocks.iter().map(|h| engine_hash(*h, wire)).collect(),
            medium: Some(medium(ev.tier).to_string()),
            group_idx: None,
        }),
        KvEventKind::Cleared => out.push(EngineEvent::AllBlocksCleared),
    }
}

/// vLLM's `extra_keys` of `n` blocks (`generate_block_hash_extra_keys`,
/// `vllm/v1/core/kv_cache_utils.py`): per block the LoRA name, then on a request's first
/// block its cache salt; None for a block with neither, and none at all when no block has
/// any.
fn extra_keys(n: usize, lora: Option<&str>, salt: Option<&str>) -> Option<Vec<Option<Vec<Value>>>> {
    if lora.is_none() && salt.is_none() {
        return None;
    }
    let keys = (0..n)
        .map(|i| {
            let mut k: Vec<Value> = lora.map(Value::from).into_iter().collect();
            if i == 0
                && let Some(s) = salt
            {
                k.push(Value::from(s));
            }
            (!k.is_empty()).then_some(k)
        })
        .collect();
    Some(keys)
}

/// Reads the engine's tandem events and publishes them in vLLM's shape, one batch per
/// engine batch.
pub(crate) async fn translate(
    shared: Arc<Shared>,
    mut subscription: Subscription,
    stop: CancellationToken,
) {
    loop {
        let payload = tokio::select! {
            p = subscription.next() => match p {
                Some(p) => p,
                None => return,
            },
            () = stop.cancelled() => return,
        };
        let Some(publisher) = &shared.publisher else {
            continue;
        };
        let events = match Vec::<KvEvent>::decode(&payload) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(error = %e, "stand-in: undecodable engine events");
                continue;
            }
        };
        let mut out = Vec::new();
        for ev in &events {
            translate_event(&shared, ev, &mut out);
        }
        if out.is_empty() {
            continue;
        }
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let batch = EngineBatch {
            ts,
            events: out,
            data_parallel_rank: match shared.config.wire {
                WireShape::Map => Some(0),
                WireShape::ArrayLike => None,
            },
        };
        if let Err(e) = publisher.publish(batch).await {
            tracing::warn!(error = %e, "stand-in: publishing KV events failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_keys_carry_the_lora_name_on_every_block_and_the_salt_on_the_first() {
        assert_eq!(extra_keys(3, None, None), None);
        assert_eq!(
            extra_keys(2, None, Some("s")),
            Some(vec![Some(vec![Value::from("s")]), None])
        );
        let lora = Some(vec![Value::from("sql-lora")]);
        assert_eq!(
            extra_keys(3, Some("sql-lora"), Some("s")),
            Some(vec![
                Some(vec![Value::from("sql-lora"), Value::from("s")]),
                lora.clone(),
                lora.clone(),
            ])
        );
        assert_eq!(
            extra_keys(2, Some("sql-lora"), None),
            Some(vec![lora.clone(), lora])
        );
    }
}
