//! The sending side of the TCP transport: one connection into one remote region.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::IoSlice;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::wire::{
    BATCH_BLOCKS, BATCH_BYTES, FRAME_HEADER, MAX_MESSAGE, OP_FLUSH, OP_PUT, OP_PUT_PART, PoolKey,
    REPLY_ACK, REPLY_ERR,
};
use crate::descriptor::RegionDescriptor;
use crate::error::{TransferError, with_timeout};
use crate::region::{BlockLease, Region};
use crate::transport::{BlockWriter, TransportConfig};

/// See the module docs.
pub(super) struct TcpWriter {
    remote: RegionDescriptor,
    stream: Option<TcpStream>,
    /// The first error; every later call returns it.
    failed: Option<TransferError>,
    /// Set while a frame is half written: a future dropped mid-call leaves it set, which
    /// poisons the writer (the stream is out of frame).
    busy: bool,
    seq: u64,
    /// `put_region` blocks not yet written (their source blocks stay locked): written as one
    /// `PUT` frame when the batch is full, before any other frame, and by `flush`.
    queued: Vec<(u32, BlockLease)>,
    /// `put_region_part` parts not yet written, copied out of their blocks (which the owner
    /// goes on writing): `(block, offset, bytes)`, written as one `PUT_PART` frame. At most
    /// one of the two queues holds anything: a put of the other kind writes it first, so
    /// puts land in call order.
    parts: Vec<(u32, u32, Vec<u8>)>,
    staging: Vec<u8>,
    config: TransportConfig,
    idle: Arc<Mutex<HashMap<PoolKey, Vec<TcpStream>>>>,
    key: PoolKey,
}

impl std::fmt::Debug for TcpWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpWriter")
            .field("remote", &self.remote.address)
            .field("region", &self.remote.region)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// Writes every slice, with as few syscalls as the kernel allows.
async fn write_all_vectored(
    stream: &mut TcpStream,
    mut slices: &mut [IoSlice<'_>],
) -> std::io::Result<()> {
    while !slices.is_empty() {
        let n = stream.write_vectored(slices).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        IoSlice::advance_slices(&mut slices, n);
    }
    Ok(())
}

impl TcpWriter {
    pub(super) fn new(
        remote: RegionDescriptor,
        stream: TcpStream,
        config: TransportConfig,
        idle: Arc<Mutex<HashMap<PoolKey, Vec<TcpStream>>>>,
        key: PoolKey,
    ) -> TcpWriter {
        TcpWriter {
            remote,
            stream: Some(stream),
            failed: None,
            busy: false,
            seq: 0,
            queued: Vec::new(),
            parts: Vec::new(),
            staging: Vec::new(),
            config,
            idle,
            key,
        }
    }

    /// Checks the writer is usable and marks it busy; returns the stream.
    fn begin(&mut self) -> Result<&mut TcpStream, TransferError> {
        if self.busy && self.failed.is_none() {
            self.failed = Some(TransferError::Cancelled(
                "an earlier call was dropped mid-frame".into(),
            ));
        }
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        self.busy = true;
        self.stream.as_mut().ok_or(TransferError::Closed)
    }

    fn fail(&mut self, e: TransferError) -> TransferError {
        self.stream = None;
        self.failed = Some(e.clone());
        e
    }

    /// Writes the queued blocks, then `extra` (a borrowed block) if any, as one `PUT` frame.
    async fn send(&mut self, extra: Option<(u32, &[u8])>) -> Result<(), TransferError> {
        self.send_parts().await?;
        if self.queued.is_empty() && extra.is_none() {
            return Ok(());
        }
        let queued = std::mem::take(&mut self.queued);
        let ids: Vec<u8> = queued
            .iter()
            .map(|(dst, _)| *dst)
            .chain(extra.map(|(dst, _)| dst))
            .flat_map(u32::to_le_bytes)
            .collect();
        let bodies = queued
            .iter()
            .map(|(_, lease)| lease.host_bytes().unwrap_or_default())
            .chain(extra.map(|(_, bytes)| bytes));
        let r = self.write_frame(OP_PUT, ids.len() / 4, &ids, bodies).await;
        drop(queued); // unlocks the source blocks
        r
    }

    /// Writes one frame: `op`, `count`, the `entries` that describe its bodies, the bodies.
    async fn write_frame<'a>(
        &mut self,
        op: u8,
        count: usize,
        entries: &[u8],
        bodies: impl Iterator<Item = &'a [u8]>,
    ) -> Result<(), TransferError> {
        let timeout = self.config.op_timeout;
        let mut header = [0u8; FRAME_HEADER];
        header[0] = op;
        header[1..].copy_from_slice(&(count as u64).to_le_bytes());
        let mut slices = vec![IoSlice::new(&header), IoSlice::new(entries)];
        slices.extend(bodies.map(|body| {
            let body: &[u8] = body; // as long as the header's
            IoSlice::new(body)
        }));
        let stream = self.begin()?;
        let r = with_timeout("tcp put", timeout, async {
            write_all_vectored(stream, &mut slices)
                .await
                .map_err(TransferError::io("tcp put"))
        })
        .await;
        self.busy = false;
        r.map_err(|e| self.fail(e))
    }

    /// Writes the queued parts as one `PUT_PART` frame.
    async fn send_parts(&mut self) -> Result<(), TransferError> {
        if self.parts.is_empty() {
            return Ok(());
        }
        let parts = std::mem::take(&mut self.parts);
        let entries: Vec<u8> = parts
            .iter()
            .flat_map(|(block, offset, bytes)| {
                [*block, *offset, bytes.len() as u32]
                    .into_iter()
                    .flat_map(u32::to_le_bytes)
            })
            .collect();
        let bodies = parts.iter().map(|(_, _, bytes)| bytes.as_slice());
        self.write_frame(OP_PUT_PART, parts.len(), &entries, bodies)
            .await
    }

    async fn await_ack(stream: &mut TcpStream, seq: u64) -> Result<(), TransferError> {
        let mut reply = [0u8; FRAME_HEADER];
        stream
            .read_exact(&mut reply)
            .await
            .map_err(TransferError::io("tcp flush"))?;
        let arg = u64::from_le_bytes(reply[1..].try_into().unwrap_or_default());
        match reply[0] {
            REPLY_ACK if arg == seq => Ok(()),
            REPLY_ACK => Err(TransferError::PeerFailed(format!(
                "flush {seq} acknowledged as {arg}"
            ))),
            REPLY_ERR => {
                let mut text = vec![0u8; arg.min(u64::from(MAX_MESSAGE)) as usize];
                stream
                    .read_exact(&mut text)
                    .await
                    .map_err(TransferError::io("tcp flush"))?;
                Err(TransferError::Rejected(
                    String::from_utf8_lossy(&text).into_owned(),
                ))
            }
            other => Err(TransferError::PeerFailed(format!("unknown reply {other}"))),
        }
    }
}

