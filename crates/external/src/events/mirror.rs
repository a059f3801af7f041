//! [`KvMirror`]: what one engine holds, by the engine's block hashes, and the tandem changes
//! each engine event makes. Sans-IO: no sockets, no clock, no tokio (docs/CONVENTIONS.md §2).
//!
//! The engine's hashes are not tandem's (vLLM hashes `(parent, token tuple, extra keys)` with
//! sha256 or a per-process random seed), so the mirror recomputes tandem's from the
//! `BlockStored` event's `token_ids`, split into `block_size` blocks (a trailing partial
//! block is ignored), chained onto the parent's tandem hash. A block's seed is its parent's;
//! a sequence start (`parent_block_hash` is `None`) is seeded as the frontend seeds a
//! request, [`HashSeed::for_request`]`(cache_salt, adapter)`:
//! - the cache salt is the one among the first block's `extra_keys`, if any: vLLM's
//!   `generate_block_hash_extra_keys` (`vllm/v1/core/kv_cache_utils.py`) builds a block's
//!   tuple as LoRA keys (`[lora_name]`), multimodal keys (`(identifier, offset)` pairs),
//!   `[cache_salt]` on a request's first block only, and prompt-embedding digests (bytes).
//!   The salt is therefore the *last* top-level string of the first block's tuple once a
//!   leading string equal to the event's `lora_name` is set aside;
//! - the adapter is the event's `lora_name`, else its `lora_id` as a decimal string (the
//!   older vLLM schema's and SGLang's only LoRA field), else none.
//!
//! Without LoRA that is `HashSeed::from_salt(salt)` ([`HashSeed::UNSALTED`] without a salt).
//! So a vLLM chain matches a tandem request with the same cache salt on the adapter of the
//! same name (vLLM serves an adapter under its `lora_name`, the name a tandem request gives
//! as its `model`), and never one on another adapter or the base model. A chain known by
//! `lora_id` alone matches only a request on an adapter named by that number: usually none
//! (safe: no false sharing, only lost overlap).
//!
//! Per engine hash the mirror keeps the tandem sequence hash, local hash, seed, tier and
//! parent. Rules:
//! - A `BlockStored` whose parent hash the mirror does not know cannot be chained: it is
//!   dropped and counted (`unknown_parent`). That is a divergence (the relay joined late or
//!   lost a batch it could not repair); it heals as the engine evicts and re-stores.
//! - A `BlockRemoved` of an unknown hash is ignored and counted; one for another medium than
//!   the block's is ignored (the block moved; tandem tiers are exclusive).
//! - A block stored in a tier while held in another moves: `Removed` in the old tier, then
//!   `Stored` in the new one.
//! - `AllBlocksCleared` gives `Cleared` for every tier that held blocks and empties the mirror.
//! - A `block_size` other than the configured one is an error: counted, the event skipped
//!   (the frontend refuses mismatched block sizes loudly; the relay must not corrupt the
//!   index meanwhile).
//! - Hybrid models send events per KV cache group (`group_idx`). The mirror follows one group:
//!   the first whose `BlockStored` is not a sliding-window, chunked-local or mamba group
//!   (`kv_cache_spec_kind`), since only those keep prefixes closed. Others are counted.
//! - Two engine blocks may map to one tandem hash (tandem hashes tokens only; vLLM also hashes
//!   multimodal identifiers): the tandem block is reference counted per tier, `Stored` on the
//!   first holder, `Removed` with the last.
//!
//! Bounded: by what the engine holds, and by `max_blocks` in case of divergence (past it the
//! mirror clears and starts over).

use hashbrown::HashMap;
use hashbrown::hash_map::Entry as MapEntry;
use tandem_protocol::hashing::{chain_sequence_hash, local_block_hash};
use tandem_protocol::{
    BlockSize, HashSeed, KvEventKind, LocalBlockHash, SequenceHash, StorageTier, StoredBlock,
    WorkerId,
};

use super::codec::{EngineEvent, EngineHash};

