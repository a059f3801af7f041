//! tandem's prefill worker (docs/ARCHITECTURE.md §1, §7): runs prompts through its engine as one-token
//! requests and streams the KV of the blocks a decode worker asked for as soon as the chunk
//! that completes each block finishes, then the first token and a digest of what it sent.
//!
//! `Generate` is not served here (a prefill worker never decodes); `KvEvents` and `Health`
//! come from `tandem-worker`. The KV goes through the KV transport (`tandem-kv-transfer`:
//! UCX, TCP or in-process) straight into the decode worker's region when the request names
//! one and this worker has a transport of that kind; otherwise inline on the `Prefill`
//! stream. Either way `PrefillDone` carries the digest of the bytes as computed.
//!
//! A decode worker that goes away mid-transfer drops the stream: the request is aborted here
//! and holds no blocks afterwards. One that gives up on a transfer calls `AbortPrefill`, which
//! answers once nothing more of the transfer can reach its memory ([`transfers`]).

pub mod transfers;

use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashMap;

use futures::{StreamExt, stream};
use tandem_engine::{EngineRequest, ExportedBlock};
use tandem_kv_transfer::{Region, RegionDescriptor};
use tandem_protocol::ErrorClass;
use tandem_protocol::grpc::{
    AbortPrefillReply, AbortPrefillRequest, KvBlock, KvLanded, PrefillChunk, PrefillDone,
    PrefillRequest, prefill_chunk,
};
use tandem_protocol::{HashSeed, RequestId, WorkerRole};
use tandem_runtime::shutdown::Shutdown;
use tandem_worker::{
    ChunkStream, HostOutput, KvDigest, RequestHandle, ServedEngine, WorkerCalls, WorkerConfig,
    WorkerContext, WorkerDeps, WorkerError, WorkerMetrics, digest_block,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::transfers::{TransferTicket, Transfers};

/// Longest `AbortPrefill` waits for a transfer's writer to close; past it the caller asks
/// again.
const ABORT_WAIT: Duration = Duration::from_secs(5);

/// Runs a prefill worker on `listener` until `shutdown`, then drains (see
/// [`WorkerContext::serve`]).
pub async fn run(
    mut config: WorkerConfig,
    listener: TcpListener,
    deps: WorkerDeps,
    shutdown: Shutdown,
) -> Result<(), WorkerError> {
    config.role = WorkerRole::Prefill;
    let ctx = WorkerContext::start(config, &deps, &shutdown).await?;
    let service = Arc::new(PrefillService::new(ctx.clone()));
    ctx.serve(listener, service, deps, shutdown).await
}

/// The gRPC `Worker` service of a prefill worker.
#[derive(Clone, Debug)]
pub struct PrefillService {
    ctx: WorkerContext,
    transfers: Arc<Transfers>,
    /// Send layers as the forward pass computes them (`WorkerConfig::kv_layer_streaming`).
    stream_layers: bool,
}

impl PrefillService {
    pub fn new(ctx: WorkerContext) -> Self {
        PrefillService {
            transfers: Arc::new(Transfers::new(ctx.stopping())),
            stream_layers: ctx.config.kv_layer_streaming,
            ctx,
        }
    }

    /// The service a decode worker serves its held blocks with (a drain's handovers): whole
    /// blocks, never layer by layer. Its blocks are computed already, so streaming has nothing
    /// to overlap, and the stream it hands over goes on decoding beside the export (layer by
    /// layer, 1 handover in 3 failed its digest on a 2-vCPU VM, cause not found yet).
    pub fn for_held_blocks(ctx: WorkerContext) -> Self {
        PrefillService {
            stream_layers: false,
            ..Self::new(ctx)
        }
    }

    /// Transfers whose writer is still open.
    pub fn transfers(&self) -> &Transfers {
        &self.transfers
    }

    /// Connects to the request's destination region when it names one (and this worker has
    /// a transport); otherwise the blocks go inline.
    async fn sink(&self, req: &PrefillRequest) -> Result<Sink, Status> {
        if req.destination.is_empty() {
            return Ok(Sink::Inline);
        }
        let Some(transport) = &self.ctx.transport else {
            return Ok(Sink::Inline);
        };
        let remote = RegionDescriptor::from_compact(&req.destination)
            .map_err(|e| WorkerError::InvalidRequest(format!("destination region: {e}")))?;
        if remote.transport != transport.kind() || self.converts(req) {
            // The decode worker reads inline blocks as well (and converts them when its KV
            // elements are of another width than this worker's).
            return Ok(Sink::Inline);
        }
        // Registered before connecting, so that an abort from now on waits for this writer.
        let mut ticket = self
            .transfers
            .start((req.request_id, req.destination.clone()))
            .map_err(|e| ErrorClass::Cancelled.status(e.to_string()))?;
        let writer = transport
            .connect(&remote)
            .await
            .map_err(|e| WorkerError::BadTransfer(format!("connecting to the KV region: {e}")))?;
        ticket.set_writer(writer);
        Ok(Sink::Transport {
            ticket,
            blocks: req.destination_blocks.clone(),
            sent: HashMap::new(),
        })
    }

    /// Whether the caller keeps its KV elements at another width than this worker: the same
    /// shape otherwise (checked by [`engine_request`](Self::engine_request)), its blocks then go
    /// inline and the caller converts them.
    fn converts(&self, req: &PrefillRequest) -> bool {
        req.kv_element_bytes != 0 && req.kv_element_bytes != self.ctx.config.kv_element_bytes()
    }

    /// Validates a prefill request against this worker's block geometry: the same blocks, or
    /// the same number of elements per block at another width (see [`Self::converts`]).
    fn engine_request(&self, req: &PrefillRequest) -> Result<EngineRequest, WorkerError> {
        let bs = self.ctx.config.engine.pool.block_size.get();
        let bytes = self.ctx.host.bytes_per_block() as u64;
        let own = u64::from(self.ctx.config.kv_element_bytes());
        let same_elements = self.converts(req)
            && req.bytes_per_block / u64::from(req.kv_element_bytes) == bytes / own;
        if req.block_size != bs || (req.bytes_per_block != bytes && !same_elements) {
            return Err(WorkerError::InvalidRequest(format!(
                "KV geometry mismatch: caller has {}-token blocks of {} bytes ({}-byte \
                 elements), this worker {bs}-token blocks of {bytes} bytes ({own}-byte \
                 elements)",
                req.block_size, req.bytes_per_block, req.kv_element_bytes
            )));
        }
        if !req.from_token.is_multiple_of(bs) || req.from_token as usize > req.prompt.len() {
            return Err(WorkerError::InvalidRequest(format!(
                "from_token {} is not a block boundary within the {}-token prompt",
                req.from_token,
                req.prompt.len()
            )));
        }
        let mut r = EngineRequest::new(RequestId(req.request_id), req.prompt.clone(), 1);
        r.hash_seed = HashSeed(req.hash_seed);
        r.sampling_seed = req.sampling_seed;
        // The first token is drawn here, as the decode worker would draw it.
        r.sampling = tandem_worker::sampling_params(req.into())?;
        r.ignore_eos = true;
        r.adapter = Some(req.lora_adapter.clone()).filter(|a| !a.is_empty());
        Ok(r)
    }
}

/// Where a prefill's blocks go: inline on the gRPC stream, or through the KV transport
/// straight into the decode worker's region.
enum Sink {
    Inline,
    Transport {
        /// Owns the writer; closes it when dropped.
        ticket: TransferTicket,
        /// Destination block in the remote region of each transferred block, in order.
        blocks: Vec<u32>,
        /// Bytes of each block (by its index) already sent as the step computing it went
        /// (its first layers); the rest goes when the step ends.
        sent: HashMap<usize, usize>,
    },
}

/// One prefill in progress: the engine's outputs become blocks sent (inline or through the
/// transport) and the digest of what was sent, then `PrefillDone`.
struct Prefill {
    handle: RequestHandle,
    digest: KvDigest,
    sink: Sink,
    /// The engine's arena when blocks are sent straight from it (exported by reference).
    source: Option<Arc<Region>>,
    /// Cancelled by `AbortPrefill` (never, for inline sends: the caller drops the stream).
    aborted: CancellationToken,
    /// Fault injection: corrupt the first block sent, after hashing it.
    corrupt: bool,
    /// Whether blocks' first layers go as the step computing them goes
    /// (`WorkerConfig::kv_layer_streaming`).
    stream_layers: bool,
    /// Whether the caller checks a digest (`PrefillRequest.skip_digest` unset): without it
    /// blocks are counted, not hashed (and not read back out of the arena to hash them).
    hash: bool,
    /// The worker's counters (KV bytes sent), and the size of a block.
    metrics: Arc<WorkerMetrics>,
    bytes_per_block: u64,
    /// The call's server span, and its `kv_transfer` child (the blocks sent, as computed).
    _span: tracing::Span,
    transfer: tracing::Span,
    sent: (u64, u64),
}

impl Prefill {
    /// The chunks for one engine output; None when the prefill is over.
    async fn step(&mut self) -> Option<Result<Vec<PrefillChunk>, Status>> {
        let next = tokio::select! {
            next = self.handle.next() => match next? {
                Ok(next) => next,
                Err(e) => return Some(Err(Status::from(e))),
            },
            () = self.aborted.cancelled() => {
                return Some(Err(ErrorClass::Cancelled.status("the decode worker aborted this prefill")));
            }
        };
        match next {
            HostOutput::Computed { blocks, bytes } => {
                Some(self.send_computed(&blocks, bytes).await)
            }
            HostOutput::Blocks(blocks) => Some(self.send_landed(blocks).await),
            HostOutput::Token(out) => {
                if let Sink::Transport { ticket, .. } = &mut self.sink
                    && let Some(writer) = ticket.writer()
                    && let Err(e) = writer.flush().await
                {
                    return Some(Err(
                        ErrorClass::Unavailable.status(format!("KV transfer flush: {e}"))
                    ));
                }
                let done = PrefillDone {
                    first_token: out.token,
                    digest: self.digest.value(),
                    blocks: self.digest.blocks(),
                    cached_tokens: out.cached_tokens as u32,
                    kv_transfer_params: String::new(),
                    first_token_logprobs: out
                        .logprobs
                        .as_deref()
                        .map(tandem_worker::logprobs_to_wire),
                };
                Some(Ok(vec![PrefillChunk {
                    item: Some(prefill_chunk::Item::Done(done)),
                }]))
            }
        }
    }

    /// The step computing `blocks` has written their first `bytes` (its first layers): what
    /// of them is not sent yet goes now, while the step computes the rest.
    async fn send_computed(
        &mut self,
        blocks: &[ExportedBlock],
        bytes: usize,
    ) -> Result<Vec<PrefillChunk>, Status> {
        let (
            Sink::Transport {
                ticket,
                blocks: dsts,
                sent,
            },
            Some(source),
            true,
        ) = (&mut self.sink, &self.source, self.stream_layers)
        else {
            return Ok(Vec::new());
        };
        let writer = ticket
            .writer()
            .ok_or_else(|| ErrorClass::Internal.status("KV transfer without a writer"))?;
        for b in blocks {
            let Some(&dst) = dsts.get(b.index) else {
                continue; // `send` reports it when the block comes whole
            };
            let done = sent.entry(b.index).or_default();
            if bytes > *done {
                writer
                    .put_region_part(dst, source, b.block, *done..bytes)
                    .await
                    .map_err(|e| ErrorClass::Unavailable.status(format!("KV transfer put: {e}")))?;
                self.metrics.transfer_sent_early((bytes - *done) as u64);
                *done = bytes;
            }
        }
        Ok(Vec::new())
    }

    /// [`send`](Self::send) a step's blocks; through a transport, with the caller checking a
    /// digest, then flush them and say so (`KvLanded`): the decode worker checks them while
    /// the rest of the prompt computes, instead of all of them after `PrefillDone`.
    async fn send_landed(
        &mut self,
        blocks: Vec<ExportedBlock>,
    ) -> Result<Vec<PrefillChunk>, Status> {
        let mut chunks = self.send(blocks).await?;
        if let (Sink::Transport { ticket, .. }, true) = (&mut self.sink, self.hash)
            && let Some(writer) = ticket.writer()
        {
            writer
                .flush()
                .await
                .map_err(|e| ErrorClass::Unavailable.status(format!("KV transfer flush: {e}")))?;
            chunks.push(PrefillChunk {
                item: Some(prefill_chunk::Item::Landed(KvLanded {
                    blocks: self.digest.blocks(),
                })),
            });
        }
        Ok(chunks)
    }

    async fn send(&mut self, blocks: Vec<ExportedBlock>) -> Result<Vec<PrefillChunk>, Status> {
        let mut inline = Vec::new();
        let n = blocks.len() as u64;
        let sent = n * self.bytes_per_block;
        for mut b in blocks {
            if !self.hash {
                self.digest.count();
                if self.corrupt
                    && let Some(source) = &self.source
                {
                    b.bytes = source.read_block(b.block).map_err(|e| {
                        ErrorClass::Internal.status(format!("reading exported KV: {e}"))
                    })?;
                }
            } else if let Some(source) = &self.source {
                // Pinned in the arena until the writer is closed: hash it where it is, and
                // send it from there unless it has to be corrupted on the way.
                digest_block(source, b.block, &mut self.digest).map_err(|e| {
                    ErrorClass::Internal.status(format!("reading exported KV: {e}"))
                })?;
                if self.corrupt {
                    b.bytes = source.read_block(b.block).map_err(|e| {
                        ErrorClass::Internal.status(format!("reading exported KV: {e}"))
                    })?;
                }
            } else {
                self.digest.update(&b.bytes);
            }
            if std::mem::take(&mut self.corrupt) {
                b.bytes[0] ^= 0x5a;
            }
            match &mut self.sink {
                Sink::Inline => inline.push(PrefillChunk {
                    item: Some(prefill_chunk::Item::Block(KvBlock {
                        index: b.index as u32,
                        data: b.bytes,
                    })),
                }),
                Sink::Transport {
                    ticket,
                    blocks,
                    sent: streamed,
                } => {
                    let writer = ticket.writer().ok_or_else(|| {
                        ErrorClass::Internal.status("KV transfer without a writer")
                    })?;
                    let dst = *blocks.get(b.index).ok_or_else(|| {
                        ErrorClass::InvalidRequest.status(format!(
                            "block {} has no destination ({} given)",
                            b.index,
                            blocks.len()
                        ))
                    })?;
                    let bytes_per_block = self.bytes_per_block as usize;
                    let put = match (&self.source, streamed.remove(&b.index)) {
                        // Its first layers went as they were computed: the rest now.
                        (Some(source), Some(done)) if b.bytes.is_empty() => {
                            writer
                                .put_region_part(dst, source, b.block, done..bytes_per_block)
                                .await
                        }
                        (Some(source), _) if b.bytes.is_empty() => {
                            writer.put_region(dst, source, b.block).await
                        }
                        _ => writer.put(dst, &b.bytes).await,
                    };
                    put.map_err(|e| {
                        ErrorClass::Unavailable.status(format!("KV transfer put: {e}"))
                    })?;
                }
            }
        }
        self.metrics.transfer_sent(sent);
        self.sent.0 += n;
        self.sent.1 += sent;
        self.transfer
            .record("tandem.blocks", tandem_runtime::telemetry::int(self.sent.0));
        self.transfer
            .record("tandem.bytes", tandem_runtime::telemetry::int(self.sent.1));
        Ok(inline)
    }
}

/// The `Prefill` stream of one request. Dropping it (the decode worker went away) drops the
/// request handle, which aborts the request and frees its blocks here.
fn prefill_stream(prefill: Prefill) -> ChunkStream<PrefillChunk> {
    let chunks = stream::unfold(Some(prefill), |state| async move {
        let mut p = state?;
        match p.step().await {
            Some(Ok(items)) => {
                let done = items
                    .iter()
                    .any(|c| matches!(c.item, Some(prefill_chunk::Item::Done(_))));
                let items: Vec<Result<PrefillChunk, Status>> = items.into_iter().map(Ok).collect();
                Some((items, (!done).then_some(p)))
            }
            Some(Err(status)) => Some((vec![Err(status)], None)),
            None => Some((
                vec![Err(ErrorClass::Unavailable.status("prefill worker stopped"))],
                None,
            )),
        }
    });
    Box::pin(chunks.flat_map(stream::iter))
}

#[tonic::async_trait]
impl WorkerCalls for PrefillService {
    fn engine(&self) -> &dyn ServedEngine {
        &self.ctx
    }

    async fn prefill(
        &self,
        req: PrefillRequest,
        span: tracing::Span,
    ) -> Result<ChunkStream<PrefillChunk>, Status> {
        if req.engine_handshake {
            return Err(WorkerError::InvalidRequest(
                "this prefill worker runs tandem's own engine: an external engine's decode \
                 worker needs a prefill worker in front of the same kind of engine"
                    .into(),
            )
            .into());
        }
        let engine_req = self.engine_request(&req)?;
        let mut sink = self.sink(&req).await?;
        // Through a transport, blocks go straight from the arena (they stay pinned there
        // until the writer is closed); inline, they are copied into the messages.
        let source = match &sink {
            Sink::Transport { .. } => self.ctx.arena.clone(),
            Sink::Inline => None,
        };
        let id = engine_req.id;
        let handle = self.ctx.host.submit_exporting(
            engine_req,
            req.from_token as usize,
            source.is_some(),
        )?;
        if let Sink::Transport { ticket, .. } = &mut sink
            && source.is_some()
        {
            let host = self.ctx.host.clone();
            ticket.on_closed(move || host.release_export(id));
        }
        let aborted = match &sink {
            Sink::Transport { ticket, .. } => ticket.cancelled(),
            // Nothing aborts an inline send but the stream's drop (or the worker stopping).
            Sink::Inline => self.ctx.stopping().child_token(),
        };
        let transport = match &sink {
            Sink::Transport { .. } => "transport",
            Sink::Inline => "inline",
        };
        Ok(prefill_stream(Prefill {
            handle,
            digest: KvDigest::default(),
            sink,
            source,
            aborted,
            corrupt: self.ctx.config.corrupt_transfers,
            stream_layers: self.stream_layers,
            hash: !req.skip_digest,
            metrics: self.ctx.metrics.clone(),
            bytes_per_block: self.ctx.host.bytes_per_block() as u64,
            transfer: tracing::info_span!(
                parent: &span,
                "kv_transfer",
                tandem.transport = transport,
                tandem.blocks = 0i64,
                tandem.bytes = 0i64,
            ),
            _span: span,
            sent: (0, 0),
        }))
    }

    async fn abort_prefill(&self, req: AbortPrefillRequest) -> Result<AbortPrefillReply, Status> {
        let Some(mut closed) = self.transfers.abort((req.request_id, req.destination)) else {
            return Ok(AbortPrefillReply { was_running: false });
        };
        match tokio::time::timeout(ABORT_WAIT, closed.wait_for(|c| *c)).await {
            Ok(_) => Ok(AbortPrefillReply { was_running: true }),
            Err(_) => Err(ErrorClass::Unavailable.status(format!(
                "the transfer's writer is still closing after {ABORT_WAIT:?}: ask again"
            ))),
        }
    }
}
