//! The transport traits and their configuration (`open.rs` is the factory that picks an
//! implementation: this file knows none of them).

use std::fmt;
use std::net::SocketAddr;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::descriptor::{RegionDescriptor, TransportKind};
use crate::error::TransferError;
use crate::region::Region;

/// The receiving side and the factory of writers: one per process and kind, shared (`Arc`).
#[async_trait]
pub trait Transport: Send + Sync + fmt::Debug {
    fn kind(&self) -> TransportKind;

    /// Allocates a zeroed host region in the memory this transport moves fastest: for UCX,
    /// memory from `ucp_mem_map(ALLOCATE)` (shared memory that same-host peers write with a
    /// plain copy); elsewhere (or if that fails) [`Region::host`]. CUDA regions come from
    /// [`Region::cuda`].
    async fn alloc_region(
        &self,
        num_blocks: u32,
        bytes_per_block: usize,
    ) -> Result<Arc<Region>, TransferError> {
        Region::host(num_blocks, bytes_per_block)
    }

    /// Registers `region` so that peers can write into it, once; the transport keeps the
    /// region alive until [`Transport::withdraw`] or until the transport is dropped.
    async fn expose(&self, region: Arc<Region>) -> Result<RegionDescriptor, TransferError>;

    /// Stops accepting writes into a region exposed by this transport. Writers connected
    /// before may fail from now on.
    async fn withdraw(&self, descriptor: &RegionDescriptor) -> Result<(), TransferError>;

    /// Opens a writer into the region `remote` describes. Fails within the configured connect
    /// timeout when the peer is dead. The first connect to a peer sets up the connection;
    /// later ones to the same peer reuse it where the transport can.
    async fn connect(
        &self,
        remote: &RegionDescriptor,
    ) -> Result<Box<dyn BlockWriter>, TransferError>;
}

/// The sending side of one connected region. Puts stream: issue them as blocks become ready,
/// without waiting for each to land, then `flush` once.
///
/// A failure of any pipelined put is reported by the next `put*` or `flush` call; after an
/// error the writer is unusable (connect again). A dead peer makes `put`/`flush` fail within
/// the configured operation timeout.
#[async_trait]
pub trait BlockWriter: Send + fmt::Debug {
    /// The region this writer writes into.
    fn remote(&self) -> &RegionDescriptor;

    /// Writes `src` (exactly one block) into remote block `dst_block`. Returns once `src` may be
    /// reused (the bytes have left it); they are visible remotely only after [`flush`].
    /// Dropping the future early may block the dropping thread until the transport has let go
    /// of `src` (at most the operation timeout); prefer [`put_region`] on hot paths.
    ///
    /// [`flush`]: BlockWriter::flush
    /// [`put_region`]: BlockWriter::put_region
    async fn put(&mut self, dst_block: u32, src: &[u8]) -> Result<(), TransferError>;

    /// Writes block `src_block` of the local region `src` into remote block `dst_block`,
    /// zero-copy where the transport can. May return before the bytes have been read: the
    /// source block stays locked (the owner's writes to it wait) until the put completes, and
    /// the writer keeps `src` alive until then.
    async fn put_region(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
    ) -> Result<(), TransferError>;

    /// Writes bytes `range` of block `src_block` of the local region `src` into the same bytes
    /// of remote block `dst_block`: a part of a block, sent as it is computed (a prefill
    /// sends each layer's K/V when that layer is done, and a block is layer-major). Unlike
    /// [`put_region`](BlockWriter::put_region), the source block is not held locked once
    /// this returns — the owner goes on writing the block's other parts — so the caller must
    /// leave `range` itself unchanged until the next [`flush`](BlockWriter::flush). Puts of
    /// a writer land in call order, parts and whole blocks alike.
    async fn put_region_part(
        &mut self,
        dst_block: u32,
        src: &Arc<Region>,
        src_block: u32,
        range: Range<usize>,
    ) -> Result<(), TransferError>;

    /// Returns when every earlier put is visible in the remote region, or with the first
    /// error among them.
    async fn flush(&mut self) -> Result<(), TransferError>;
}