/// Default bound on mirrored blocks: beyond any single engine's cache (4 Mi blocks is 64 Mi
/// tokens at 16 per block), a few hundred MiB at worst.
pub const DEFAULT_MAX_BLOCKS: usize = 4 << 20;

/// The tier of a `medium` string (vLLM `MEDIUM_GPU = "GPU"`; offloading connectors use
/// `"CPU"`; `"DISK"`), case-insensitively; `None` (older schemas) is the device. An unknown
/// medium is taken as the device, with a debug log.
pub fn tier_of_medium(medium: Option<&str>) -> StorageTier {
    match medium {
        None => StorageTier::Device,
        Some(m) if m.eq_ignore_ascii_case("GPU") => StorageTier::Device,
        Some(m) if m.eq_ignore_ascii_case("CPU") => StorageTier::Host,
        Some(m) if m.eq_ignore_ascii_case("DISK") => StorageTier::Disk,
        Some(m) => {
            tracing::debug!(medium = m, "unknown KV event medium, taken as the device");
            StorageTier::Device
        }
    }
}

/// Counters of what the mirror did and refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MirrorStats {
    /// Engine blocks held now.
    pub blocks: usize,
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    pub clears: u64,
    pub tier_moves: u64,
    /// `BlockStored` events dropped because their parent is unknown.
    pub unknown_parent: u64,
    /// Removed hashes the mirror did not hold.
    pub unknown_removed: u64,
    /// Removed hashes held in another tier than the event's medium.
    pub tier_mismatch_removed: u64,
    /// Events skipped for a block size other than the configured one.
    pub block_size_mismatch: u64,
    /// `BlockStored` events whose token count and hash count disagree (the shorter wins).
    pub token_count_mismatch: u64,
    /// Events of a KV cache group other than the followed one.
    pub other_group_events: u64,
    /// Events of a class the codec does not know.
    pub unknown_events: u64,
    /// Times the mirror hit `max_blocks` and started over.
    pub overflows: u64,
}

/// One engine block.
#[derive(Clone, Copy, Debug)]
struct Entry {
    sequence: SequenceHash,
    local: LocalBlockHash,
    seed: HashSeed,
    tier: StorageTier,
    parent: Option<SequenceHash>,
    /// Insertion order, for deterministic dumps.
    order: u64,
}

/// The changes of one event, in the order they must be applied.
pub type Changes = Vec<(StorageTier, KvEventKind)>;

/// The sans-IO mirror of one engine's KV cache.
#[derive(Debug)]
pub struct KvMirror {
    worker_id: WorkerId,
    block_size: BlockSize,
    max_blocks: usize,
    entries: HashMap<u64, Entry>,
    /// Holders per tandem block per tier.
    held: HashMap<(StorageTier, SequenceHash), u32>,
    tier_blocks: [usize; 3],
    group: Option<i64>,
    next_order: u64,
    stats: MirrorStats,
}

impl KvMirror {
    pub fn new(worker_id: WorkerId, block_size: BlockSize) -> Self {
        KvMirror {
            worker_id,
            block_size,
            max_blocks: DEFAULT_MAX_BLOCKS,
            entries: HashMap::new(),
            held: HashMap::new(),
            tier_blocks: [0; 3],
            group: None,
            next_order: 0,
            stats: MirrorStats::default(),
        }
    }

    /// Bounds the mirror to `max_blocks` engine blocks (at least 1).
    pub fn with_max_blocks(mut self, max_blocks: usize) -> Self {
        self.max_blocks = max_blocks.max(1);
        self
    }

