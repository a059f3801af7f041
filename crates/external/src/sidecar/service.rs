//! The sidecar's request side ([`WorkerCalls`]): generation and the connectors' prefill
//! handshakes answered through the engine's API, and the sidecar's own count of the requests
//! in flight.

use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use tandem_protocol::grpc::{
    self, AbortPrefillReply, AbortPrefillRequest, GenerateChunk, GenerateRequest, PrefillChunk,
    PrefillDone, PrefillOutcome, PrefillRequest,
};
use tandem_protocol::{ErrorClass, HashSeed, TokenBlockHasher};
use tonic::Status;

use super::super::engine::{
    EngineDelta, EngineError, EngineFinish, EngineGenerate, EngineKind, TextPrompt,
};
use super::Sidecar;
use tandem_worker::error::WorkerError;
use tandem_worker::served::{ChunkStream, ServedEngine, WorkerCalls};

impl Sidecar {
    fn engine_request(&self, req: &GenerateRequest) -> Result<EngineGenerate, Status> {
        if req.prompt.is_empty() {
            return Err(WorkerError::InvalidRequest("empty prompt".into()).into());
        }
        let s = req.sampling.unwrap_or_default();
        if s.logprobs.is_some() && self.inner.config.engine == EngineKind::Openai {
            // Such a server names its alternatives by text, not ids.
            return Err(WorkerError::InvalidRequest(
                "logprobs are not served through an `openai` engine (it names tokens by \
                 text, not ids); run the engine as vllm or sglang"
                    .into(),
            )
            .into());
        }
        let text = match &req.text {
            Some(t) => TextPrompt::from_proto(t).map_err(WorkerError::InvalidRequest)?,
            None => None,
        };
        let api = &self.inner.api;
        if api.takes_text() && text.is_none() {
            return Err(WorkerError::InvalidRequest(format!(
                "the engine at {} takes prompts as text, and this request has token ids only \
                 (a prompt given as token ids cannot reach it; send text or messages)",
                api.base_url()
            ))
            .into());
        }
        Ok(EngineGenerate {
            request_id: {
                // `format!` costs a request more than these two pushes.
                let mut id = String::with_capacity(27);
                id.push_str("tandem-");
                id.push_str(itoa::Buffer::new().format(req.request_id));
                id
            },
            prompt: req.prompt.clone(),
            max_tokens: s.max_tokens.max(1),
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k.filter(|&k| k > 0),
            min_p: s.min_p.filter(|&p| p > 0.0),
            seed: Some(s.seed),
            stop_token: s.stop_token,
            ignore_eos: s.ignore_eos,
            cache_salt: Some(req.cache_salt.clone()).filter(|s| !s.is_empty()),
            kv_transfer_params: None,
            bootstrap: None,
            lora_adapter: Some(req.lora_adapter.clone()).filter(|a| !a.is_empty()),
            logprobs: s.logprobs,
            // Only a text engine gets text: another prefills exactly the routed tokens.
            text: text.filter(|_| api.takes_text()),
        })
    }

