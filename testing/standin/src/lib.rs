//! A stand-in for a vLLM server, built on tandem's own engine (block pool with a real prefix
//! cache, continuous-batching scheduler, the mocker model), for tests and benchmarks on
//! machines without a GPU. It speaks the parts of vLLM that tandem's sidecar relies on,
//! field for field:
//!
//! - `POST /v1/completions` with `prompt` as token ids, `max_tokens`, `temperature`, `seed`,
//!   `stop_token_ids`, `ignore_eos`, `cache_salt`, `logprobs` with
//!   `return_tokens_as_token_ids` (the mocker's tokens are certain: log-probability 0),
//!   `return_token_ids` (choices carry `token_ids`; the first streamed chunk also
//!   `prompt_token_ids`), `stream` with
//!   `stream_options.include_usage` (a last chunk with empty `choices` and `usage`, whose
//!   `prompt_tokens_details.cached_tokens` is the engine's own prefix-cache hit), and
//!   `kv_transfer_params` as vLLM's NIXL connector reads and writes them
//!   (`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`: a request with
//!   `do_remote_decode` keeps its KV and answers `do_remote_prefill`, `remote_engine_id`,
//!   `remote_request_id`, `remote_block_ids`, `remote_host`, `remote_port`, `tp_size`; a
//!   request with `do_remote_prefill` pulls that KV before decoding). The KV really moves:
//!   the decode stand-in fetches the prefill stand-in's exported blocks over a side channel
//!   (`GET /standin/kv/{remote_request_id}`, where NIXL would read them by RDMA) and writes
//!   them into its own arena, so P/D output equals aggregated output only if the bytes
//!   arrive intact.
//! - KV events on a ZMQ PUB socket with a ROUTER replay socket, in vLLM's framing and
//!   encoding ([`tandem_external::events`]), with vLLM-style block hashes that are
//!   not tandem's (the sidecar must recompute them from `token_ids`).
//! - `GET /metrics` with vLLM's names (`vllm:num_requests_running`,
//!   `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:cache_config_info`,
//!   `vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
//!   `vllm:prompt_tokens_total`, `vllm:request_success_total`, and with LoRA
//!   `vllm:lora_requests_info`), `GET /health`, `GET /v1/models` (with `max_model_len`, and
//!   the LoRA adapters with their `parent`).
//! - LoRA adapters ([`StandinConfig::lora_modules`]): a request's `model` may name one; it
//!   runs on it (the engine holds [`StandinConfig::max_loras`] at a time), its blocks are
//!   hashed apart from the base model's, and its KV events carry `lora_name` and the LoRA
//!   name in every block's `extra_keys`, as vLLM's do.
//! - Fault injection for tests: `POST /standin/drop-next-event` (the next event batch is
//!   kept for replay but not published), `POST /standin/health/{ok|fail}`; with `no_health`, no `GET /health`;
//!   with `no_models`, no `GET /v1/models` either.
//! - `POST /v1/chat/completions`, in every mode, as vLLM serves it: messages rendered and read
//!   with a template and tokenizer of the stand-in's own (`text.rs`), not the frontend's.
//! - Playing a server that takes text only (`text_prompts`): token-id prompts refused with
//!   a 500, as llama.cpp's Python server answers them; text prompts read with the stand-in's
//!   own tokenizer.

mod connector;
mod events;
mod http;
mod logprobs;
mod request;
mod text;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use parking_lot::Mutex;
use tandem_engine::{BlockPoolConfig, MockEngine, MockEngineConfig};
use tandem_external::events::{WireShape, ZmqPublisher};
use tandem_protocol::{BlockSize, WorkerId};
use tandem_runtime::events::{EventPlane, MemoryEventPlane};
use tandem_worker::{EngineHost, HostPublishing};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use events::BlockRegistry;

/// How a stand-in runs.
#[derive(Clone, Debug)]
pub struct StandinConfig {
    /// The served model name (`model` in requests and `/v1/models`).
    pub model: String,
    /// The connector's engine id (`remote_engine_id`).
    pub engine_id: String,
    pub block_size: u32,
    pub device_blocks: u32,
    /// Prompt plus output tokens at most.
    pub max_model_len: u32,
    /// Divides the mocker's step times (very large: answers at once).
    pub speedup_ratio: f64,
    /// ZMQ PUB endpoint to bind, e.g. `tcp://127.0.0.1:5557`; None: no KV events.
    pub kv_events: Option<String>,
    /// ZMQ ROUTER replay endpoint to bind.
    pub kv_replay: Option<String>,
    pub topic: String,
    /// vLLM's older array-like encoding (and SGLang's) or the newest map encoding.
    pub wire: WireShape,
    /// Event batches kept for replay (vLLM's `buffer_steps`).
    pub replay_buffer: usize,
    /// Host the decode stand-in reaches this one's side channel at (`remote_host`).
    pub advertise_host: String,
    /// Play a plain OpenAI server: text only, `return_token_ids` unknown.
    pub text_only: bool,
    /// No `GET /health` (404), as llama.cpp's Python server, Ollama or a hosted API: then
    /// `GET /v1/models` answers 503 while the stand-in is told it is unhealthy.
    pub no_health: bool,
    /// No `GET /v1/models` either (404): a client sees the server up only by completing.
    pub no_models: bool,
    /// Take prompts as text only, as llama.cpp's Python server: a prompt of token ids is
    /// refused with a 500 wrapping pydantic's validation error (what llama-cpp-python
    /// answers) and text is read with the stand-in's own tokenizer (`text.rs`). Answers are
    /// text only, as with `text_only`.
    pub text_prompts: bool,
    /// A request to the API (`/v1/models`, completions) that arrives while a stream runs ends
    /// that stream at its next token with `[DONE]` and no finish reason, as llama.cpp's Python
    /// server does with its `interrupt_requests` (on by default).
    pub interrupting: bool,
    /// LoRA adapters served, by name (vLLM's `--lora-modules NAME=PATH`; only the names
    /// matter here): a request whose `model` names one runs on it. Empty: LoRA off.
    pub lora_modules: Vec<String>,
    /// Adapters one step may use (vLLM's `--max-loras`, default 1).
    pub max_loras: usize,
    /// A token put before every prompt, as a server whose tokenizer adds a BOS token that the
    /// frontend's does not: it counts each prompt one token longer, and the blocks it caches
    /// (and publishes) hold the shifted tokens.
    pub add_bos: Option<u32>,
}

