//! The receiving side of the TCP transport: the accept loop and one task per connection,
//! reading `PUT` frames straight into the region with vectored reads.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::io::IoSliceMut;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

use super::wire::{
    Exposed, FRAME_HEADER, HELLO_LEN, MAGIC, MAX_CONNECTIONS, MAX_FRAME_BLOCKS, MAX_MESSAGE,
    OP_FLUSH, OP_PUT, OP_PUT_PART, REPLY_ACK, REPLY_ERR, message_frame,
};
use crate::descriptor::MemoryKind;
use crate::error::{TransferError, with_timeout};
use crate::region::Region;
use crate::transport::TransportConfig;

pub(super) async fn accept_loop(
    listener: TcpListener,
    regions: Arc<Mutex<HashMap<u64, Exposed>>>,
    config: TransportConfig,
) {
    // Connection tasks belong to this loop: aborting it (transport dropped) aborts them.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) if connections.len() >= MAX_CONNECTIONS => {
                    tracing::warn!(%peer, "kv transfer: tcp connection refused, {MAX_CONNECTIONS} open");
                    drop(stream);
                }
                Ok((stream, peer)) => {
                    let regions = Arc::clone(&regions);
                    let config = config.clone();
                    connections.spawn(async move {
                        if let Err(e) = serve(stream, &regions, &config).await {
                            tracing::debug!(%peer, error = %e, "kv transfer: tcp connection ended");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "kv transfer: tcp accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Serves one connection: hello, then frames until EOF or an error.
async fn serve(
    stream: TcpStream,
    regions: &Mutex<HashMap<u64, Exposed>>,
    config: &TransportConfig,
) -> Result<(), TransferError> {
    stream
        .set_nodelay(true)
        .map_err(TransferError::io("set_nodelay"))?;
    // No read buffering: headers are read exactly and block bytes go straight from the socket
    // into the region (a buffer would add a copy of part of every block).
    let (mut read, mut write) = stream.into_split();
    let mut hello = [0u8; HELLO_LEN];
    with_timeout("tcp hello", config.op_timeout, async {
        read.read_exact(&mut hello)
            .await
            .map_err(TransferError::io("tcp hello"))
    })
    .await?;
    let (region, withdrawn) = match accept_hello(&hello, regions) {
        Ok(found) => {
            write
                .write_all(&message_frame(0, ""))
                .await
                .map_err(TransferError::io("tcp reply"))?;
            found
        }
        Err(reason) => {
            let _ = write.write_all(&message_frame(1, &reason)).await;
            return Err(TransferError::Rejected(reason));
        }
    };
    let mut staging = Vec::new();
    loop {
        let mut header = [0u8; FRAME_HEADER];
        match read.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(TransferError::io("tcp read")(e)),
        }
        let arg = u64::from_le_bytes(header[1..].try_into().unwrap_or_default());
        let outcome = match header[0] {
            op @ (OP_PUT | OP_PUT_PART) => {
                let landed = with_timeout("tcp block read", config.op_timeout, async {
                    let parts = if op == OP_PUT {
                        let whole = 0..region.bytes_per_block();
                        let ids = read_ids(&mut read, arg).await?;
                        ids.into_iter().map(|id| (id, whole.clone())).collect()
                    } else {
                        read_parts(&mut read, arg).await?
                    };
                    Ok(match check_parts(&parts, &region, &withdrawn) {
                        Ok(()) => {
                            receive(&mut read, &region, &parts, &mut staging).await?;
                            Ok(())
                        }
                        Err(reason) => Err(reason),
                    })
                });
                landed.await?
            }
            OP_FLUSH => {
                let mut ack = [0u8; FRAME_HEADER];
                ack[0] = REPLY_ACK;
                ack[1..].copy_from_slice(&arg.to_le_bytes());
                write
                    .write_all(&ack)
                    .await
                    .map_err(TransferError::io("tcp ack"))?;
                Ok(())
            }
            other => Err(format!("unknown frame {other}")),
        };
        if let Err(reason) = outcome {
            let text = &reason.as_bytes()[..reason.len().min(MAX_MESSAGE as usize)];
            let mut frame = Vec::with_capacity(FRAME_HEADER + text.len());
            frame.push(REPLY_ERR);
            frame.extend_from_slice(&(text.len() as u64).to_le_bytes());
            frame.extend_from_slice(text);
            let _ = write.write_all(&frame).await;
            return Err(TransferError::Rejected(reason));
        }
    }
}

fn accept_hello(
    hello: &[u8; HELLO_LEN],
    regions: &Mutex<HashMap<u64, Exposed>>,
) -> Result<(Arc<Region>, Arc<AtomicBool>), String> {
    if &hello[..4] != MAGIC {
        return Err("bad magic".into());
    }
    let id = u64::from_le_bytes(hello[4..12].try_into().unwrap_or_default());
    let bpb = u64::from_le_bytes(hello[12..20].try_into().unwrap_or_default());
    let blocks = u32::from_le_bytes(hello[20..24].try_into().unwrap_or_default());
    let regions = regions.lock();
    let e = regions
        .get(&id)
        .ok_or_else(|| format!("no region {id} is exposed here"))?;
    if e.region.bytes_per_block() as u64 != bpb || e.region.num_blocks() != blocks {
        return Err(format!(
            "region {id} is {} × {} bytes, not {blocks} × {bpb}",
            e.region.num_blocks(),
            e.region.bytes_per_block()
        ));
    }
    Ok((Arc::clone(&e.region), Arc::clone(&e.withdrawn)))
}

/// How many entries a frame of `count` may carry (`1..=MAX_FRAME_BLOCKS`).
fn frame_entries(count: u64) -> Result<usize, TransferError> {
    usize::try_from(count)
        .ok()
        .filter(|n| (1..=MAX_FRAME_BLOCKS).contains(n))
        .ok_or_else(|| {
            TransferError::PeerFailed(format!(
                "PUT frame of {count} blocks (1..={MAX_FRAME_BLOCKS})"
            ))
        })
}

/// Reads the block ids of a `PUT` frame carrying `count` blocks.
async fn read_ids(read: &mut OwnedReadHalf, count: u64) -> Result<Vec<u32>, TransferError> {
    let mut raw = vec![0u8; frame_entries(count)? * 4];
    read.read_exact(&mut raw)
        .await
        .map_err(TransferError::io("tcp read"))?;
    Ok(raw
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap_or_default()))
        .collect())
}

/// Reads the `(block, offset, length)` entries of a `PUT_PART` frame carrying `count` parts.
async fn read_parts(
    read: &mut OwnedReadHalf,
    count: u64,
) -> Result<Vec<(u32, Range<usize>)>, TransferError> {
    let mut raw = vec![0u8; frame_entries(count)? * 12];
    read.read_exact(&mut raw)
        .await
        .map_err(TransferError::io("tcp read"))?;
    let word =
        |c: &[u8], at: usize| u32::from_le_bytes(c[at..at + 4].try_into().unwrap_or_default());
    Ok(raw
        .chunks_exact(12)
        .map(|c| {
            let (start, len) = (word(c, 4) as usize, word(c, 8) as usize);
            (word(c, 0), start..start.saturating_add(len))
        })
        .collect())
}

/// The blocks of one frame must be in range and distinct, each part inside its block, and
/// the region still exposed.
fn check_parts(
    parts: &[(u32, Range<usize>)],
    region: &Region,
    withdrawn: &AtomicBool,
) -> Result<(), String> {
    if withdrawn.load(Ordering::Acquire) {
        return Err("region withdrawn".into());
    }
    if let Some((bad, _)) = parts.iter().find(|(b, _)| *b >= region.num_blocks()) {
        return Err(format!(
            "block {bad} out of range ({} blocks)",
            region.num_blocks()
        ));
    }
    if let Some((block, range)) = parts
        .iter()
        .find(|(_, r)| r.start > r.end || r.end > region.bytes_per_block())
    {
        return Err(format!(
            "part {range:?} of block {block} is not inside a block of {} bytes",
            region.bytes_per_block()
        ));
    }
    let mut sorted: Vec<u32> = parts.iter().map(|(b, _)| *b).collect();
    sorted.sort_unstable();
    if sorted.windows(2).any(|w| w[0] == w[1]) {
        return Err("a block appears twice in one frame".into());
    }
    Ok(())
}

/// Reads the frame's parts (whole blocks for `PUT`) into the region: straight into the
/// (locked) blocks for host memory, through a staging buffer for device memory.
async fn receive(
    read: &mut OwnedReadHalf,
    region: &Region,
    parts: &[(u32, Range<usize>)],
    staging: &mut Vec<u8>,
) -> Result<(), TransferError> {
    match region.memory_kind() {
        MemoryKind::Host => {
            // Lock in ascending block order (one global order: two connections cannot
            // deadlock), then read in frame order.
            let mut order: Vec<usize> = (0..parts.len()).collect();
            order.sort_unstable_by_key(|&i| parts[i].0);
            let mut locked = Vec::with_capacity(parts.len());
            for i in order {
                locked.push((i, region.lock_block(parts[i].0)?));
            }
            locked.sort_unstable_by_key(|(i, _)| *i);
            // An empty slice would read as the end of the stream.
            let mut slices: Vec<IoSliceMut<'_>> = locked
                .iter_mut()
                .map(|(i, guard)| IoSliceMut::new(&mut guard[parts[*i].1.clone()]))
                .filter(|slice| !slice.is_empty())
                .collect();
            read_all_vectored(read, &mut slices).await
        }
        MemoryKind::Cuda => {
            staging.resize(parts.iter().map(|(_, r)| r.len()).sum(), 0);
            read.read_exact(staging)
                .await
                .map_err(TransferError::io("tcp block read"))?;
            let mut at = 0;
            for (id, range) in parts {
                region.write_part(*id, range.start, &staging[at..at + range.len()])?;
                at += range.len();
            }
            Ok(())
        }
    }
}

/// Fills every slice from the socket, as many bytes per syscall as are available.
async fn read_all_vectored(
    read: &OwnedReadHalf,
    mut slices: &mut [IoSliceMut<'_>],
) -> Result<(), TransferError> {
    while !slices.is_empty() {
        // Try first: the bytes are usually already there; wait for readiness only when not.
        match read.try_read_vectored(slices) {
            Ok(0) => {
                return Err(TransferError::PeerFailed(
                    "connection closed mid-frame".into(),
                ));
            }
            Ok(n) => IoSliceMut::advance_slices(&mut slices, n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => read
                .readable()
                .await
                .map_err(TransferError::io("tcp block read"))?,
            Err(e) => return Err(TransferError::io("tcp block read")(e)),
        }
    }
    Ok(())
}