    /// Asks the prefill sidecar `target` to run the prompt on its engine with the
    /// connector's handshake; returns the `kv_transfer_params` for this engine's request.
    async fn remote_prefill(
        &self,
        target: &grpc::RemotePrefillTarget,
        req: &GenerateRequest,
    ) -> Result<serde_json::Value, WorkerError> {
        let mut client = self.prefill_client(&target.address)?;
        // SGLang's router picks a random room per request (`random.randint(0, 2**63 - 1)`).
        let room = xxhash_rust::xxh3::xxh3_64_with_seed(
            &req.request_id.to_le_bytes(),
            self.inner.started.elapsed().as_nanos() as u64,
        ) >> 1;
        let prefill = PrefillRequest {
            request_id: req.request_id,
            prompt: req.prompt.clone(),
            hash_seed: req.hash_seed,
            sampling_seed: req.sampling.as_ref().map_or(0, |s| s.seed),
            temperature: req.sampling.as_ref().map_or(0.0, |s| s.temperature),
            top_p: req.sampling.as_ref().and_then(|s| s.top_p),
            top_k: req.sampling.as_ref().and_then(|s| s.top_k),
            min_p: req.sampling.as_ref().and_then(|s| s.min_p),
            logprobs: None,
            from_token: 0,
            block_size: self.inner.shape.block_size.get(),
            bytes_per_block: 0,
            destination_blocks: Vec::new(),
            destination: String::new(),
            engine_handshake: true,
            cache_salt: req.cache_salt.clone(),
            bootstrap_room: room,
            lora_adapter: req.lora_adapter.clone(),
            // The engines' own connectors move the KV: there is nothing to digest.
            skip_digest: true,
            kv_element_bytes: 0,
        };
        let mut stream = client
            .prefill(prefill)
            .await
            .map_err(|s| WorkerError::BadTransfer(format!("prefill refused: {}", s.message())))?
            .into_inner();
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|s| WorkerError::BadTransfer(format!("prefill: {}", s.message())))?;
            if let Some(grpc::prefill_chunk::Item::Done(done)) = chunk.item {
                return serde_json::from_str(&done.kv_transfer_params).map_err(|e| {
                    WorkerError::BadTransfer(format!("prefill handshake is not JSON: {e}"))
                });
            }
        }
        Err(WorkerError::BadTransfer(
            "prefill stream ended without its handshake".into(),
        ))
    }

    /// Prompt tokens the engine holds in its device cache, by its relayed events (0
    /// without events). Like the engines, never the whole prompt: the last token is always
    /// computed.
    fn cached_estimate(&self, req: &GenerateRequest) -> u32 {
        let Some(relay) = &self.inner.relay else {
            return 0;
        };
        let bs = self.inner.shape.block_size;
        let mut hasher = TokenBlockHasher::new(bs, HashSeed(req.hash_seed));
        let mut hashes = Vec::new();
        hasher.extend(&req.prompt, &mut hashes);
        let chain: Vec<_> = hashes.iter().map(|h| h.sequence).collect();
        let held = relay.device_prefix(&chain) as u64 * u64::from(bs.get());
        let most = (req.prompt.len() as u64).saturating_sub(1);
        u32::try_from(held.min(most) / u64::from(bs.get()) * u64::from(bs.get()))
            .unwrap_or(u32::MAX)
    }

    /// SGLang's disaggregation (as its router, `sglang_router` / `mini_lb`, drives it): the
    /// prefill and decode engines get the same request with `bootstrap_host`,
    /// `bootstrap_port` (the prefill engine's bootstrap server) and `bootstrap_room`, at the
    /// same time; the prefill engine waits in the room for the decode engine and sends it
    /// the KV. So the handshake is answered at once, and the prefill request runs on in the
    /// background (its own timeout bounds it).
    fn prefill_sglang(&self, req: PrefillRequest) -> Result<ChunkStream<PrefillChunk>, Status> {
        let c = &self.inner.config;
        let host = c
            .bootstrap_host
            .clone()
            .or_else(|| url_host(&c.engine_url))
            .ok_or_else(|| {
                ErrorClass::Internal.status("no bootstrap host for the SGLang engine")
            })?;
        let port = c
            .bootstrap_port
            .or(self.inner.shape.bootstrap_port)
            .ok_or_else(|| {
                ErrorClass::Internal.status(
                    "the SGLang engine reports no disaggregation_bootstrap_port: pass \
                 --engine-bootstrap-port",
                )
            })?;
        let room = req.bootstrap_room;
        let bootstrap = super::super::engine::SglangBootstrap {
            host: host.clone(),
            port,
            room,
        };
        let engine_req = EngineGenerate {
            bootstrap: Some(bootstrap),
            ..connector_prefill(req)
        };
        let flight = self.begin(engine_req.prompt.len() as u64);
        let api = self.inner.api.clone();
        let timeout = c.prefill_timeout;
        self.inner.tasks.spawn(async move {
            let _flight = flight;
            match tokio::time::timeout(timeout, api.generate_whole(&engine_req)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(room, error = %e, "SGLang prefill failed"),
                Err(_) => tracing::warn!(room, ?timeout, "SGLang prefill timed out"),
            }
        });
        let done = PrefillDone {
            first_token: 0,
            digest: 0,
            blocks: 0,
            cached_tokens: 0,
            kv_transfer_params: serde_json::json!({
                "bootstrap_host": host,
                "bootstrap_port": port,
                "bootstrap_room": room,
            })
            .to_string(),
            first_token_logprobs: None,
        };
        let chunk = PrefillChunk {
            item: Some(grpc::prefill_chunk::Item::Done(done)),
        };
        Ok(Box::pin(futures::stream::once(async move { Ok(chunk) })))
    }

    /// A client of the prefill sidecar at `address`, made once per address (connections are
    /// opened lazily and kept).
    fn prefill_client(
        &self,
        address: &str,
    ) -> Result<grpc::worker_client::WorkerClient<tonic::transport::Channel>, WorkerError> {
        let mut clients = self.inner.prefill_clients.lock();
        if let Some(c) = clients.get(address) {
            return Ok(c.clone());
        }
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))
            .map_err(|e| WorkerError::BadTransfer(format!("prefill address {address}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy();
        let client = grpc::worker_client::WorkerClient::new(channel);
        if clients.len() >= 1024 {
            clients.clear();
        }
        clients.insert(address.to_string(), client.clone());
        Ok(client)
    }

    /// [`Self::begin`] for a generation. Against an engine probed with requests of its API,
    /// it does not start while a probe runs (the probe sees it in flight or not at all:
    /// `Sidecar::probe`).
    async fn begin_generation(&self, prompt_tokens: u64) -> FlightGuard {
        let _gate = match self.inner.api.has_health_route() {
            true => None,
            false => Some(self.inner.probe_gate.lock().await),
        };
        self.begin(prompt_tokens)
    }

    /// Counts a request in flight.
    fn begin(&self, prompt_tokens: u64) -> FlightGuard {
        self.inner.in_flight.fetch_add(1, Ordering::AcqRel);
        self.inner
            .pending_prefill_tokens
            .fetch_add(prompt_tokens, Ordering::AcqRel);
        self.inner.stats.requests.fetch_add(1, Ordering::Relaxed);
        FlightGuard {
            sidecar: self.clone(),
            pending: prompt_tokens,
        }
    }
}

/// A request's place in the sidecar's own counts.
struct FlightGuard {
    sidecar: Sidecar,
    /// Prompt tokens still counted as pending prefill (until the first token).
    pending: u64,
}

impl FlightGuard {
    fn first_token(&mut self) {
        let p = std::mem::take(&mut self.pending);
        self.sidecar
            .inner
            .pending_prefill_tokens
            .fetch_sub(p, Ordering::AcqRel);
    }
}

impl Drop for FlightGuard {
    fn drop(&mut self) {
        self.first_token();
        if self.sidecar.inner.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.sidecar.inner.idle.notify_waiters();
        }
    }
}

