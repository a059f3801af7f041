//! The pool's mutating operations and its invariant check.

use hashbrown::HashMap;
use tandem_protocol::{BlockHashes, RequestId, SequenceHash, StorageTier};

use super::{BlockPool, CachedInfo, Location, PoolError, PrefixHit, SeqBlocks};
use crate::arena::copy_block;

impl BlockPool {
    /// Starts a sequence on its cached prefix: takes a reference on each leading block of
    /// `hashes` already cached (up to `max_blocks`), bringing host blocks back to device while
    /// a device block can be had. Returns what it reused; the sequence's table then holds
    /// exactly those blocks, all committed.
    pub fn acquire_prefix(
        &mut self,
        seq: RequestId,
        hashes: &[BlockHashes],
        max_blocks: usize,
    ) -> Result<PrefixHit, PoolError> {
        if self.seqs.contains_key(&seq) {
            return Err(PoolError::DuplicateSequence(seq));
        }
        let mut table = SeqBlocks::default();
        let mut hit = PrefixHit::default();
        for h in hashes.iter().take(max_blocks) {
            match self.cached.get(&h.sequence).copied() {
                Some(Location::Device(b)) => {
                    self.take_ref(b);
                    table.blocks.push(b);
                    hit.device += 1;
                }
                Some(Location::Host(slot)) => {
                    if self.available_blocks() == 0 {
                        break;
                    }
                    let b = self.promote(slot);
                    self.take_ref(b);
                    table.blocks.push(b);
                    hit.host += 1;
                }
                Some(Location::Disk(slot)) => {
                    if self.available_blocks() == 0 {
                        break;
                    }
                    // A block that does not read back intact ends the prefix here.
                    let Some(b) = self.promote_disk(slot) else {
                        break;
                    };
                    self.take_ref(b);
                    table.blocks.push(b);
                    hit.disk += 1;
                }
                None => break,
            }
        }
        table.committed = table.blocks.len();
        self.stats.prefix_hit_blocks += table.committed as u64;
        self.seqs.insert(seq, table);
        self.log.flush();
        Ok(hit)
    }

    /// [`acquire_prefix`](Self::acquire_prefix) then [`allocate`](Self::allocate), all or
    /// nothing: when the pool cannot give the sequence its cached prefix and room for
    /// `total_tokens` now, `OutOfBlocks` and nothing changed (no promotion, no eviction, no
    /// event). For reservations that cannot wait for room, such as the destination of a KV
    /// transfer.
    pub fn acquire_and_allocate(
        &mut self,
        seq: RequestId,
        hashes: &[BlockHashes],
        max_blocks: usize,
        total_tokens: usize,
    ) -> Result<PrefixHit, PoolError> {
        if self.seqs.contains_key(&seq) {
            return Err(PoolError::DuplicateSequence(seq));
        }
        // What the two calls take from the available blocks: each unreferenced cached device
        // block of the prefix (it leaves the LRU), each host or disk block (promoted into a
        // device block), and each fresh block. Device hits come before host hits and host hits
        // before disk hits (each union of tiers is prefix-closed), and a promotion frees its
        // slot before it evicts, so its eviction never takes a block of this prefix. A disk
        // block that does not read back ends the prefix early: fewer promotions, as many more
        // fresh blocks, the same room.
        let (mut reused, mut pinned, mut promoted) = (0, 0, 0);
        for h in hashes.iter().take(max_blocks) {
            match self.cached.get(&h.sequence) {
                Some(Location::Device(b)) => {
                    reused += 1;
                    pinned += usize::from(self.device[*b as usize].refs == 0);
                }
                Some(Location::Host(_) | Location::Disk(_)) => {
                    reused += 1;
                    promoted += 1;
                }
                None => break,
            }
        }
        let fresh = self
            .cfg
            .block_size
            .blocks_for(total_tokens)
            .saturating_sub(reused);
        let needed = pinned + promoted + fresh;
        let available = self.available_blocks();
        if needed > available {
            return Err(PoolError::OutOfBlocks { needed, available });
        }
        let hit = self.acquire_prefix(seq, hashes, max_blocks)?;
        debug_assert!(
            hit.total() <= reused,
            "no block acquired beyond those counted"
        );
        if let Err(e) = self.allocate(seq, total_tokens) {
            debug_assert!(false, "allocation after the room check failed: {e}");
            let _ = self.free(seq);
            return Err(e);
        }
        Ok(hit)
    }

