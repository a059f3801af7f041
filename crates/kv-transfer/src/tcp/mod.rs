//! The TCP transport: the receiver runs one listener per transport that takes framed block
//! writes and reads each block straight from the socket into the region; the sender streams
//! frames and flushes with an acknowledged marker.
//!
//! Wire format (little-endian), one connection per writer:
//! - hello, sender → receiver: `"TKV1"`, region id `u64`, bytes per block `u64`, blocks `u32`;
//!   reply: status `u8` (0 = accepted), message length `u32`, message.
//! - then sender → receiver frames, each with a 9-byte header (op `u8`, argument `u64`, so the
//!   receiver reads a header in one call): `PUT` (1, block count `n`), then `n` block ids
//!   (`u32`), then `n` blocks of bytes, in that order (distinct ids; the receiver reads all `n`
//!   blocks with vectored reads straight into the region); `FLUSH` (2, sequence).
//! - receiver → sender, same 9-byte header: `ACK` (1, sequence), sent once every earlier `PUT`
//!   on the connection has been copied into the region; `ERR` (2, message length) + message,
//!   after which the receiver closes the connection.
//!
//! Layout: this module holds the transport (listener, regions, idle connections) and the wire
//! constants; `receiver` serves connections; `writer` is the sending side.
//!
//! Connections of dropped writers that ended cleanly are kept (a few per peer region) and
//! reused by later `connect`s, so a sender pays the handshake once per peer.

mod receiver;
mod wire;
mod writer;

use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use async_trait::async_trait;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::descriptor::{RegionDescriptor, TransportKind};
use crate::error::{TransferError, with_timeout};
use crate::region::Region;
use crate::transport::{BlockWriter, Transport, TransportConfig};
use wire::{Exposed, HELLO_LEN, MAGIC, MAX_MESSAGE, PoolKey};
use writer::TcpWriter;

struct Listening {
    addr: String,
    task: JoinHandle<()>,
}

/// See the module docs.
pub struct TcpTransport {
    config: TransportConfig,
    regions: Arc<Mutex<HashMap<u64, Exposed>>>,
    listener: tokio::sync::Mutex<Option<Listening>>,
    idle: Arc<Mutex<HashMap<PoolKey, Vec<TcpStream>>>>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("bind", &self.config.tcp_bind)
            .finish_non_exhaustive()
    }
}

impl TcpTransport {
    pub fn new(config: TransportConfig) -> Self {
        TcpTransport {
            config,
            regions: Arc::default(),
            listener: tokio::sync::Mutex::new(None),
            idle: Arc::default(),
        }
    }

    /// Starts the listener on first use and returns the address to advertise.
    async fn listen(&self) -> Result<String, TransferError> {
        let mut slot = self.listener.lock().await;
        if let Some(l) = slot.as_ref() {
            return Ok(l.addr.clone());
        }
        let listener = TcpListener::bind(self.config.tcp_bind)
            .await
            .map_err(TransferError::io("tcp bind"))?;
        let local = listener
            .local_addr()
            .map_err(TransferError::io("tcp local_addr"))?;
        let addr = advertised(&self.config, local)?;
        let task = tokio::spawn(receiver::accept_loop(
            listener,
            Arc::clone(&self.regions),
            self.config.clone(),
        ));
        tracing::debug!(%addr, "kv transfer: tcp listener up");
        *slot = Some(Listening {
            addr: addr.clone(),
            task,
        });
        Ok(addr)
    }

    fn take_idle(&self, key: &PoolKey) -> Option<TcpStream> {
        let mut idle = self.idle.lock();
        let streams = idle.get_mut(key)?;
        while let Some(s) = streams.pop() {
            // A live idle connection has nothing to read; EOF or an error means the peer went.
            let mut probe = [0u8; 1];
            match s.try_read(&mut probe) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Some(s),
                _ => continue,
            }
        }
        None
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        if let Some(l) = self.listener.get_mut().take() {
            l.task.abort();
        }
    }
}