/// The host part of `http://host:port/...`.
fn url_host(url: &str) -> Option<String> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next()?;
    let host = match authority.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => authority,
    };
    (!host.is_empty()).then(|| host.trim_matches(['[', ']']).to_string())
}

/// SGLang's bootstrap fields out of a prefill sidecar's handshake.
fn bootstrap_of(params: &serde_json::Value) -> Option<super::super::engine::SglangBootstrap> {
    Some(super::super::engine::SglangBootstrap {
        host: params.get("bootstrap_host")?.as_str()?.to_string(),
        port: u16::try_from(params.get("bootstrap_port")?.as_u64()?).ok()?,
        room: params.get("bootstrap_room")?.as_u64()?,
    })
}

fn engine_status(e: &EngineError) -> Status {
    e.class().status(e.to_string())
}

#[tonic::async_trait]
impl WorkerCalls for Sidecar {
    fn engine(&self) -> &dyn ServedEngine {
        self
    }

    async fn generate(
        &self,
        req: GenerateRequest,
        _span: tracing::Span,
    ) -> Result<ChunkStream<GenerateChunk>, Status> {
        self.generate_inner(req).await
    }

    async fn prefill(
        &self,
        req: PrefillRequest,
        _span: tracing::Span,
    ) -> Result<ChunkStream<PrefillChunk>, Status> {
        self.prefill_inner(req).await
    }

    async fn abort_prefill(&self, _req: AbortPrefillRequest) -> Result<AbortPrefillReply, Status> {
        // Nothing of a connector prefill reaches tandem's regions: nothing to fence.
        Ok(AbortPrefillReply { was_running: false })
    }
}

/// The calls' bodies (run under their server spans by [`tandem_worker::served::WorkerService`]).
impl Sidecar {
    /// A generation the engine failed, counted, as the status the worker protocol sends.
    fn engine_failed(&self, e: &EngineError) -> Status {
        self.inner
            .stats
            .engine_errors
            .fetch_add(1, Ordering::Relaxed);
        engine_status(e)
    }

