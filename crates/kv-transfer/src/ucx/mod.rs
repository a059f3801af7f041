//! The UCX transport: UCP one-sided puts (`ucp_put_nbx`) into regions registered with
//! `ucp_mem_map`, over whatever UCX selects (RDMA, shared memory, TCP); or, for regions UCX
//! allocated in shared memory and a sender on the same host, plain copies into the region
//! mapped with `ucp_rkey_ptr` (see the crate docs, "UCX paths").
//!
//! Layout: `sys` holds the bindings (bindgen's output, generated ahead of time and checked in);
//! `library` loads `libucp.so.0` at run time, once, and is the only way to its functions;
//! `ucp` thin wrappers over the UCP calls; `engine` the worker thread, the only place that
//! calls UCX; `thread` starts it; `handle` the commands and the handle the async side sends
//! them through; `direct`
//! copies into a same-host peer's mapped memory; this module the safe async types.
//!
//! - Receiver: `expose` maps the region and packs its remote key; the descriptor carries the
//!   worker address (hex), the remote key and the address of block 0.
//! - Sender: `connect` creates (or reuses: one endpoint per peer worker) an endpoint from the
//!   descriptor's worker address, flushes it (completing wireup and checking the peer within
//!   the connect timeout), then unpacks the key and asks for a direct mapping. `put_region`
//!   blocks gather into runs: a block that follows the last one in both the source region
//!   and the remote region extends the run (up to [`MAX_RUN_BYTES`]), anything else posts
//!   it, and `flush` posts the last one; a run is one command to the thread and one
//!   `ucp_put_nbx` of its whole range (a layer's or a prompt's blocks, allocated in order on
//!   both sides, are one put: what an RDMA NIC moves best; UCX's TCP and shared-memory
//!   emulations pay per operation). `put` waits until its borrowed buffer is free; `flush`
//!   is `ucp_ep_flush_nbx`, which completes once every earlier put on the endpoint is
//!   remotely complete. With a direct mapping, puts are copies and `flush` a fence.
//! - Failure: endpoints use `UCP_ERR_HANDLING_MODE_PEER` unless configured otherwise; a UCX
//!   error or an operation past its deadline marks the endpoint failed and force-closes it,
//!   which completes everything in flight on it with an error. The next connect to that peer
//!   creates a new endpoint.

mod completion;
mod direct;
mod engine;
mod handle;
mod library;
pub(crate) mod sys;
mod thread;
mod ucp;

use parking_lot::Mutex;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};

use crate::descriptor::{MemoryKind, RegionDescriptor, TransportKind};
use crate::error::TransferError;
use crate::region::{BlockLease, Region};
use crate::transport::{BlockWriter, Transport, TransportConfig, UcxConfig};
use completion::Completion;
use direct::Mapping;
use handle::{Command, EngineHandle, PutSource, RawBuf, WriterState};

/// Extra time the async side gives the worker thread beyond its own deadlines, so that a
/// wedged thread still cannot hang a caller.
const GRACE: Duration = Duration::from_secs(2);

/// Initialises UCX with `config` once and tears it down; returns UCX's version string.
///
/// Loads libucp first (once per process): [`TransferError::UcxNotFound`] when it is not
/// installed or lacks a function, [`TransferError::UcxTooOld`] when it predates the bindings.
pub fn probe(config: &UcxConfig) -> Result<String, TransferError> {
    ucp::probe(config)
}

/// See the module docs.
#[derive(Debug)]
pub struct UcxTransport {
    /// Exposed regions by address of block 0, kept alive until withdrawn (memory the engine
    /// allocated is owned by its region, so holding the region is what keeps it exposed).
    /// Declared first so that it drops before the engine handle.
    exposed: Mutex<HashMap<u64, Arc<Region>>>,
    engine: Arc<EngineHandle>,
    config: TransportConfig,
    address: String,
}

impl UcxTransport {
    /// Starts the UCX worker thread with `config.ucx` applied on top of the `UCX_*` environment.
    /// Fails like [`probe`] when libucp cannot be loaded.
    pub fn new(config: TransportConfig) -> Result<Self, TransferError> {
        config.validate()?;
        let engine = thread::start(config.clone())?;
        let address = hex_encode(&engine.worker_address);
        Ok(UcxTransport {
            exposed: Mutex::default(),
            engine: Arc::new(engine),
            config,
            address,
        })
    }

