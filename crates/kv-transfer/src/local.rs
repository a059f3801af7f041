//! The in-process transport: a process-wide registry of exposed regions, and writers that copy
//! straight into them. For the embedded cluster (`tandem up`) and tests.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, LazyLock};

use async_trait::async_trait;

use crate::descriptor::{RegionDescriptor, TransportKind};
use crate::error::TransferError;
use crate::region::Region;
use crate::transport::{BlockWriter, Transport};

/// Regions exposed by every `LocalTransport` of this process, by region id.
static REGISTRY: LazyLock<Mutex<HashMap<u64, Arc<Region>>>> = LazyLock::new(Default::default);

fn registry() -> parking_lot::MutexGuard<'static, HashMap<u64, Arc<Region>>> {
    // A panic while holding this lock cannot leave the map inconsistent (single inserts and
    // removes), so a poisoned lock is still usable.
    REGISTRY.lock()
}

fn local_address() -> String {
    format!("local:{}", std::process::id())
}

/// See the module docs. Withdraws what it exposed when dropped.
#[derive(Debug, Default)]
pub struct LocalTransport {
    exposed: Mutex<Vec<u64>>,
}

impl LocalTransport {
    pub fn new() -> Self {
        Self::default()
    }
}

impl Drop for LocalTransport {
    fn drop(&mut self) {
        let ids = std::mem::take(&mut *self.exposed.lock());
        let mut reg = registry();
        for id in ids {
            reg.remove(&id);
        }
    }
}

#[async_trait]
impl Transport for LocalTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Local
    }

    async fn expose(&self, region: Arc<Region>) -> Result<RegionDescriptor, TransferError> {
        let descriptor = RegionDescriptor {
            transport: TransportKind::Local,
            address: local_address(),
            region: region.id(),
            rkey: Vec::new(),
            bytes_per_block: region.bytes_per_block() as u64,
            num_blocks: region.num_blocks(),
            memory: region.memory_kind(),
        };
        registry().insert(region.id(), region);
        self.exposed.lock().push(descriptor.region);
        Ok(descriptor)
    }

    async fn withdraw(&self, descriptor: &RegionDescriptor) -> Result<(), TransferError> {
        let mut mine = self.exposed.lock();
        let Some(pos) = mine.iter().position(|&id| id == descriptor.region) else {
            return Err(TransferError::InvalidArgument(format!(
                "region {} was not exposed by this transport",
                descriptor.region
            )));
        };
        mine.swap_remove(pos);
        registry().remove(&descriptor.region);
        Ok(())
    }

    async fn connect(
        &self,
        remote: &RegionDescriptor,
    ) -> Result<Box<dyn BlockWriter>, TransferError> {
        remote.validate_for(TransportKind::Local)?;
        if remote.address != local_address() {
            return Err(TransferError::PeerFailed(format!(
                "{} is another process; the local transport only reaches this one",
                remote.address
            )));
        }
        let region = registry().get(&remote.region).cloned().ok_or_else(|| {
            TransferError::PeerFailed(format!("no region {} is exposed", remote.region))
        })?;
        if region.bytes_per_block() as u64 != remote.bytes_per_block
            || region.num_blocks() != remote.num_blocks
        {
            return Err(TransferError::BadDescriptor(
                "descriptor does not match the exposed region's shape".into(),
            ));
        }
        Ok(Box::new(LocalWriter {
            remote: remote.clone(),
            region,
        }))
    }
}

/// Copies synchronously into the destination region, so `flush` has nothing to wait for.
#[derive(Debug)]
struct LocalWriter {
    remote: RegionDescriptor,
    region: Arc<Region>,
}

#[async_trait]
impl BlockWriter for LocalWriter {
    fn remote(&self) -> &RegionDescriptor {
        &self.remote
    }

    async fn put(&mut self, dst_block: u32, src: &[u8]) -> Result<(), TransferError> {
        self.remote.check_put(dst_block, src.len())?;
        self.region.write_block(dst_block, src)
    }

    async fn put_region(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
    ) -> Result<(), TransferError> {
        self.remote.check_put(dst_block, src.bytes_per_block())?;
        self.region.copy_block_from(dst_block, src, src_block)
    }

    async fn put_region_part(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
        range: Range<usize>,
    ) -> Result<(), TransferError> {
        self.remote.check_put_part(dst_block, &range)?;
        self.region.copy_part_from(dst_block, src, src_block, range)
    }

    async fn flush(&mut self) -> Result<(), TransferError> {
        Ok(())
    }
}