    pub fn worker_id(&self) -> WorkerId {
        self.worker_id
    }

    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// Engine blocks held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn stats(&self) -> MirrorStats {
        MirrorStats {
            blocks: self.entries.len(),
            ..self.stats
        }
    }

    /// The tandem sequence hash and tier of an engine block, if held.
    pub fn lookup(&self, hash: &EngineHash) -> Option<(SequenceHash, StorageTier)> {
        self.entries.get(&hash.key()).map(|e| (e.sequence, e.tier))
    }

    /// How many leading blocks of `chain` (tandem sequence hashes, in prompt order) the engine
    /// holds in `tier`: the prefix a request would find in its cache now.
    pub fn prefix_held(&self, tier: StorageTier, chain: &[SequenceHash]) -> usize {
        chain
            .iter()
            .take_while(|h| self.held.get(&(tier, **h)).is_some_and(|n| *n > 0))
            .count()
    }

    /// Applies one engine event; returns the tandem changes it makes, in order.
    pub fn apply(&mut self, event: &EngineEvent) -> Changes {
        match event {
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
                if *block_size != self.block_size.get() {
                    self.stats.block_size_mismatch += 1;
                    tracing::debug!(
                        worker = %self.worker_id,
                        engine = block_size,
                        configured = self.block_size.get(),
                        "BlockStored with another block size skipped"
                    );
                    return Vec::new();
                }
                let sliding = kv_cache_spec_sliding_window.is_some()
                    || kv_cache_spec_kind.as_deref().is_some_and(not_prefix_closed);
                if !self.follows_stored_group(*group_idx, sliding) {
                    self.stats.other_group_events += 1;
                    return Vec::new();
                }
                let start_seed =
                    || chain_start_seed(extra_keys.as_ref(), lora_name.as_deref(), *lora_id);
                self.stored(
                    block_hashes,
                    parent_block_hash.as_ref(),
                    token_ids,
                    tier_of_medium(medium.as_deref()),
                    start_seed,
                )
            }
            EngineEvent::BlockRemoved {
                block_hashes,
                medium,
                group_idx,
            } => {
                if let (Some(g), Some(followed)) = (group_idx, self.group)
                    && *g != followed
                {
                    self.stats.other_group_events += 1;
                    return Vec::new();
                }
                self.removed(block_hashes, tier_of_medium(medium.as_deref()))
            }
            EngineEvent::AllBlocksCleared => self.clear(),
            EngineEvent::Unknown { tag } => {
                self.stats.unknown_events += 1;
                tracing::debug!(worker = %self.worker_id, tag, "unknown KV event class ignored");
                Vec::new()
            }
        }
    }

    /// Forgets everything: `Cleared` for every tier that held blocks.
    pub fn clear(&mut self) -> Changes {
        let out = StorageTier::ALL
            .into_iter()
            .filter(|t| self.tier_blocks[t.index()] > 0)
            .map(|t| (t, KvEventKind::Cleared))
            .collect();
        self.entries.clear();
        self.held.clear();
        self.tier_blocks = [0; 3];
        self.group = None;
        self.stats.clears += 1;
        out
    }

    /// The whole state as `Stored` changes: Device, Host, Disk, parents before children within
    /// each tier, consecutive chain links merged into one change.
    pub fn dump(&self) -> Changes {
        let mut out = Vec::new();
        for tier in StorageTier::ALL {
            if self.tier_blocks[tier.index()] == 0 {
                continue;
            }
            // One node per tandem block (the earliest holder speaks for it).
            let mut nodes: HashMap<SequenceHash, (LocalBlockHash, Option<SequenceHash>, u64)> =
                HashMap::new();
            for e in self.entries.values().filter(|e| e.tier == tier) {
                let node = nodes
                    .entry(e.sequence)
                    .or_insert((e.local, e.parent, e.order));
                if e.order < node.2 {
                    *node = (e.local, e.parent, e.order);
                }
            }
            let mut order: Vec<(u64, SequenceHash)> =
                nodes.iter().map(|(s, n)| (n.2, *s)).collect();
            order.sort_unstable();
            let mut emitted: hashbrown::HashSet<SequenceHash> = hashbrown::HashSet::new();
            let mut chain: Option<(Option<SequenceHash>, Vec<StoredBlock>)> = None;
            let mut stack = Vec::new();
            for (_, seq) in order {
                // Ancestors held in this tier and not yet written go first.
                let mut cur = Some(seq);
                while let Some(s) = cur {
                    if emitted.contains(&s) || stack.len() > nodes.len() {
                        break;
                    }
                    let Some(node) = nodes.get(&s) else { break };
                    stack.push(s);
                    cur = node.1;
                }
                while let Some(s) = stack.pop() {
                    if !emitted.insert(s) {
                        continue;
                    }
                    let Some(&(local, parent, _)) = nodes.get(&s) else {
                        continue;
                    };
                    let block = StoredBlock {
                        sequence_hash: s,
                        local_hash: local,
                    };
                    match &mut chain {
                        Some((_, blocks))
                            if blocks.last().map(|b| b.sequence_hash) == parent
                                && parent.is_some() =>
                        {
                            blocks.push(block);
                        }
                        _ => {
                            if let Some((p, blocks)) = chain.take() {
                                out.push((tier, KvEventKind::Stored { parent: p, blocks }));
                            }
                            chain = Some((parent, vec![block]));
                        }
                    }
                }
            }
            if let Some((p, blocks)) = chain {
                out.push((tier, KvEventKind::Stored { parent: p, blocks }));
            }
        }
        out
    }

    /// Whether to follow a `BlockStored` of `group`; learns the followed group.
    fn follows_stored_group(&mut self, group: Option<i64>, sliding: bool) -> bool {
        let Some(g) = group else { return true };
        match self.group {
            Some(followed) => followed == g,
            None if sliding => false,
            None => {
                self.group = Some(g);
                true
            }
        }
    }

    fn stored(
        &mut self,
        hashes: &[EngineHash],
        parent: Option<&EngineHash>,
        tokens: &[u32],
        tier: StorageTier,
        start_seed: impl FnOnce() -> HashSeed,
    ) -> Changes {
        let bs = self.block_size.tokens();
        let token_blocks = tokens.len() / bs;
        if token_blocks != hashes.len() {
            self.stats.token_count_mismatch += 1;
            tracing::debug!(
                worker = %self.worker_id,
                hashes = hashes.len(),
                tokens = tokens.len(),
                "BlockStored token count does not match its hashes; the shorter wins"
            );
        }
        let n = token_blocks.min(hashes.len());
        let mut out = Vec::new();
        if self.entries.len().saturating_add(n) > self.max_blocks {
            self.stats.overflows += 1;
            tracing::warn!(
                worker = %self.worker_id,
                max = self.max_blocks,
                "KV mirror over its bound (events lost?): clearing and starting over"
            );
            out = self.clear();
        }
        let (mut prev, seed) = match parent {
            None => (None, start_seed()),
            Some(p) => match self.entries.get(&p.key()) {
                Some(e) => (Some(e.sequence), e.seed),
                None => {
                    self.stats.unknown_parent += 1;
                    tracing::debug!(
                        worker = %self.worker_id,
                        parent = ?p,
                        "BlockStored with an unknown parent dropped"
                    );
                    return out;
                }
            },
        };
        let mut removed: [Vec<SequenceHash>; 3] = Default::default();
        let mut chains: Vec<(Option<SequenceHash>, Vec<StoredBlock>)> = Vec::new();
        let mut open = false;
        for (hash, block) in hashes.iter().zip(tokens.chunks_exact(bs)).take(n) {
            let local = local_block_hash(block, seed);
            let sequence = chain_sequence_hash(prev, local, seed);
            let entry = Entry {
                sequence,
                local,
                seed,
                tier,
                parent: prev,
                order: self.next_order,
            };
            self.next_order += 1;
            if self.insert(hash.key(), entry, &mut removed) {
                let sb = StoredBlock {
                    sequence_hash: sequence,
                    local_hash: local,
                };
                match chains.last_mut() {
                    Some((_, blocks)) if open => blocks.push(sb),
                    _ => chains.push((prev, vec![sb])),
                }
                open = true;
            } else {
                open = false;
            }
            prev = Some(sequence);
        }
        for t in StorageTier::ALL {
            let blocks = std::mem::take(&mut removed[t.index()]);
            if !blocks.is_empty() {
                out.push((t, KvEventKind::Removed { blocks }));
            }
        }
        for (parent, blocks) in chains {
            self.stats.stored_blocks += blocks.len() as u64;
            out.push((tier, KvEventKind::Stored { parent, blocks }));
        }
        out
    }

    /// Inserts or moves one engine block; true when its tandem block is new in its tier.
    fn insert(&mut self, key: u64, entry: Entry, removed: &mut [Vec<SequenceHash>; 3]) -> bool {
        if let Some(old) = self.entries.get(&key).copied() {
            if old.tier == entry.tier && old.sequence == entry.sequence {
                return false;
            }
            if old.tier != entry.tier {
                self.stats.tier_moves += 1;
            }
            if self.release(old.tier, old.sequence) {
                removed[old.tier.index()].push(old.sequence);
            }
        }
        self.entries.insert(key, entry);
        let count = self.held.entry((entry.tier, entry.sequence)).or_insert(0);
        *count += 1;
        if *count == 1 {
            self.tier_blocks[entry.tier.index()] += 1;
            true
        } else {
            false
        }
    }

    /// Drops one holder of a tandem block; true when it was the last.
    fn release(&mut self, tier: StorageTier, sequence: SequenceHash) -> bool {
        match self.held.entry((tier, sequence)) {
            MapEntry::Occupied(mut o) => {
                *o.get_mut() -= 1;
                if *o.get() == 0 {
                    o.remove();
                    self.tier_blocks[tier.index()] -= 1;
                    true
                } else {
                    false
                }
            }
            MapEntry::Vacant(_) => false,
        }
    }

    fn removed(&mut self, hashes: &[EngineHash], tier: StorageTier) -> Changes {
        let mut blocks = Vec::new();
        for h in hashes {
            let key = h.key();
            match self.entries.get(&key).copied() {
                None => self.stats.unknown_removed += 1,
                Some(e) if e.tier != tier => self.stats.tier_mismatch_removed += 1,
                Some(e) => {
                    self.entries.remove(&key);
                    if self.release(e.tier, e.sequence) {
                        blocks.push(e.sequence);
                    }
                }
            }
        }
        if blocks.is_empty() {
            return Vec::new();
        }
        self.stats.removed_blocks += blocks.len() as u64;
        vec![(tier, KvEventKind::Removed { blocks })]
    }
}

