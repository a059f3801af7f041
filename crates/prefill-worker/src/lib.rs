//! tandem's prefill worker (DESIGN.md §1, §7): runs prompts through its engine as one-token
//! requests and streams the KV of the blocks a decode worker asked for as soon as the chunk
//! that completes each block finishes, then the first token and a digest of what it sent.
//!
//! `Generate` is not served here (a prefill worker never decodes); `KvEvents` and `Health`
//! come from `tandem-worker`. The KV travels inline on the `Prefill` gRPC stream; the
//! transport crate replaces that path behind a trait.
//!
//! A decode worker that goes away mid-transfer drops the stream: the request is aborted here
//! and holds no blocks afterwards.

use std::pin::Pin;

use futures::{Stream, StreamExt, stream};
use tandem_engine::EngineRequest;
use tandem_protocol::grpc::{
    GenerateChunk, GenerateRequest, HealthReply, HealthRequest, KvBlock, KvEventsReply,
    KvEventsRequest, PrefillChunk, PrefillDone, PrefillRequest, prefill_chunk, worker_server,
};
use tandem_protocol::{HashSeed, RequestId, WorkerRole};
use tandem_worker::{
    HostOutput, KvDigest, RequestHandle, WorkerConfig, WorkerContext, WorkerDeps, WorkerError,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Runs a prefill worker on `listener` until `shutdown`, then drains (see
/// [`WorkerContext::serve`]).
pub async fn run(
    mut config: WorkerConfig,
    listener: TcpListener,
    deps: WorkerDeps,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    config.role = WorkerRole::Prefill;
    let ctx = WorkerContext::start(config, deps.events.clone())?;
    let service = PrefillService { ctx: ctx.clone() };
    ctx.serve(listener, service, deps, shutdown).await
}

/// The gRPC `Worker` service of a prefill worker.
#[derive(Clone, Debug)]
pub struct PrefillService {
    ctx: WorkerContext,
}

impl PrefillService {
    pub fn new(ctx: WorkerContext) -> Self {
        PrefillService { ctx }
    }

    /// Validates a prefill request against this worker's block geometry.
    fn engine_request(&self, req: &PrefillRequest) -> Result<EngineRequest, WorkerError> {
        let bs = self.ctx.config.engine.pool.block_size.get();
        let bytes = self.ctx.host.bytes_per_block() as u64;
        if req.block_size != bs || req.bytes_per_block != bytes {
            return Err(WorkerError::InvalidRequest(format!(
                "KV geometry mismatch: caller has {}-token blocks of {} bytes, this worker \
                 {bs}-token blocks of {bytes} bytes",
                req.block_size, req.bytes_per_block
            )));
        }
        if req.from_token % bs != 0 || req.from_token as usize > req.prompt.len() {
            return Err(WorkerError::InvalidRequest(format!(
                "from_token {} is not a block boundary within the {}-token prompt",
                req.from_token,
                req.prompt.len()
            )));
        }
        let mut r = EngineRequest::new(RequestId(req.request_id), req.prompt.clone(), 1);
        r.hash_seed = HashSeed(req.hash_seed);
        r.sampling_seed = req.sampling_seed;
        r.ignore_eos = true;
        Ok(r)
    }
}

/// Turns the engine's outputs for one prefill into the `Prefill` stream: blocks as they
/// come, then `PrefillDone` with the first token and the digest.
fn prefill_stream(handle: RequestHandle) -> BoxStream<PrefillChunk> {
    let state = Some((handle, KvDigest::default()));
    let chunks = stream::unfold(state, |state| async move {
        let (mut handle, mut digest) = state?;
        match handle.next().await {
            Some(HostOutput::Blocks(blocks)) => {
                let items: Vec<Result<PrefillChunk, Status>> = blocks
                    .into_iter()
                    .map(|b| {
                        digest.update(&b.bytes);
                        Ok(PrefillChunk {
                            item: Some(prefill_chunk::Item::Block(KvBlock {
                                index: b.index as u32,
                                data: b.bytes,
                            })),
                        })
                    })
                    .collect();
                Some((items, Some((handle, digest))))
            }
            Some(HostOutput::Token(out)) => {
                let done = PrefillDone {
                    first_token: out.token,
                    digest: digest.value(),
                    blocks: digest.blocks(),
                    cached_tokens: out.cached_tokens as u32,
                };
                let item = Ok(PrefillChunk {
                    item: Some(prefill_chunk::Item::Done(done)),
                });
                // The handle is dropped here: the request has ended (max_tokens 1).
                Some((vec![item], None))
            }
            None => Some((
                vec![Err(Status::unavailable("prefill worker stopped"))],
                None,
            )),
        }
    });
    Box::pin(chunks.flat_map(stream::iter))
}

#[tonic::async_trait]
impl worker_server::Worker for PrefillService {
    type GenerateStream = BoxStream<GenerateChunk>;
    type PrefillStream = BoxStream<PrefillChunk>;

    async fn generate(
        &self,
        _request: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        Err(Status::unimplemented(
            "a prefill worker does not decode: send Generate to a decode worker",
        ))
    }

    async fn prefill(
        &self,
        request: Request<PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        self.ctx.check_accepting()?;
        let req = request.into_inner();
        let engine_req = self.engine_request(&req)?;
        let handle = self
            .ctx
            .host
            .submit_exporting(engine_req, req.from_token as usize)?;
        Ok(Response::new(prefill_stream(handle)))
    }

    async fn kv_events(
        &self,
        request: Request<KvEventsRequest>,
    ) -> Result<Response<KvEventsReply>, Status> {
        self.ctx.kv_events(request.into_inner()).map(Response::new)
    }

    async fn health(
        &self,
        _request: Request<HealthRequest>,
    ) -> Result<Response<HealthReply>, Status> {
        Ok(Response::new(self.ctx.health()))
    }
}