    /// Whether this UCX build can register and move CUDA memory.
    pub fn supports_cuda_memory(&self) -> bool {
        self.engine.cuda_memory
    }
}

async fn reply<T>(
    rx: oneshot::Receiver<Result<T, TransferError>>,
    op: &'static str,
    after: Duration,
) -> Result<T, TransferError> {
    match tokio::time::timeout(after, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(TransferError::Closed),
        Err(_) => Err(TransferError::Timeout { op, after }),
    }
}

#[async_trait]
impl Transport for UcxTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Ucx
    }

    async fn alloc_region(
        &self,
        num_blocks: u32,
        bytes_per_block: usize,
    ) -> Result<Arc<Region>, TransferError> {
        let len = (num_blocks as usize)
            .checked_mul(bytes_per_block)
            .filter(|&n| n > 0)
            .ok_or_else(|| TransferError::InvalidArgument("empty or oversized region".into()))?;
        let (tx, rx) = oneshot::channel();
        self.engine.send(Command::Alloc { len, reply: tx })?;
        match reply(rx, "ucx alloc", self.config.op_timeout + GRACE).await {
            Ok((address, key)) => {
                handle::region_from_alloc(&self.engine, num_blocks, bytes_per_block, address, key)
            }
            Err(e) => {
                tracing::debug!(error = %e, "kv transfer: UCX allocation failed, using plain memory");
                Region::host(num_blocks, bytes_per_block)
            }
        }
    }

    async fn expose(&self, region: Arc<Region>) -> Result<RegionDescriptor, TransferError> {
        let (tx, rx) = oneshot::channel();
        let descriptor = RegionDescriptor {
            transport: TransportKind::Ucx,
            address: self.address.clone(),
            region: region.base_address(),
            rkey: Vec::new(),
            bytes_per_block: region.bytes_per_block() as u64,
            num_blocks: region.num_blocks(),
            memory: region.memory_kind(),
        };
        let keep = Arc::clone(&region);
        self.engine.send(Command::Expose { region, reply: tx })?;
        let rkey = reply(rx, "ucx expose", self.config.op_timeout + GRACE).await?;
        self.exposed.lock().insert(descriptor.region, keep);
        Ok(RegionDescriptor { rkey, ..descriptor })
    }

    async fn withdraw(&self, descriptor: &RegionDescriptor) -> Result<(), TransferError> {
        let region = self
            .exposed
            .lock()
            .remove(&descriptor.region)
            .ok_or_else(|| {
                TransferError::InvalidArgument("region was not exposed by this transport".into())
            })?;
        let (tx, rx) = oneshot::channel();
        self.engine.send(Command::Withdraw {
            region_id: region.id(),
            reply: tx,
        })?;
        let r = reply(rx, "ucx withdraw", self.config.op_timeout + GRACE).await;
        drop(region); // after the engine has unmapped it
        r
    }

    async fn connect(
        &self,
        remote: &RegionDescriptor,
    ) -> Result<Box<dyn BlockWriter>, TransferError> {
        remote.validate_for(TransportKind::Ucx)?;
        if remote.rkey.is_empty() {
            return Err(TransferError::BadDescriptor("missing remote key".into()));
        }
        if remote.region.checked_add(remote.len_bytes()).is_none() {
            return Err(TransferError::BadDescriptor(
                "region address overflows".into(),
            ));
        }
        let peer = hex_decode(&remote.address)
            .ok_or_else(|| TransferError::BadDescriptor("worker address is not hex".into()))?;
        let state = Arc::new(WriterState::default());
        let (tx, rx) = oneshot::channel();
        self.engine.send(Command::Connect {
            peer,
            rkey: remote.rkey.clone(),
            remote_base: remote.region,
            remote_len: remote.len_bytes(),
            state: Arc::clone(&state),
            reply: tx,
        })?;
        let connected = reply(rx, "ucx connect", self.config.connect_timeout + GRACE).await?;
        let direct = connected.direct;
        tracing::debug!(
            direct = direct.is_some(),
            "kv transfer: ucx writer connected"
        );
        Ok(Box::new(UcxWriter {
            engine: Arc::clone(&self.engine),
            id: connected.writer,
            direct,
            remote: remote.clone(),
            state,
            inflight: Arc::new(Semaphore::new(self.config.max_inflight_puts)),
            op_timeout: self.config.op_timeout,
            run: None,
        }))
    }
}