impl StandinConfig {
    pub fn new(model: &str) -> Self {
        StandinConfig {
            model: model.to_string(),
            engine_id: format!("standin-{}", std::process::id()),
            block_size: 16,
            device_blocks: 4096,
            max_model_len: 32_768,
            speedup_ratio: 1.0,
            kv_events: None,
            kv_replay: None,
            topic: String::new(),
            wire: WireShape::ArrayLike,
            replay_buffer: 10_000,
            advertise_host: "127.0.0.1".into(),
            text_only: false,
            no_health: false,
            no_models: false,
            text_prompts: false,
            interrupting: false,
            lora_modules: Vec::new(),
            max_loras: 1,
            add_bos: None,
        }
    }
}

/// Why a stand-in could not start.
#[derive(Debug, thiserror::Error)]
pub enum StandinError {
    #[error("stand-in config: {0}")]
    Config(String),
    #[error("stand-in I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("stand-in KV events: {0}")]
    Events(String),
}

/// Counters the metrics endpoint shows.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub finished: AtomicU64,
    pub untranslated_blocks: AtomicU64,
    pub kv_pulls: AtomicU64,
    pub kv_pull_failures: AtomicU64,
    /// Completions asked with `stream: true`, and without.
    pub streamed: AtomicU64,
    pub whole: AtomicU64,
}

pub(crate) struct Shared {
    pub config: StandinConfig,
    pub host: EngineHost,
    pub registry: Mutex<BlockRegistry>,
    pub publisher: Option<ZmqPublisher>,
    pub exports: Mutex<connector::Exports>,
    pub counters: Counters,
    pub next_id: AtomicU64,
    pub healthy: AtomicBool,
    /// Requests to the API so far (`interrupting`).
    pub interrupts: AtomicU64,
    pub port: u16,
    pub http: reqwest::Client,
    pub tasks: TaskTracker,
}

/// Serves the stand-in on `listener` until `stop`.
pub async fn run(
    config: StandinConfig,
    listener: TcpListener,
    stop: CancellationToken,
) -> Result<(), StandinError> {
    let block_size = BlockSize::new(config.block_size)
        .map_err(|e| StandinError::Config(format!("block size: {e}")))?;
    let mut pool = BlockPoolConfig::new(WorkerId(1), config.device_blocks);
    pool.block_size = block_size;
    let mut engine_cfg = MockEngineConfig::new(pool);
    engine_cfg.mocker.speedup_ratio = config.speedup_ratio;
    if !config.lora_modules.is_empty() {
        if config.max_loras == 0 {
            return Err(StandinError::Config("max_loras must be at least 1".into()));
        }
        engine_cfg.scheduler.max_loras = config.max_loras;
    }
    let engine =
        MockEngine::new(engine_cfg).map_err(|e| StandinError::Config(format!("engine: {e}")))?;
    let plane = Arc::new(MemoryEventPlane::with_capacity(1 << 16));
    let kv_subject = "standin.kv-events".to_string();
    let subscription = plane
        .subscribe(&kv_subject)
        .await
        .map_err(|e| StandinError::Events(e.to_string()))?;
    let tasks = TaskTracker::new();
    let host = EngineHost::start(
        engine.into_dyn(),
        HostPublishing {
            events: plane.clone(),
            kv_subject,
            metrics: Arc::default(),
        },
        4096,
        &tasks,
        stop.clone(),
    );
    let publisher = match &config.kv_events {
        Some(endpoint) => Some(
            ZmqPublisher::bind(
                endpoint,
                config.kv_replay.as_deref(),
                &config.topic,
                config.replay_buffer,
                config.wire,
            )
            .await
            .map_err(|e| StandinError::Events(e.to_string()))?,
        ),
        None => None,
    };
    let port = listener.local_addr()?.port();
    let http = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| StandinError::Config(format!("HTTP client: {e}")))?;
    let shared = Arc::new(Shared {
        registry: Mutex::new(BlockRegistry::new(
            block_size,
            4 * config.device_blocks as usize + 1024,
        )),
        config,
        host,
        publisher,
        exports: Mutex::new(connector::Exports::default()),
        counters: Counters::default(),
        next_id: AtomicU64::new(1),
        healthy: AtomicBool::new(true),
        interrupts: AtomicU64::new(0),
        port,
        http,
        tasks: tasks.clone(),
    });
    tasks.spawn(events::translate(
        shared.clone(),
        subscription,
        stop.clone(),
    ));
    let app = http::app(shared.clone());
    // As uvicorn (vLLM's server) does: small writes (SSE events) go out at once.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(stop.clone().cancelled_owned())
        .await;
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    served.map_err(StandinError::Io)
}