    /// Grows a sequence's table to hold `total_tokens` tokens, evicting cached blocks if it
    /// must. All or nothing: on `OutOfBlocks` nothing changed. Creates the sequence if new.
    pub fn allocate(&mut self, seq: RequestId, total_tokens: usize) -> Result<(), PoolError> {
        let need_total = self.cfg.block_size.blocks_for(total_tokens);
        let held = self.seqs.get(&seq).map_or(0, |s| s.blocks.len());
        let needed = need_total.saturating_sub(held);
        if needed > self.available_blocks() {
            return Err(PoolError::OutOfBlocks {
                needed,
                available: self.available_blocks(),
            });
        }
        let mut fresh = Vec::with_capacity(needed);
        for _ in 0..needed {
            let b = self
                .take_device_block()
                .expect("availability checked above");
            self.device[b as usize].refs = 1;
            fresh.push(b);
        }
        self.seqs.entry(seq).or_default().blocks.extend(fresh);
        self.log.flush();
        Ok(())
    }

    /// Commits the sequence's full blocks to the prefix cache: `hashes` are the hashes of all
    /// its full blocks so far (its KV must already be written). A block whose hash is cached
    /// already on device is swapped for the cached one (equal prefixes, equal KV); one cached
    /// on host is replaced by this fresh device copy.
    pub fn commit(&mut self, seq: RequestId, hashes: &[BlockHashes]) -> Result<(), PoolError> {
        let Some(mut table) = self.seqs.remove(&seq) else {
            return Err(PoolError::UnknownSequence(seq));
        };
        if hashes.len() > table.blocks.len() {
            let err = PoolError::CommitBeyondTable {
                seq,
                held: table.blocks.len(),
                asked: hashes.len(),
            };
            self.seqs.insert(seq, table);
            return Err(err);
        }
        let start = table.committed.min(hashes.len());
        if let Some(&b) = table.blocks[start..hashes.len()]
            .iter()
            .find(|&&b| self.held.contains_key(&b))
        {
            // Its bytes may still change: a transfer into it was not fenced.
            self.seqs.insert(seq, table);
            return Err(PoolError::CommitHeld(b));
        }
        for i in table.committed..hashes.len() {
            let h = hashes[i];
            let parent = i.checked_sub(1).map(|p| hashes[p].sequence);
            let own = table.blocks[i];
            match self.cached.get(&h.sequence).copied() {
                Some(Location::Device(other)) => {
                    self.take_ref(other);
                    self.release_block(own);
                    table.blocks[i] = other;
                }
                Some(Location::Host(slot)) => {
                    self.drop_host(slot);
                    self.register_device(own, h, parent, i);
                }
                Some(Location::Disk(slot)) => {
                    self.drop_disk(slot);
                    self.register_device(own, h, parent, i);
                }
                None => self.register_device(own, h, parent, i),
            }
        }
        table.committed = table.committed.max(hashes.len());
        self.seqs.insert(seq, table);
        self.log.flush();
        Ok(())
    }

    /// Ends a sequence: releases its blocks tail first, so that its tail is evicted before its
    /// head (the prefix-closure invariant). Cached blocks stay reusable until evicted.
    pub fn free(&mut self, seq: RequestId) -> Result<(), PoolError> {
        let table = self
            .seqs
            .remove(&seq)
            .ok_or(PoolError::UnknownSequence(seq))?;
        for &b in table.blocks.iter().rev() {
            self.release_block(b);
        }
        self.log.flush();
        Ok(())
    }