/// See [`BlockWriter`]; one per connected region, backed by the cached endpoint to its peer.
#[derive(Debug)]
struct UcxWriter {
    engine: Arc<EngineHandle>,
    id: u64,
    /// Same-host shared memory mapped into this process: puts are plain copies.
    direct: Option<Mapping>,
    remote: RegionDescriptor,
    state: Arc<WriterState>,
    inflight: Arc<Semaphore>,
    op_timeout: Duration,
    /// `put_region` blocks not yet posted (their source blocks stay locked).
    run: Option<Run>,
}

/// The most bytes one run of blocks puts at once: large enough that per-operation costs
/// vanish (a KV block is 16–360 KiB), small enough that a run's first bytes do not wait
/// long for its last blocks to be queued.
const MAX_RUN_BYTES: usize = 8 << 20;

/// Consecutive source blocks bound for consecutive remote blocks, gathered by `put_region`.
#[derive(Debug)]
struct Run {
    remote_addr: u64,
    leases: Vec<BlockLease>,
    permit: OwnedSemaphorePermit,
}

impl Run {
    /// Whether block `src_block` of `src`, put at `remote_addr`, continues this run.
    fn continues(&self, src: &Arc<Region>, src_block: u32, remote_addr: u64) -> bool {
        let Some(first) = self.leases.first() else {
            return false;
        };
        let bpb = src.bytes_per_block();
        let next = first.address() + (self.leases.len() * bpb) as u64;
        Arc::ptr_eq(first.region(), src)
            && src.base_address() + u64::from(src_block) * bpb as u64 == next
            && remote_addr == self.remote_addr + (self.leases.len() * bpb) as u64
            && (self.leases.len() + 1) * bpb <= MAX_RUN_BYTES
    }
}

impl UcxWriter {
    /// Sends the gathered run (if any) to the thread as one put.
    fn post_run(&mut self) -> Result<(), TransferError> {
        let Some(run) = self.run.take() else {
            return Ok(());
        };
        self.engine.send(Command::Put {
            writer: self.id,
            remote_addr: run.remote_addr,
            src: PutSource::Run {
                leases: run.leases,
                _permit: run.permit,
            },
            done: None,
        })
    }

    fn ready(&self, dst_block: u32, len: usize) -> Result<u64, TransferError> {
        self.remote.check_put(dst_block, len)?;
        if let Some(e) = self.state.error() {
            return Err(e);
        }
        Ok(self.remote.region + u64::from(dst_block) * self.remote.bytes_per_block)
    }
}

/// Blocks in `Drop` until the operation using a borrowed buffer has completed, so that a put
/// future dropped mid-flight cannot free the buffer under UCX.
struct WaitOnDrop(Option<Arc<Completion>>);

impl Drop for WaitOnDrop {
    fn drop(&mut self) {
        if let Some(done) = self.0.take() {
            done.wait_blocking();
        }
    }
}

#[async_trait]
impl BlockWriter for UcxWriter {
    fn remote(&self) -> &RegionDescriptor {
        &self.remote
    }

    async fn put(&mut self, dst_block: u32, src: &[u8]) -> Result<(), TransferError> {
        let remote_addr = self.ready(dst_block, src.len())?;
        if let Some(m) = &self.direct {
            return m.write((remote_addr - self.remote.region) as usize, src);
        }
        let done = Arc::new(Completion::default());
        let cmd = Command::Put {
            writer: self.id,
            remote_addr,
            src: PutSource::Borrowed(RawBuf {
                ptr: src.as_ptr(),
                len: src.len(),
            }),
            done: Some(Arc::clone(&done)),
        };
        self.engine.send(cmd)?;
        let mut guard = WaitOnDrop(Some(done));
        let done = guard.0.as_ref().expect("set above");
        let outcome = done.wait().await;
        guard.0 = None;
        outcome
    }

