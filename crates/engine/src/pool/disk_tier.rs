//! The pool's disk tier: blocks evicted from host memory (or from the device, without a host
//! tier) written to a [`DiskStore`], brought back to device by a prefix hit, recovered from
//! the store when a restarted worker attaches it.

use tandem_protocol::StorageTier;

use super::{BlockPool, CachedInfo, Location};
use crate::disk::DiskStore;
use crate::lru::LruList;

impl BlockPool {
    /// Gives the pool a disk tier in `store`, before the pool is used. The blocks the store
    /// recovered (a restarted worker's cache) are cached on disk again and announced as
    /// stored, parents first; a recovered block whose parent is not among them, or that is
    /// cached already, is cleared from the store instead, so the tiers stay prefix-closed.
    pub fn attach_disk(&mut self, mut store: Box<dyn DiskStore>) {
        let n = store.slots() as usize;
        self.disk = vec![None; n];
        self.disk_lru = LruList::new(n);
        let mut recovered = store.take_recovered();
        recovered.sort_by_key(|(slot, b)| (b.position, *slot));
        let mut kept = Vec::with_capacity(recovered.len());
        for (slot, b) in recovered {
            let fits = (slot as usize) < n
                && self.disk[slot as usize].is_none()
                && !self.cached.contains_key(&b.hash.sequence)
                && (b.position == 0) == b.parent.is_none()
                && b.parent.is_none_or(|p| self.cached.contains_key(&p));
            if !fits {
                if (slot as usize) < n && self.disk[slot as usize].is_none() {
                    store.clear(slot);
                }
                continue;
            }
            let info = CachedInfo {
                hash: b.hash,
                parent: b.parent,
                position: b.position,
            };
            self.disk[slot as usize] = Some(info);
            self.cached.insert(info.hash.sequence, Location::Disk(slot));
            self.log
                .stored(StorageTier::Disk, info.parent, info.stored());
            kept.push(slot);
        }
        // Deeper blocks first in the LRU: eviction takes leaves before their parents.
        for &slot in kept.iter().rev() {
            self.disk_lru.push_back(slot);
        }
        self.disk_free = (0..n as u32)
            .rev()
            .filter(|&s| self.disk[s as usize].is_none())
            .collect();
        self.disk_store = Some(store);
        self.log.flush();
    }

    /// Keeps a block evicted from the tier above (`bytes` its KV) on disk, evicting the
    /// disk's LRU block when it is full. Without a disk tier, or when the write fails, the
    /// block is gone, and so are its descendants on disk.
    pub(super) fn demote_to_disk(&mut self, info: CachedInfo, bytes: &[u8]) {
        if self.disk_store.is_none() || self.disk.is_empty() {
            return;
        }
        let slot = match self.disk_free.pop() {
            Some(s) => s,
            None => {
                let s = self
                    .disk_lru
                    .pop_front()
                    .expect("a full disk tier has an LRU block");
                let old = self.disk[s as usize].take().expect("LRU slots are filled");
                self.cached.remove(&old.hash.sequence);
                self.stats.disk_evictions += 1;
                self.log.removed(StorageTier::Disk, old.hash.sequence);
                s
            }
        };
        let store = self.disk_store.as_mut().expect("checked above");
        if !store.write(slot, &info.disk(), bytes) {
            store.clear(slot);
            self.disk_free.push(slot);
            self.stats.disk_evictions += 1;
            self.drop_disk_orphans();
            return;
        }
        self.disk[slot as usize] = Some(info);
        self.disk_lru.push_back(slot);
        self.cached.insert(info.hash.sequence, Location::Disk(slot));
        self.log
            .stored(StorageTier::Disk, info.parent, info.stored());
    }

    /// Brings disk slot `slot` back to device (the caller checked a device block is
    /// available): the device block, or None on a miss (the block did not read back intact:
    /// it and its descendants on disk are dropped). The slot is released before the device
    /// block is taken, so the evictions this may cause find room on disk.
    pub(super) fn promote_disk(&mut self, slot: u32) -> Option<u32> {
        let info = self.disk[slot as usize].expect("promoted slot is filled");
        let mut bytes = vec![0u8; self.cfg.bytes_per_block];
        let intact = self
            .disk_store
            .as_mut()
            .expect("a disk block implies a disk store")
            .read(slot, &info.disk(), &mut bytes);
        self.drop_disk(slot);
        if !intact {
            self.stats.disk_misses += 1;
            self.drop_disk_orphans();
            return None;
        }
        let b = self
            .take_device_block()
            .expect("caller checked availability");
        self.device_arena.write_block(b, &bytes);
        self.stats.disk_promotions += 1;
        self.register_device(b, info.hash, info.parent, info.position as usize);
        Some(b)
    }