    /// Keeps `blocks` out of the free list until [`release_hold`](Self::release_hold), even
    /// after the sequence holding them ends: the destination blocks of a KV transfer that a
    /// remote writer may still be writing (an aborted remote prefill), which must not be
    /// handed to anyone else before the writer is known to be done. Each block must be
    /// referenced and not cached (a transfer writes fresh blocks only). All or nothing.
    pub fn hold(&mut self, blocks: &[u32]) -> Result<(), PoolError> {
        if let Some(&b) = blocks.iter().find(|&&b| {
            self.device
                .get(b as usize)
                .is_none_or(|blk| blk.refs == 0 || blk.cached.is_some())
        }) {
            return Err(PoolError::NotHoldable(b));
        }
        for &b in blocks {
            self.take_ref(b);
            *self.held.entry(b).or_insert(0) += 1;
        }
        Ok(())
    }

    /// Keeps the whole table of `seq` (its cached prefix included) out of reuse after the
    /// sequence ends, until [`release_hold`](Self::release_hold) with the returned blocks:
    /// what a prefill worker sends by reference stays as computed until the transport has
    /// read it. The table is a whole prefix, so closure holds while it is pinned.
    pub fn pin(&mut self, seq: RequestId) -> Result<Vec<u32>, PoolError> {
        let blocks = self
            .seqs
            .get(&seq)
            .ok_or(PoolError::UnknownSequence(seq))?
            .blocks
            .clone();
        for &b in &blocks {
            self.take_ref(b);
            *self.held.entry(b).or_insert(0) += 1;
        }
        Ok(blocks)
    }

    /// Ends a [`hold`](Self::hold) or a [`pin`](Self::pin): blocks no sequence references any more become free.
    /// All or nothing.
    pub fn release_hold(&mut self, blocks: &[u32]) -> Result<(), PoolError> {
        let mut counts: HashMap<u32, u32> = HashMap::new();
        for &b in blocks {
            *counts.entry(b).or_insert(0) += 1;
        }
        if let Some(&b) = blocks
            .iter()
            .find(|b| self.held.get(*b).is_none_or(|h| *h < counts[*b]))
        {
            return Err(PoolError::NotHeld(b));
        }
        for &b in blocks.iter().rev() {
            if let hashbrown::hash_map::Entry::Occupied(mut e) = self.held.entry(b) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
            self.release_block(b);
        }
        Ok(())
    }

    /// Device blocks held for transfers (see [`hold`](Self::hold) and [`pin`](Self::pin)).
    pub fn held_blocks(&self) -> usize {
        self.held.len()
    }

    /// Drops every unreferenced cached block, on device, host and disk. Blocks in use stay.
    pub fn clear_cache(&mut self) {
        self.clear_disk();
        if !self.host.is_empty() {
            for slot in 0..self.host.len() as u32 {
                if let Some(info) = self.host[slot as usize].take() {
                    self.cached.remove(&info.hash.sequence);
                    self.host_lru.remove(slot);
                    self.host_free.push(slot);
                }
            }
            self.log.cleared(StorageTier::Host);
        }
        while let Some(b) = self.device_lru.pop_front() {
            let info = self.device[b as usize]
                .cached
                .take()
                .expect("LRU blocks are cached");
            self.cached.remove(&info.hash.sequence);
            self.log.removed(StorageTier::Device, info.hash.sequence);
            self.device_free.push(b);
        }
        self.log.flush();
    }

    fn take_ref(&mut self, b: u32) {
        let blk = &mut self.device[b as usize];
        if blk.refs == 0 {
            self.device_lru.remove(b);
        }
        blk.refs += 1;
    }

    fn release_block(&mut self, b: u32) {
        let blk = &mut self.device[b as usize];
        debug_assert!(blk.refs > 0, "double release of block {b}");
        blk.refs -= 1;
        if blk.refs == 0 {
            if blk.cached.is_some() {
                self.device_lru.push_back(b);
            } else {
                self.device_free.push(b);
            }
        }
    }