fn advertised(config: &TransportConfig, local: SocketAddr) -> Result<String, TransferError> {
    let host = match &config.tcp_advertise_host {
        Some(h) => h.clone(),
        None if local.ip().is_unspecified() => {
            return Err(TransferError::InvalidArgument(
                "tcp listener bound to an unspecified address: set tcp_advertise_host".into(),
            ));
        }
        None => local.ip().to_string(),
    };
    Ok(if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{}", local.port())
    } else {
        format!("{host}:{}", local.port())
    })
}

#[async_trait]
impl Transport for TcpTransport {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    async fn expose(&self, region: Arc<Region>) -> Result<RegionDescriptor, TransferError> {
        let address = self.listen().await?;
        let descriptor = RegionDescriptor {
            transport: TransportKind::Tcp,
            address,
            region: region.id(),
            rkey: Vec::new(),
            bytes_per_block: region.bytes_per_block() as u64,
            num_blocks: region.num_blocks(),
            memory: region.memory_kind(),
        };
        self.regions.lock().insert(
            region.id(),
            Exposed {
                region,
                withdrawn: Arc::new(AtomicBool::new(false)),
            },
        );
        Ok(descriptor)
    }

    async fn withdraw(&self, descriptor: &RegionDescriptor) -> Result<(), TransferError> {
        let removed = self.regions.lock().remove(&descriptor.region);
        match removed {
            Some(e) => {
                e.withdrawn.store(true, Ordering::Release);
                Ok(())
            }
            None => Err(TransferError::InvalidArgument(format!(
                "region {} was not exposed by this transport",
                descriptor.region
            ))),
        }
    }

    async fn connect(
        &self,
        remote: &RegionDescriptor,
    ) -> Result<Box<dyn BlockWriter>, TransferError> {
        remote.validate_for(TransportKind::Tcp)?;
        let key = (remote.address.clone(), remote.region);
        let stream = match self.take_idle(&key) {
            Some(s) => s,
            None => {
                with_timeout("tcp connect", self.config.connect_timeout, async {
                    let mut s = TcpStream::connect(&remote.address).await.map_err(|e| {
                        TransferError::PeerFailed(format!("{}: {e}", remote.address))
                    })?;
                    s.set_nodelay(true)
                        .map_err(TransferError::io("set_nodelay"))?;
                    hello(&mut s, remote).await?;
                    Ok(s)
                })
                .await?
            }
        };
        Ok(Box::new(TcpWriter::new(
            remote.clone(),
            stream,
            self.config.clone(),
            Arc::clone(&self.idle),
            key,
        )))
    }
}

async fn hello(s: &mut TcpStream, remote: &RegionDescriptor) -> Result<(), TransferError> {
    let mut msg = Vec::with_capacity(HELLO_LEN);
    msg.extend_from_slice(MAGIC);
    msg.extend_from_slice(&remote.region.to_le_bytes());
    msg.extend_from_slice(&remote.bytes_per_block.to_le_bytes());
    msg.extend_from_slice(&remote.num_blocks.to_le_bytes());
    s.write_all(&msg)
        .await
        .map_err(TransferError::io("tcp hello"))?;
    let status = s
        .read_u8()
        .await
        .map_err(TransferError::io("tcp hello reply"))?;
    let text = read_message(s).await?;
    if status != 0 {
        return Err(TransferError::PeerFailed(format!(
            "{} refused the connection: {text}",
            remote.address
        )));
    }
    Ok(())
}

async fn read_message<R: AsyncReadExt + Unpin>(r: &mut R) -> Result<String, TransferError> {
    let len = r
        .read_u32_le()
        .await
        .map_err(TransferError::io("tcp read"))?;
    if len > MAX_MESSAGE {
        return Err(TransferError::PeerFailed(format!("message of {len} bytes")));
    }
    let mut buf = vec![0; len as usize];
    r.read_exact(&mut buf)
        .await
        .map_err(TransferError::io("tcp read"))?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}