    /// Moves every unreferenced cached block down to disk, as eviction would (device to host
    /// to disk, leaves first), for a worker about to stop: what the disk holds survives the
    /// restart. Blocks in use stay. Without a disk tier, nothing happens.
    pub fn spill_to_disk(&mut self) {
        if self.disk_store.is_none() {
            return;
        }
        while let Some(b) = self.device_lru.pop_front() {
            let info = self.device[b as usize]
                .cached
                .take()
                .expect("LRU blocks are cached");
            self.stats.device_evictions += 1;
            self.log.removed(StorageTier::Device, info.hash.sequence);
            self.cached.remove(&info.hash.sequence);
            if self.host.is_empty() {
                let bytes = self.device_arena.block_bytes(b);
                self.demote_to_disk(info, &bytes);
            } else {
                self.demote(b, info);
            }
            self.device_free.push(b);
        }
        while let Some(slot) = self.host_lru.pop_front() {
            let info = self.host[slot as usize]
                .take()
                .expect("LRU slots are filled");
            self.cached.remove(&info.hash.sequence);
            self.host_free.push(slot);
            self.stats.host_evictions += 1;
            self.log.removed(StorageTier::Host, info.hash.sequence);
            let bytes = self.host_arena.block_bytes(slot);
            self.demote_to_disk(info, &bytes);
        }
        self.log.flush();
    }

    /// Takes `slot`'s block off disk (and out of the store).
    pub(super) fn drop_disk(&mut self, slot: u32) {
        let info = self.disk[slot as usize]
            .take()
            .expect("dropped slot is filled");
        self.disk_lru.remove(slot);
        self.disk_free.push(slot);
        self.cached.remove(&info.hash.sequence);
        if let Some(store) = self.disk_store.as_mut() {
            store.clear(slot);
        }
        self.log.removed(StorageTier::Disk, info.hash.sequence);
    }

    /// Drops the disk blocks whose parent is no longer cached anywhere (after a block left
    /// without moving up: a miss or a failed write), until none is left: closure again. A
    /// scan of the tier, for events that should not happen.
    fn drop_disk_orphans(&mut self) {
        loop {
            let orphans: Vec<u32> = (0..self.disk.len() as u32)
                .filter(|&s| {
                    self.disk[s as usize]
                        .and_then(|i| i.parent)
                        .is_some_and(|p| !self.cached.contains_key(&p))
                })
                .collect();
            if orphans.is_empty() {
                return;
            }
            for s in orphans {
                self.stats.disk_evictions += 1;
                self.drop_disk(s);
            }
        }
    }

    /// Drops every cached disk block (a clear of the cache).
    pub(super) fn clear_disk(&mut self) {
        if self.disk.is_empty() {
            return;
        }
        for slot in 0..self.disk.len() as u32 {
            if let Some(info) = self.disk[slot as usize].take() {
                self.cached.remove(&info.hash.sequence);
                self.disk_lru.remove(slot);
                self.disk_free.push(slot);
                if let Some(store) = self.disk_store.as_mut() {
                    store.clear(slot);
                }
            }
        }
        self.log.cleared(StorageTier::Disk);
    }

    /// The disk tier's part of [`BlockPool::check_invariants`].
    pub(super) fn check_disk(&self) -> Result<(), String> {
        let free: hashbrown::HashSet<u32> = self.disk_free.iter().copied().collect();
        for (s, info) in self.disk.iter().enumerate() {
            let s32 = s as u32;
            let states = [info.is_some(), free.contains(&s32)];
            if states.iter().filter(|x| **x).count() != 1 {
                return Err(format!("disk slot {s}: not exactly one of filled/free"));
            }
            if info.is_some() != self.disk_lru.contains(s32) {
                return Err(format!("disk slot {s}: filled and LRU disagree"));
            }
            let Some(info) = info else { continue };
            if self.cached.get(&info.hash.sequence) != Some(&Location::Disk(s32)) {
                return Err(format!("disk slot {s}: cached map disagrees"));
            }
            if let Some(p) = info.parent
                && !self.cached.contains_key(&p)
            {
                return Err(format!("disk slot {s}: parent {p:?} not cached anywhere"));
            }
        }
        Ok(())
    }
}