    async fn put_region(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
    ) -> Result<(), TransferError> {
        let remote_addr = self.ready(dst_block, src.bytes_per_block())?;
        if let Some(m) = &self.direct {
            let lease = src.lease_block(src_block)?;
            return m.write_lease((remote_addr - self.remote.region) as usize, &lease);
        }
        if src.memory_kind() == MemoryKind::Cuda && !self.engine.cuda_memory {
            return Err(TransferError::Unsupported(
                "this UCX build has no CUDA memory support".into(),
            ));
        }
        let extends = self
            .run
            .as_ref()
            .is_some_and(|r| r.continues(src, src_block, remote_addr));
        if !extends {
            self.post_run()?;
        }
        // A permit per block; when none is free, the run gathered so far goes first (its
        // permits come back as it completes).
        let permit = match Arc::clone(&self.inflight).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                self.post_run()?;
                Arc::clone(&self.inflight)
                    .acquire_owned()
                    .await
                    .map_err(|_| TransferError::Closed)?
            }
        };
        let lease = src.lease_block(src_block)?;
        match &mut self.run {
            Some(run) => {
                run.permit.merge(permit);
                run.leases.push(lease);
            }
            None => {
                self.run = Some(Run {
                    remote_addr,
                    leases: vec![lease],
                    permit,
                })
            }
        }
        Ok(())
    }

    async fn put_region_part(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
        range: Range<usize>,
    ) -> Result<(), TransferError> {
        self.remote.check_put_part(dst_block, &range)?;
        if let Some(e) = self.state.error() {
            return Err(e);
        }
        if range.is_empty() {
            return Ok(());
        }
        let offset = dst_block as usize * self.remote.bytes_per_block as usize + range.start;
        if let Some(m) = &self.direct
            && src.memory_kind() == MemoryKind::Host
        {
            // Mapped: one copy, under the source block's lock for its length only.
            return m.write(offset, &src.read_lock_block(src_block)?[range]);
        }
        // Copied out now (the block's lock is held for the copy only: its owner is computing
        // the block's next part meanwhile).
        let mut bytes = vec![0u8; range.len()];
        src.read_part_into(src_block, range.start, &mut bytes)?;
        if let Some(m) = &self.direct {
            return m.write(offset, &bytes);
        }
        // Blocks gathered before go first: puts land in call order.
        self.post_run()?;
        // A permit, as a block's: parts in flight are bounded as blocks are.
        let permit = Arc::clone(&self.inflight)
            .acquire_owned()
            .await
            .map_err(|_| TransferError::Closed)?;
        let raw = RawBuf {
            ptr: bytes.as_ptr(),
            len: bytes.len(),
        };
        self.engine.send(Command::Put {
            writer: self.id,
            remote_addr: self.remote.region + offset as u64,
            src: PutSource::Owned {
                buf: raw,
                _bytes: bytes,
                _permit: permit,
            },
            done: None,
        })
    }

    async fn flush(&mut self) -> Result<(), TransferError> {
        self.post_run()?;
        if let Some(e) = self.state.error() {
            return Err(e);
        }
        if self.direct.is_some() {
            // Direct copies are complete when `put` returns; order them before whatever the
            // caller does next (telling the receiver).
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            return Ok(());
        }
        let done = Arc::new(Completion::default());
        self.engine.send(Command::Flush {
            writer: self.id,
            done: Arc::clone(&done),
        })?;
        let after = self.op_timeout + GRACE;
        match tokio::time::timeout(after, done.wait()).await {
            Ok(r) => r,
            Err(_) => Err(TransferError::Timeout {
                op: "ucx flush",
                after,
            }),
        }
    }
}

impl Drop for UcxWriter {
    fn drop(&mut self) {
        let _ = self.engine.send(Command::Release { writer: self.id });
    }
}

fn hex_encode(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(hex_decode(&hex_encode(&bytes)).unwrap(), bytes);
        assert!(hex_decode("abc").is_none());
        assert!(hex_decode("zz").is_none());
    }
}
