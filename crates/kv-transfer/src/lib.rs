//! tandem-kv-transfer: moving KV blocks between workers' memory.
//!
//! A decode worker owns a KV arena, a [`Region`] of `num_blocks × bytes_per_block` bytes laid
//! out block-major (block `i` is bytes `i·b .. (i+1)·b`), in page-aligned host memory or, with
//! the `cuda` feature, CUDA device memory. It exposes the region once through a [`Transport`]
//! and publishes the resulting [`RegionDescriptor`] (its compact string form fits the
//! `kv_transfer` field of a worker record). A prefill worker connects to that descriptor, gets
//! a [`BlockWriter`], puts each finished block into the destination block ids the decode
//! worker named, and flushes once: when `flush` returns, every block is in the decode
//! worker's memory.
//!
//! ```no_run
//! # async fn demo() -> Result<(), tandem_kv_transfer::TransferError> {
//! use tandem_kv_transfer::{open, default_kind, TransportConfig};
//! let transport = open(default_kind(), &TransportConfig::default()).await?;
//! // Receiver (decode worker): allocate where the transport is fastest, expose once.
//! let arena = transport.alloc_region(1024, 64 * 1024).await?;
//! let record_field = transport.expose(arena.clone()).await?.to_compact();
//! // Sender (prefill worker, usually another process): connect once, stream, flush.
//! let mut writer = transport.connect(&record_field.parse()?).await?;
//! writer.put(17, &vec![0u8; 64 * 1024]).await?;
//! writer.flush().await?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//! - [`region`]: regions, per-block locks, block guards.
//! - [`descriptor`]: [`RegionDescriptor`], [`TransportKind`], [`MemoryKind`].
//! - [`transport`]: the [`Transport`] and [`BlockWriter`] traits, [`TransportConfig`],
//!   [`open`] and [`default_kind`].
//! - `ucx` (feature `ucx`, default): UCP bound with bindgen over the system's UCX (Debian
//!   `libucx-dev`). One thread per transport owns the UCP worker (single-threaded mode) and
//!   takes commands from the async side; one endpoint per peer worker, cached.
//! - `tcp`: framed block writes over TCP, read straight into the region by the receiver;
//!   `put_region` blocks are batched into vectored writes.
//! - `local`: in-process copies through a process-wide registry.
//! - `cuda` (feature `cuda`): device memory through cudarc, driver loaded at run time.
//!
//! # Invariants
//! - Only whole blocks move; a block id past the region or a source that is not one block
//!   long is a typed error ([`TransferError::OutOfRange`], [`TransferError::BlockSize`])
//!   raised by the sender before anything is sent.
//! - Puts pipeline: none waits for an earlier one to land. `flush` returns only when all
//!   earlier puts of the writer are visible remotely, or with the first error among them.
//! - Failures are values, never panics: a dead peer fails `connect` within
//!   [`TransportConfig::connect_timeout`] and `put`/`flush` within
//!   [`TransportConfig::op_timeout`] (see "UCX and dead peers" for the one exception); every
//!   error has an [`ErrorClass`].
//! - Everything is bounded: puts in flight per writer ([`TransportConfig::max_inflight_puts`]),
//!   TCP batches, idle connections kept per peer.
//! - `unsafe` lives only in the UCX FFI modules (`ucx::{engine, handle, ucp, direct, sys}`),
//!   the CUDA module and [`region`]'s allocation code, each block with a `// SAFETY:` comment.
//!
//! # Memory contract
//! A region is shared between its owner and the transport (`Arc<Region>`). In-process
//! accesses (the owner's [`Region::write_block`] / [`Region::read_block_into`] /
//! [`Region::lock_block`], the TCP receiver's and the local transport's copies, a source block
//! being sent by `put_region`) each hold that block's lock, so they never overlap and safe code
//! never sees overlapping `&mut`. Writes arriving over UCX are made outside Rust's view (NIC,
//! kernel, UCX, or a same-host peer copying into shared memory) and take no lock: as with
//! RDMA, the protocol must reserve a destination block for one writer, and nobody else may read
//! or write it until that writer's `flush` has returned and the receiver has been told so (the
//! prefill worker's completion message). Reading a block that is still being written gives
//! unspecified bytes, never undefined behaviour in the owner's code (it copies bytes out under
//! the lock). A region stays exposed (and allocated) until withdrawn or until its transport is
//! dropped; withdraw only once no peer can still be writing (with UCX over shared memory, the
//! kernel does not revoke a peer's mapping).
//!
//! # UCX paths
//! - Regions from [`Transport::alloc_region`] on a UCX transport live in UCX-allocated shared
//!   memory (sysv/posix). A sender on the same host gets the whole region mapped into its own
//!   address space (`ucp_rkey_ptr`) at connect, and a put is then a plain copy on the caller's
//!   thread: this is the path that runs at memcpy speed (BENCHMARKS.md).
//! - Any other region is registered with `ucp_mem_map`, and puts are `ucp_put_nbx` on the
//!   worker thread, over whatever UCX selects (RDMA where present; TCP, or shared-memory active
//!   messages, on one host).
//!
//! # UCX and dead peers
//! Endpoints are created in `UCP_ERR_HANDLING_MODE_PEER` by default
//! ([`UcxConfig::peer_failure_detection`]): UCX reports a dead peer and completes what is in
//! flight with an error, which fails the writer. In that mode UCX 1.13 will not use its
//! shared-memory transports for endpoints, so on one host it talks over TCP loopback, while
//! bulk data still takes the shared-memory mapping above. Writes through such a mapping into
//! a peer that has just died succeed (the memory stays mapped) until UCX has noticed the
//! death (its TCP connection closing), after which `put`/`flush` fail; the receiver was gone
//! anyway. With peer failure detection off, UCX may use shared memory for everything, and a
//! dead peer is only noticed by this crate's deadlines.

pub mod descriptor;
pub mod error;
mod local;
pub mod region;
mod tcp;
pub mod transport;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "ucx")]
pub mod ucx;

pub use descriptor::{MemoryKind, RegionDescriptor, TransportKind};
pub use error::{ErrorClass, TransferError};
pub use local::LocalTransport;
pub use region::{BlockGuard, Region};
pub use tcp::TcpTransport;
pub use transport::{BlockWriter, Transport, TransportConfig, UcxConfig, default_kind, open};