    async fn generate_inner(
        &self,
        req: GenerateRequest,
    ) -> Result<ChunkStream<GenerateChunk>, Status> {
        if req.sampling.as_ref().is_some_and(|s| s.embed) {
            // An external engine's embeddings are its own `/v1/embeddings` (when it serves
            // them at all, vLLM with `--task embed`): not proxied through a sidecar.
            return Err(Status::invalid_argument(format!(
                "embeddings are not served through the {} sidecar: ask the engine's own \
                 /v1/embeddings",
                self.inner.config.engine.as_str()
            )));
        }
        let mut engine_req = self.engine_request(&req)?;
        // Until the engine's own count arrives with its usage (at the end), the first chunk
        // says what the engine's events say it held of the prompt, taken before the engine
        // sees the request: once it has, the events of the request's own prefill may have
        // come in (a fast engine's, on a loaded machine), and its own blocks would count as
        // cached.
        let estimate = self.cached_estimate(&req);
        let mut flight = self.begin_generation(req.prompt.len() as u64).await;
        let mut outcome = PrefillOutcome::Local;
        if let Some(target) = &req.remote_prefill {
            self.inner
                .stats
                .remote_prefills
                .fetch_add(1, Ordering::Relaxed);
            let timeout = self.inner.config.prefill_timeout;
            let sglang = self.inner.config.engine == EngineKind::Sglang;
            match tokio::time::timeout(timeout, self.remote_prefill(target, &req)).await {
                Ok(Ok(params)) if sglang => match bootstrap_of(&params) {
                    Some(b) => {
                        engine_req.bootstrap = Some(b);
                        outcome = PrefillOutcome::Remote;
                    }
                    None => {
                        tracing::debug!(%params, "prefill handshake without a bootstrap room");
                        outcome = PrefillOutcome::Fallback;
                    }
                },
                Ok(Ok(params)) => {
                    engine_req.kv_transfer_params = Some(params);
                    outcome = PrefillOutcome::Remote;
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "remote prefill failed: local prefill");
                    outcome = PrefillOutcome::Fallback;
                }
                Err(_) => {
                    tracing::debug!(?timeout, "remote prefill timed out: local prefill");
                    outcome = PrefillOutcome::Fallback;
                }
            }
            // An SGLang decode engine cannot prefill by itself: without its prefill engine the
            // request goes back to the frontend, which tries another worker (nothing was
            // generated yet).
            if sglang && outcome == PrefillOutcome::Fallback {
                self.inner
                    .stats
                    .remote_prefill_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
                return Err(ErrorClass::Unavailable.status(
                    "the SGLang prefill engine did not take the request (a decode-mode SGLang \
                     engine cannot prefill by itself)",
                ));
            }
            if outcome == PrefillOutcome::Fallback {
                self.inner
                    .stats
                    .remote_prefill_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut chunks = Chunks {
            first: true,
            text_tokens: 0,
            estimate,
            prompt_tokens: req.prompt.len() as u32,
            outcome,
        };
        // A client that takes the answer whole gets it asked of the engine whole: one
        // answer to read instead of an event per token, and one chunk to pass on, with no
        // channel and producer between (they were a tenth of the sidecar's allocations).
        if req.whole {
            let d = self
                .inner
                .api
                .generate_whole(&engine_req)
                .await
                .map_err(|e| self.engine_failed(&e))?;
            let chunk = chunks.of(d, &mut flight);
            drop(flight);
            return Ok(Box::pin(futures::stream::iter(chunk.map(Ok))));
        }
        let mut deltas = self
            .inner
            .api
            .generate(&engine_req)
            .await
            .map_err(|e| self.engine_failed(&e))?;
        let sidecar = self.clone();
        let stream = super::super::engine::channel_stream(move |tx| async move {
            // The finishing chunk waits for the engine's usage, which follows it (vLLM's
            // `include_usage` chunk): that is where the engine's own cached-token count is.
            let mut last: Option<GenerateChunk> = None;
            while let Some(d) = deltas.next().await {
                let d = match d {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = tx.send(Err(sidecar.engine_failed(&e))).await;
                        return;
                    }
                };
                if let Some(l) = last.as_mut() {
                    l.tokens.extend(d.tokens);
                    l.logprobs.extend(d.logprobs);
                    l.cached_tokens = d.cached_tokens.unwrap_or(l.cached_tokens);
                    l.prompt_tokens = d.prompt_tokens.unwrap_or(l.prompt_tokens);
                    if let Some(t) = d.text {
                        l.text.get_or_insert_with(String::new).push_str(&t);
                    }
                    // A text-only engine's usage: what its chunks did not count yet.
                    if l.text.is_some()
                        && let Some(total) = d.completion_tokens
                    {
                        l.completion_tokens += total.saturating_sub(chunks.text_tokens);
                    }
                    continue;
                }
                let Some(chunk) = chunks.of(d, &mut flight) else {
                    continue;
                };
                if chunk.finish != grpc::FinishReason::Unspecified as i32 {
                    last = Some(chunk);
                } else if tx.send(Ok(chunk)).await.is_err() {
                    return;
                }
            }
            if let Some(l) = last {
                let _ = tx.send(Ok(l)).await;
            }
            drop(flight);
        });
        Ok(stream)
    }