/// UCX-specific settings, applied to the UCP configuration of this transport only (they
/// override the `UCX_*` environment, which UCX still reads for everything else).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UcxConfig {
    /// UCX transport list (`UCX_TLS`), e.g. `tcp`, `sm,self`, `rc,cuda_copy`; `None` = UCX's
    /// choice.
    pub tls: Option<String>,
    /// Network devices (`UCX_NET_DEVICES`), e.g. `lo`, `mlx5_0:1`; `None` = all.
    pub net_devices: Option<String>,
    /// Create endpoints in `UCP_ERR_HANDLING_MODE_PEER`: UCX then reports a dead peer on every
    /// transport and in-flight requests always complete. UCX 1.13's shared-memory transports
    /// (posix, sysv; and CMA behind them) do not support it, so with it on, two processes on
    /// one host talk over TCP loopback. Off, UCX may use shared memory, and a dead peer is
    /// detected by this crate's deadlines only (see the crate docs, "UCX error modes").
    pub peer_failure_detection: bool,
    /// Further UCX options as `(name, value)`, as `ucp_config_modify` takes them: context
    /// options without the `UCX_` prefix; transport options (UCX 1.13) also without their
    /// transport prefix, e.g. `("TX_SEG_SIZE", "64k")` for `UCX_TCP_TX_SEG_SIZE` (see
    /// BENCHMARKS.md for why that one matters over TCP).
    pub options: Vec<(String, String)>,
}

impl UcxConfig {
    /// `options`, plus this crate's tuning where the caller set nothing: over TCP alone
    /// (`tls = "tcp"`), 64 KiB segments instead of UCX 1.13's 8 KiB, several times faster for
    /// KV blocks (BENCHMARKS.md).
    pub fn effective_options(&self) -> Vec<(String, String)> {
        let mut options = self.options.clone();
        if self.tls.as_deref() == Some("tcp") {
            for key in ["TX_SEG_SIZE", "RX_SEG_SIZE"] {
                if !options.iter().any(|(k, _)| k == key) {
                    options.push((key.to_string(), "64k".to_string()));
                }
            }
        }
        options
    }
}

impl Default for UcxConfig {
    fn default() -> Self {
        UcxConfig {
            tls: None,
            net_devices: None,
            peer_failure_detection: true,
            options: Vec::new(),
        }
    }
}

/// How a transport is set up. `Default` suits a single machine: TCP on loopback, UCX's own
/// transport selection, 5 s to connect, 10 s per operation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportConfig {
    /// TCP: where the receiving listener binds (port 0 = any free port).
    pub tcp_bind: SocketAddr,
    /// TCP: the host put in descriptors; `None` = the bound IP (which must then not be the
    /// unspecified address).
    pub tcp_advertise_host: Option<String>,
    /// TCP: idle connections kept per peer region for later `connect`s.
    pub tcp_idle_per_peer: usize,
    pub ucx: UcxConfig,
    /// Bound on establishing a connection (TCP connect + handshake, UCX wireup).
    pub connect_timeout: Duration,
    /// Bound on any single put or flush: a peer that stops responding fails the writer after
    /// this long instead of hanging it.
    pub op_timeout: Duration,
    /// Puts a writer may have in flight (issued, not yet complete) before `put_region` waits.
    pub max_inflight_puts: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            tcp_bind: SocketAddr::from(([127, 0, 0, 1], 0)),
            tcp_advertise_host: None,
            tcp_idle_per_peer: 4,
            ucx: UcxConfig::default(),
            connect_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(10),
            max_inflight_puts: 1024,
        }
    }
}

impl TransportConfig {
    pub(crate) fn validate(&self) -> Result<(), TransferError> {
        if self.max_inflight_puts == 0 {
            return Err(TransferError::InvalidArgument(
                "max_inflight_puts must be at least 1".into(),
            ));
        }
        if self.connect_timeout.is_zero() || self.op_timeout.is_zero() {
            return Err(TransferError::InvalidArgument(
                "timeouts must be positive".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_alone_gets_big_segments_unless_the_caller_chose() {
        let tcp = UcxConfig {
            tls: Some("tcp".into()),
            ..UcxConfig::default()
        };
        let keys: Vec<_> = tcp
            .effective_options()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, ["TX_SEG_SIZE", "RX_SEG_SIZE"]);
        let chosen = UcxConfig {
            options: vec![("TX_SEG_SIZE".into(), "8k".into())],
            ..tcp
        };
        assert_eq!(
            chosen.effective_options(),
            [
                ("TX_SEG_SIZE".to_string(), "8k".to_string()),
                ("RX_SEG_SIZE".to_string(), "64k".to_string())
            ]
        );
        assert!(UcxConfig::default().effective_options().is_empty());
    }
}