/// KV cache group kinds that evict inside a prefix (vLLM `KVCacheSpecKind`).
fn not_prefix_closed(kind: &str) -> bool {
    let k = kind.to_ascii_lowercase();
    k.contains("sliding") || k.contains("chunked") || k.contains("mamba")
}

/// The seed of a sequence start (module doc): the cache salt in the first block's extra
/// keys and the LoRA adapter (`lora_name`, else `lora_id` in decimal), as
/// [`HashSeed::for_request`] seeds a tandem request.
pub(crate) fn chain_start_seed(
    extra_keys: Option<&Vec<Option<Vec<rmpv::Value>>>>,
    lora_name: Option<&str>,
    lora_id: Option<i64>,
) -> HashSeed {
    // An empty name is no adapter, as an empty `lora_adapter` is the base model in tandem.
    let lora_name = lora_name.filter(|n| !n.is_empty());
    let salt = cache_salt(extra_keys, lora_name);
    let id_name;
    let adapter = match (lora_name, lora_id) {
        (Some(name), _) => Some(name),
        (None, Some(id)) => {
            id_name = id.to_string();
            Some(id_name.as_str())
        }
        (None, None) => None,
    };
    HashSeed::for_request(salt.map(str::as_bytes), adapter)
}

/// The cache salt in the first block's extra keys: its last top-level string, after setting
/// aside a leading one equal to `lora_name` (vLLM puts the LoRA name first, the salt after the
/// multimodal pairs).
fn cache_salt<'a>(
    extra_keys: Option<&'a Vec<Option<Vec<rmpv::Value>>>>,
    lora_name: Option<&str>,
) -> Option<&'a str> {
    let first = extra_keys?.first()?.as_ref()?;
    let mut strings = first.iter().filter_map(rmpv::Value::as_str).peekable();
    if let (Some(name), Some(&lead)) = (lora_name, strings.peek())
        && lead == name
    {
        strings.next();
    }
    strings.last()
}