    async fn prefill_inner(
        &self,
        mut req: PrefillRequest,
    ) -> Result<ChunkStream<PrefillChunk>, Status> {
        if !req.engine_handshake {
            return Err(WorkerError::InvalidRequest(
                "this worker fronts an external engine: it prefills through the engine's KV \
                 connector (engine_handshake), not into tandem's KV regions"
                    .into(),
            )
            .into());
        }
        if req.block_size != self.inner.shape.block_size.get() {
            return Err(WorkerError::InvalidRequest(format!(
                "block size {} differs from this engine's {}",
                req.block_size,
                self.inner.shape.block_size.get()
            ))
            .into());
        }
        if self.inner.config.engine == EngineKind::Sglang {
            return self.prefill_sglang(req);
        }
        let _flight = self.begin(req.prompt.len() as u64);
        // vLLM's connector protocol, as its disaggregated proxy uses it: the prefill request
        // asks to keep the KV for a remote decode and generates one token.
        let cache_salt = Some(std::mem::take(&mut req.cache_salt)).filter(|s| !s.is_empty());
        let engine_req = EngineGenerate {
            cache_salt,
            kv_transfer_params: Some(serde_json::json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            })),
            ..connector_prefill(req)
        };
        let answer = self
            .inner
            .api
            .generate_whole(&engine_req)
            .await
            .map_err(|e| engine_status(&e))?;
        let Some(params) = answer.kv_transfer_params else {
            return Err(ErrorClass::Internal.status(
                "the engine's answer has no kv_transfer_params: is it started with a \
                 --kv-transfer-config whose kv_role is kv_producer or kv_both?",
            ));
        };
        let done = PrefillDone {
            first_token: answer.tokens.first().copied().unwrap_or(0),
            digest: 0,
            blocks: 0,
            cached_tokens: answer.cached_tokens.unwrap_or(0),
            kv_transfer_params: params.to_string(),
            first_token_logprobs: None,
        };
        let chunk = PrefillChunk {
            item: Some(grpc::prefill_chunk::Item::Done(done)),
        };
        Ok(Box::pin(futures::stream::once(async move { Ok(chunk) })))
    }
}

/// The engine request of a prefill for a connector handshake (vLLM's and SGLang's alike): the
/// prompt, one greedy token past the end of sequence, on the request's adapter.
fn connector_prefill(req: PrefillRequest) -> EngineGenerate {
    EngineGenerate {
        request_id: format!("tandem-{}", req.request_id),
        prompt: req.prompt,
        max_tokens: 1,
        temperature: 0.0,
        seed: Some(req.sampling_seed),
        ignore_eos: true,
        lora_adapter: Some(req.lora_adapter).filter(|a| !a.is_empty()),
        ..EngineGenerate::default()
    }
}

/// A generation's engine deltas made into the chunks the worker protocol sends, in order.
struct Chunks {
    first: bool,
    /// Tokens counted for text-only chunks so far (one a chunk until the usage says).
    text_tokens: u32,
    /// What the engine's events say it held of the prompt, until its usage says.
    estimate: u32,
    prompt_tokens: u32,
    outcome: PrefillOutcome,
}

impl Chunks {
    /// The chunk of one delta; None for a delta with no tokens, no text and no finish.
    fn of(&mut self, d: EngineDelta, flight: &mut FlightGuard) -> Option<GenerateChunk> {
        let has_text = d.text.as_ref().is_some_and(|t| !t.is_empty());
        if d.tokens.is_empty() && !has_text && d.finish.is_none() {
            return None;
        }
        if self.first && (!d.tokens.is_empty() || has_text) {
            flight.first_token();
        }
        // Text without ids: one token per streamed chunk until the usage says (a whole
        // answer's usage comes with it).
        let counted = match has_text {
            true => d.completion_tokens.unwrap_or(1).max(1),
            false => 0,
        };
        self.text_tokens += counted;
        let prefill = match self.first {
            true => self.outcome as i32,
            false => PrefillOutcome::Unspecified as i32,
        };
        self.first = false;
        Some(GenerateChunk {
            embedding: Vec::new(),
            text: d.text,
            completion_tokens: counted,
            tokens: d.tokens,
            cached_tokens: d.cached_tokens.unwrap_or(self.estimate),
            prompt_tokens: d.prompt_tokens.unwrap_or(self.prompt_tokens),
            finish: match d.finish {
                Some(EngineFinish::Length) => grpc::FinishReason::Length as i32,
                Some(EngineFinish::Stop) => grpc::FinishReason::Stop as i32,
                None => grpc::FinishReason::Unspecified as i32,
            },
            prefill,
            logprobs: d.logprobs,
            handover: false,
        })
    }
}