    pub(super) fn register_device(
        &mut self,
        b: u32,
        hash: BlockHashes,
        parent: Option<SequenceHash>,
        pos: usize,
    ) {
        let info = CachedInfo {
            hash,
            parent,
            position: pos as u32,
        };
        self.device[b as usize].cached = Some(info);
        self.cached.insert(hash.sequence, Location::Device(b));
        self.log.stored(StorageTier::Device, parent, info.stored());
    }

    /// A device block with no content and no references: a free one, or the LRU cached one
    /// evicted (to host when there is a host tier, else to disk when there is a disk tier).
    /// What the arena remembers of its old bytes is dropped: whatever fills it next (a
    /// forward pass, a KV transfer into the region, a tier bringing a block back) writes
    /// new bytes, some behind the arena's back.
    pub(super) fn take_device_block(&mut self) -> Option<u32> {
        let b = self.take_device_block_inner()?;
        self.device_arena.forget(b);
        Some(b)
    }

    fn take_device_block_inner(&mut self) -> Option<u32> {
        if let Some(b) = self.device_free.pop() {
            return Some(b);
        }
        let b = self.device_lru.pop_front()?;
        let info = self.device[b as usize]
            .cached
            .take()
            .expect("LRU blocks are cached");
        self.stats.device_evictions += 1;
        self.log.removed(StorageTier::Device, info.hash.sequence);
        self.cached.remove(&info.hash.sequence);
        if !self.host.is_empty() {
            self.demote(b, info);
        } else if self.disk_store.is_some() {
            let bytes = self.device_arena.block_bytes(b);
            self.demote_to_disk(info, &bytes);
        }
        Some(b)
    }

    /// Copies an evicted device block into the host tier, evicting the host's LRU if full
    /// (to disk when there is a disk tier).
    pub(super) fn demote(&mut self, b: u32, info: CachedInfo) {
        let slot = match self.host_free.pop() {
            Some(s) => s,
            None => {
                let s = self
                    .host_lru
                    .pop_front()
                    .expect("a full host tier has an LRU block");
                let old = self.host[s as usize].take().expect("LRU slots are filled");
                self.cached.remove(&old.hash.sequence);
                self.stats.host_evictions += 1;
                self.log.removed(StorageTier::Host, old.hash.sequence);
                if self.disk_store.is_some() {
                    let bytes = self.host_arena.block_bytes(s);
                    self.demote_to_disk(old, &bytes);
                }
                s
            }
        };
        copy_block(&self.device_arena, b, &mut self.host_arena, slot);
        self.host[slot as usize] = Some(info);
        self.host_lru.push_back(slot);
        self.cached.insert(info.hash.sequence, Location::Host(slot));
        self.log
            .stored(StorageTier::Host, info.parent, info.stored());
    }

    /// Brings a host block back to device; the caller checked a device block is available.
    /// The host slot is released before the device block is taken, so that the eviction this
    /// may cause can move a device block into it.
    fn promote(&mut self, slot: u32) -> u32 {
        let info = self.host[slot as usize].expect("promoted slot is filled");
        let bytes = self.host_arena.block_bytes(slot);
        self.drop_host(slot);
        let b = self
            .take_device_block()
            .expect("caller checked availability");
        self.device_arena.write_block(b, &bytes);
        self.stats.host_promotions += 1;
        self.register_device(b, info.hash, info.parent, info.position as usize);
        b
    }

    fn drop_host(&mut self, slot: u32) {
        let info = self.host[slot as usize]
            .take()
            .expect("dropped slot is filled");
        self.host_lru.remove(slot);
        self.host_free.push(slot);
        self.cached.remove(&info.hash.sequence);
        self.log.removed(StorageTier::Host, info.hash.sequence);
    }