#[async_trait]
impl BlockWriter for TcpWriter {
    fn remote(&self) -> &RegionDescriptor {
        &self.remote
    }

    async fn put(&mut self, dst_block: u32, src: &[u8]) -> Result<(), TransferError> {
        self.remote.check_put(dst_block, src.len())?;
        if self.queued.iter().any(|(d, _)| *d == dst_block) {
            self.send(None).await?; // ids within one frame are distinct
        }
        self.send(Some((dst_block, src))).await
    }

    async fn put_region(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
    ) -> Result<(), TransferError> {
        self.remote.check_put(dst_block, src.bytes_per_block())?;
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if !self.parts.is_empty() || self.queued.iter().any(|(d, _)| *d == dst_block) {
            // Parts queued before go first; ids within one frame are distinct.
            self.send(None).await?;
        }
        let lease = src.lease_block(src_block)?;
        if lease.host_bytes().is_some() {
            self.queued.push((dst_block, lease));
            let bytes = self.queued.len() * src.bytes_per_block();
            if self.queued.len() >= BATCH_BLOCKS || bytes >= BATCH_BYTES {
                return self.send(None).await;
            }
            return Ok(());
        }
        // Device memory: through a host staging buffer, written at once.
        let mut staging = std::mem::take(&mut self.staging);
        staging.resize(src.bytes_per_block(), 0);
        lease.copy_into(&mut staging)?;
        drop(lease);
        let r = self.send(Some((dst_block, &staging))).await;
        self.staging = staging;
        r
    }

    async fn put_region_part(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
        range: Range<usize>,
    ) -> Result<(), TransferError> {
        self.remote.check_put_part(dst_block, &range)?;
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        if range.is_empty() {
            return Ok(());
        }
        if !self.queued.is_empty() || self.parts.iter().any(|(d, _, _)| *d == dst_block) {
            // Whole blocks queued before go first; blocks within one frame are distinct.
            self.send(None).await?;
        }
        // Copied now: the block's lock is held for the copy only, not until the frame is
        // written (the owner is computing the block's next part meanwhile).
        let mut bytes = vec![0u8; range.len()];
        src.read_part_into(src_block, range.start, &mut bytes)?;
        self.parts.push((dst_block, range.start as u32, bytes));
        let queued: usize = self.parts.iter().map(|(_, _, b)| b.len()).sum();
        if self.parts.len() >= BATCH_BLOCKS || queued >= BATCH_BYTES {
            return self.send_parts().await;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), TransferError> {
        self.send(None).await?;
        let timeout = self.config.op_timeout;
        self.seq += 1;
        let seq = self.seq;
        let stream = self.begin()?;
        let r = with_timeout("tcp flush", timeout, async {
            let mut frame = [0u8; FRAME_HEADER];
            frame[0] = OP_FLUSH;
            frame[1..].copy_from_slice(&seq.to_le_bytes());
            stream
                .write_all(&frame)
                .await
                .map_err(TransferError::io("tcp flush"))?;
            Self::await_ack(stream, seq).await
        })
        .await;
        self.busy = false;
        r.map_err(|e| self.fail(e))
    }
}

impl Drop for TcpWriter {
    fn drop(&mut self) {
        // Queued blocks that were never flushed are dropped (their sources unlock); the stream
        // is still in frame, so it can serve another writer.
        if self.busy || self.failed.is_some() {
            return;
        }
        if let Some(stream) = self.stream.take() {
            let mut idle = self.idle.lock();
            let streams = idle.entry(self.key.clone()).or_default();
            if streams.len() < self.config.tcp_idle_per_peer {
                streams.push(stream);
            }
        }
    }
}