    /// Checks every structural invariant, prefix closure included. For tests and debugging;
    /// O(pool size).
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut refs = vec![0u32; self.device.len()];
        for (id, s) in &self.seqs {
            if s.committed > s.blocks.len() {
                return Err(format!(
                    "{id}: committed {} > held {}",
                    s.committed,
                    s.blocks.len()
                ));
            }
            for (i, &b) in s.blocks.iter().enumerate() {
                refs[b as usize] += 1;
                if i < s.committed && self.device[b as usize].cached.is_none() {
                    return Err(format!("{id}: committed block {b} is not cached"));
                }
            }
        }
        for (&b, &n) in &self.held {
            refs[b as usize] += n;
        }
        let free: hashbrown::HashSet<u32> = self.device_free.iter().copied().collect();
        if free.len() != self.device_free.len() {
            return Err("device free list has duplicates".into());
        }
        for (b, blk) in self.device.iter().enumerate() {
            let b32 = b as u32;
            if blk.refs != refs[b] {
                return Err(format!(
                    "block {b}: refs {} but {} table entries and holds",
                    blk.refs, refs[b]
                ));
            }
            let states = [
                blk.refs > 0,
                free.contains(&b32),
                self.device_lru.contains(b32),
            ];
            if states.iter().filter(|x| **x).count() != 1 {
                return Err(format!(
                    "block {b}: not exactly one of referenced/free/lru: {states:?}"
                ));
            }
            if free.contains(&b32) && blk.cached.is_some() {
                return Err(format!("block {b}: free but cached"));
            }
            if self.device_lru.contains(b32) && blk.cached.is_none() {
                return Err(format!("block {b}: in LRU but not cached"));
            }
            if let Some(info) = blk.cached {
                if self.cached.get(&info.hash.sequence) != Some(&Location::Device(b32)) {
                    return Err(format!("block {b}: cached map disagrees"));
                }
                if let Some(p) = info.parent
                    && !matches!(self.cached.get(&p), Some(Location::Device(_)))
                {
                    return Err(format!("device block {b}: parent {p:?} not on device"));
                }
            }
        }
        for (s, info) in self.host.iter().enumerate() {
            let Some(info) = info else { continue };
            if self.cached.get(&info.hash.sequence) != Some(&Location::Host(s as u32)) {
                return Err(format!("host slot {s}: cached map disagrees"));
            }
            if let Some(p) = info.parent
                && !self.cached.contains_key(&p)
            {
                return Err(format!("host slot {s}: parent {p:?} not cached anywhere"));
            }
        }
        self.check_disk()?;
        let n_cached = self.device.iter().filter(|b| b.cached.is_some()).count()
            + self.host.iter().filter(|h| h.is_some()).count()
            + self.disk.iter().filter(|d| d.is_some()).count();
        if n_cached != self.cached.len() {
            return Err(format!(
                "cached map has {} entries, tiers hold {n_cached}",
                self.cached.len()
            ));
        }
        self.check_lru_order()
    }

    /// In each LRU list a child stands before its parent, so eviction takes leaves first.
    fn check_lru_order(&self) -> Result<(), String> {
        children_first("device", &self.device_lru, |b| {
            self.device[b as usize].cached.expect("checked")
        })?;
        children_first("host", &self.host_lru, |s| {
            self.host[s as usize].expect("host LRU slots are filled")
        })?;
        children_first("disk", &self.disk_lru, |s| {
            self.disk[s as usize].expect("disk LRU slots are filled")
        })
    }
}

/// Checks that in `lru` (of a tier named `tier`, `info` giving each entry's block) no block
/// stands after its parent.
fn children_first(
    tier: &str,
    lru: &crate::lru::LruList,
    info: impl Fn(u32) -> CachedInfo,
) -> Result<(), String> {
    let pos: hashbrown::HashMap<SequenceHash, usize> = lru
        .iter()
        .enumerate()
        .map(|(i, e)| (info(e).hash.sequence, i))
        .collect();
    for (i, e) in lru.iter().enumerate() {
        if let Some(pi) = info(e).parent.and_then(|p| pos.get(&p))
            && *pi < i
        {
            return Err(format!("{tier} LRU: entry {e} stands after its parent"));
        }
    }
    Ok(())
}
