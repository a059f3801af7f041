//! The service roles: `tandem frontend | prefill | decode | indexer`, each on etcd and NATS.
//! Flags (each with an environment variable) become the library's config structs here; the
//! services themselves live in the crates.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgAction, Args};
use tandem_external::{EngineKind, SidecarConfig};
use tandem_frontend::cluster::{BackendConfig, ClusterDeps, FrontendConfig, ViewConfig};
use tandem_frontend::http::{
    ChatTemplateSpec, EnvLookup, GroupsOptions, HttpConfig, ResponsesStoreConfig, TokenizerSpec,
};
use tandem_protocol::{BlockSize, WorkerId, WorkerRole};
use tandem_router::RouterId;
use tandem_runtime::discovery::{Discovery, EtcdConfig, EtcdDiscovery};
use tandem_runtime::events::{EventPlane, NatsAuth, NatsConfig, NatsEventPlane};
use tandem_runtime::shutdown::Shutdown;
use tandem_worker::{WorkerConfig, WorkerDeps};
use tokio::net::TcpListener;

use crate::args::engine::EngineArgs;

/// Where discovery and the event plane are.
#[derive(Args, Debug, Clone)]
pub struct PlaneArgs {
    /// Namespace of keys and subjects: clusters in different namespaces never see each other.
    #[arg(long, env = "TANDEM_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// etcd client endpoints, comma-separated (required, except for a frontend with
    /// --backend-url).
    #[arg(long, env = "TANDEM_ETCD_ENDPOINTS", value_delimiter = ',')]
    pub etcd_endpoints: Vec<String>,
    /// Worker lease TTL in seconds (kept alive every third of it).
    #[arg(long, env = "TANDEM_LEASE_TTL_S", default_value_t = 10)]
    pub lease_ttl_s: u64,
    #[arg(long, env = "TANDEM_ETCD_USER")]
    pub etcd_user: Option<String>,
    #[arg(long, env = "TANDEM_ETCD_PASSWORD", hide_env_values = true)]
    pub etcd_password: Option<String>,
    /// NATS server URL (required, except for a frontend with --backend-url).
    #[arg(long, env = "TANDEM_NATS_URL")]
    pub nats_url: Option<String>,
    #[arg(long, env = "TANDEM_NATS_USER")]
    pub nats_user: Option<String>,
    #[arg(long, env = "TANDEM_NATS_PASSWORD", hide_env_values = true)]
    pub nats_password: Option<String>,
    #[arg(long, env = "TANDEM_NATS_TOKEN", hide_env_values = true)]
    pub nats_token: Option<String>,
    /// NATS credentials file (JWT and nkey seed).
    #[arg(long, env = "TANDEM_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
    /// Log one JSON object per line.
    #[arg(long, env = "TANDEM_LOG_JSON", default_value_t = false)]
    pub log_json: bool,
    /// Export traces over OTLP gRPC to this collector (e.g. `http://otel-collector:4317`):
    /// one span per layer of a request (HTTP, tokenize, queue, route, remote prefill, KV
    /// transfer, decode, stream), linked across processes by W3C trace context, with the
    /// OpenTelemetry GenAI attributes. Unset: no traces.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// Fraction of the traces begun here that are exported, 0–1 (a request that arrives with
    /// a `traceparent` follows its sampled flag instead).
    #[arg(long, env = "TANDEM_OTLP_SAMPLING_RATIO", default_value_t = 1.0)]
    pub otlp_sampling_ratio: f64,
}

impl PlaneArgs {
    /// Logs, and traces when an OTLP endpoint is set, as `service` (`tandem-frontend`, …);
    /// hold the guard until the process ends (it flushes the traces).
    pub fn init_telemetry(
        &self,
        service: &str,
        instance: Option<String>,
    ) -> anyhow::Result<tandem_runtime::telemetry::TelemetryGuard> {
        use tandem_runtime::telemetry::{OtlpConfig, TelemetryConfig, init};
        let otlp = self.otlp_endpoint.as_ref().map(|endpoint| OtlpConfig {
            sampling_ratio: self.otlp_sampling_ratio,
            instance_id: instance,
            ..OtlpConfig::new(endpoint, service)
        });
        Ok(init(TelemetryConfig {
            json: self.log_json,
            filter: None,
            otlp,
        })?)
    }

    pub async fn connect(&self, name: &str) -> anyhow::Result<ClusterDeps> {
        if self.etcd_endpoints.is_empty() {
            anyhow::bail!("--etcd-endpoints (or TANDEM_ETCD_ENDPOINTS) is required");
        }
        let Some(nats_url) = self.nats_url.clone() else {
            anyhow::bail!("--nats-url (or TANDEM_NATS_URL) is required");
        };
        let etcd = EtcdConfig {
            endpoints: self.etcd_endpoints.clone(),
            namespace: self.namespace.clone(),
            lease_ttl: Duration::from_secs(self.lease_ttl_s),
            username: self.etcd_user.clone(),
            password: self.etcd_password.clone(),
            ..Default::default()
        };
        let discovery: Arc<dyn Discovery> = Arc::new(
            EtcdDiscovery::connect(etcd)
                .await
                .context("connecting to etcd")?,
        );
        let auth = NatsAuth::from_parts(
            self.nats_user.clone(),
            self.nats_password.clone(),
            self.nats_token.clone(),
            self.nats_creds.clone(),
        )
        .context("--nats-user/--nats-password/--nats-token/--nats-creds")?;
        let nats = NatsConfig {
            url: nats_url,
            auth,
            name: Some(name.to_string()),
            ..Default::default()
        };
        let events: Arc<dyn EventPlane> = Arc::new(
            NatsEventPlane::connect(nats)
                .await
                .context("connecting to NATS")?,
        );
        Ok(ClusterDeps { discovery, events })
    }
}

/// The engine behind a worker: the in-process mocker, or an external engine fronted by this
/// worker as a sidecar.
#[derive(Args, Debug, Clone)]
pub struct ExternalEngineArgs {
    /// mocker (in-process, a timing model), native (in-process, the GGUF file --model names:
    /// real tokens), vllm, sglang, or openai (an OpenAI-compatible server with vLLM's
    /// `return_token_ids`); the last three are reached at --engine-url.
    #[arg(long, env = "TANDEM_ENGINE", default_value = "mocker")]
    pub engine: String,
    /// The external engine's HTTP API, e.g. http://10.0.0.5:8000.
    #[arg(long, env = "TANDEM_ENGINE_URL")]
    pub engine_url: Option<String>,
    /// The engine's ZMQ KV event publisher, e.g. tcp://10.0.0.5:5557 (vLLM:
    /// --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
    /// "endpoint": "tcp://*:5557"}'). Without it the frontend knows nothing of the engine's
    /// cache.
    #[arg(long, env = "TANDEM_ENGINE_KV_EVENTS")]
    pub engine_kv_events: Option<String>,
    /// The engine's ZMQ replay socket (vLLM's `replay_endpoint`), for repairing lost events;
    /// without it a gap costs a clear of this worker's entries in the index.
    #[arg(long, env = "TANDEM_ENGINE_KV_REPLAY")]
    pub engine_kv_replay: Option<String>,
    /// The ZMQ topic the engine publishes on (vLLM's `topic`).
    #[arg(long, env = "TANDEM_ENGINE_KV_TOPIC", default_value = "")]
    pub engine_kv_topic: String,
    /// The model name the engine serves, when it is not --model.
    #[arg(long, env = "TANDEM_ENGINE_MODEL")]
    pub engine_model: Option<String>,
    /// Milliseconds between the engine's health checks.
    #[arg(long, env = "TANDEM_ENGINE_HEALTH_INTERVAL_MS", default_value_t = 1000)]
    pub engine_health_interval_ms: u64,
    /// Failed health checks in a row before the engine's worker leaves discovery.
    #[arg(long, env = "TANDEM_ENGINE_HEALTH_FAILURES", default_value_t = 3)]
    pub engine_health_failures: u32,
    /// Seconds to wait at start for the engine to answer /health (loading weights).
    #[arg(long, env = "TANDEM_ENGINE_STARTUP_TIMEOUT_S", default_value_t = 600)]
    pub engine_startup_timeout_s: u64,
    /// SGLang started with --incremental-streaming-output.
    #[arg(
        long,
        env = "TANDEM_ENGINE_INCREMENTAL_OUTPUT",
        default_value_t = false
    )]
    pub engine_incremental_output: bool,
    /// SGLang prefill engines: the host decode engines reach its bootstrap server at
    /// (default: --engine-url's host).
    #[arg(long, env = "TANDEM_ENGINE_BOOTSTRAP_HOST")]
    pub engine_bootstrap_host: Option<String>,
    /// SGLang prefill engines: its --disaggregation-bootstrap-port (default: as its server
    /// info says).
    #[arg(long, env = "TANDEM_ENGINE_BOOTSTRAP_PORT")]
    pub engine_bootstrap_port: Option<u16>,
    /// Where a gateway reaches the engine's HTTP API, `host:port` (e.g. the pod IP and
    /// vLLM's port), registered for the endpoint picker (`tandem epp`). Default:
    /// --engine-url's host and port, a loopback host replaced by --advertise-host.
    #[arg(long, env = "TANDEM_ENGINE_ADVERTISE")]
    pub engine_advertise: Option<String>,
}

/// One worker process.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub plane: PlaneArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub external: ExternalEngineArgs,
    #[command(flatten)]
    pub model_cache: crate::models::ModelCacheArgs,
    /// gRPC listen address (or --host and --port).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "127.0.0.1:0")]
    pub listen: String,
    #[command(flatten)]
    pub host_port: crate::args::listen::HostPort,
    /// Host other processes reach this worker at (the bound port is appended).
    #[arg(long, env = "TANDEM_ADVERTISE_HOST", default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// Serve the worker's Prometheus metrics at `GET /metrics` on this address (`host:port`;
    /// port 0 picks one), registered in discovery. vLLM's names where the meaning is the
    /// same (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, …). A sidecar in
    /// front of vLLM or SGLang leaves metrics to the engine's own `/metrics`.
    #[arg(long, env = "TANDEM_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Topology label (rack, NVLink domain, zone): workers with the same label move KV
    /// between them faster than across labels; the router's prefill choice counts it.
    #[arg(long, env = "TANDEM_TOPOLOGY_RACK", default_value = "")]
    pub topology_rack: String,
    /// Worker id (random when not given).
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<u64>,
    /// Model name registered in discovery; the frontend serves workers of its model only.
    #[arg(long, env = "TANDEM_MODEL", default_value = "mocker")]
    pub model: String,
    /// Seconds a draining worker waits for in-flight requests.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Decode: a draining worker offers its streams' KV to their frontends, which continue
    /// them on other decode workers with this one as the remote prefill (the KV moves,
    /// nothing is recomputed). `--drain-handover=false`: streams finish here.
    #[arg(long, env = "TANDEM_DRAIN_HANDOVER", default_value_t = true, action = clap::ArgAction::Set)]
    pub drain_handover: bool,
    /// Decode: milliseconds a remote prefill may take before prefilling locally (default
    /// 5,000; with `--engine native`, whose prefill of a long prompt on CPUs takes tens of
    /// seconds, 600,000).
    #[arg(long, env = "TANDEM_PREFILL_TIMEOUT_MS")]
    pub prefill_timeout_ms: Option<u64>,
    /// Milliseconds between load reports.
    #[arg(long, env = "TANDEM_LOAD_INTERVAL_MS", default_value_t = 500)]
    pub load_interval_ms: u64,
    /// Decode: seconds the blocks of an abandoned remote prefill stay out of use when the
    /// prefill worker cannot confirm that it stopped writing them.
    #[arg(long, env = "TANDEM_TRANSFER_FENCE_TIMEOUT_S", default_value_t = 60)]
    pub transfer_fence_timeout_s: u64,
    /// Where the KV arena lives: host, or cuda / cuda:N (GPU memory; needs a build with
    /// `--features cuda` and an NVIDIA driver).
    #[arg(long, env = "TANDEM_KV_MEMORY", default_value = "host")]
    pub kv_memory: tandem_worker::KvMemory,
    #[command(flatten)]
    pub kv: crate::args::kv_transport::KvTransportArgs,
    /// Fault injection (prefill workers): corrupt one byte of every KV transfer after its
    /// digest is taken, so decode workers must detect it and prefill locally.
    #[arg(long, hide = true, default_value_t = false)]
    pub inject_kv_corruption: bool,
    /// Fault injection: the worker's KV event batches are dropped, duplicated and reordered
    /// on the event plane, e.g. `drop=0.05,duplicate=0.05,reorder=0.05,seed=1`.
    #[arg(long, hide = true)]
    pub inject_kv_event_faults: Option<String>,
}

/// A fresh random 63-bit id.
pub fn random_id() -> u64 {
    RandomState::new().hash_one(std::process::id()) >> 1
}

impl WorkerArgs {
    pub fn config(&self, role: WorkerRole) -> anyhow::Result<WorkerConfig> {
        let id = WorkerId(self.worker_id.unwrap_or_else(random_id));
        let mut c = self
            .engine
            .config(role, id, &self.model, &self.plane.namespace)?;
        c.advertise_host = self.advertise_host.clone();
        c.rack = self.topology_rack.clone();
        c.corrupt_transfers = self.inject_kv_corruption;
        c.drain_timeout = Duration::from_secs(self.drain_timeout_s);
        c.drain_handover = self.drain_handover;
        if let Some(ms) = self.prefill_timeout_ms {
            c.prefill_timeout = Duration::from_millis(ms);
        }
        c.load_interval = Duration::from_millis(self.load_interval_ms);
        c.transfer_fence_timeout = Duration::from_secs(self.transfer_fence_timeout_s);
        c.kv_memory = self.kv_memory;
        c.kv_digest = self.kv.kv_digest;
        c.kv_layer_streaming = self.kv.kv_layer_streaming;
        c.metrics_listen = self.metrics_addr.clone();
        Ok(c)
    }
}

/// The HTTP side of a frontend.
#[derive(Args, Debug, Clone)]
pub struct HttpArgs {
    /// Served model name; workers must register the same. `tandem up`: the model its engine
    /// computes, a GGUF path or a named model (smollm2-135m-instruct by default, fetched on
    /// first use); with `--engine mocker`, the name served.
    #[arg(long, env = "TANDEM_MODEL", default_value = HttpArgs::DEFAULT_MODEL)]
    pub model: String,
    /// LoRA adapters served on top of --model, comma-separated: a request whose `model` names
    /// one runs on it (the workers' engines must serve it under that name), is cached apart
    /// from the base model and routed to workers that hold it. `GET /v1/models` lists them.
    #[arg(long, env = "TANDEM_LORA_ADAPTERS", value_delimiter = ',')]
    pub lora_adapters: Vec<String>,
    /// cl100k_base, o200k_base, a path to a tokenizer.json, or a GGUF model file (its own
    /// tokenizer and chat template).
    #[arg(long, env = "TANDEM_TOKENIZER", default_value = HttpArgs::DEFAULT_TOKENIZER)]
    pub tokenizer: String,
    /// Most prompt + completion tokens per request.
    #[arg(long, env = "TANDEM_CONTEXT_LENGTH", default_value_t = 32_768)]
    pub context_length: u32,
    /// Seconds a draining frontend lets responses finish.
    #[arg(long, env = "TANDEM_DRAIN_TIMEOUT_S", default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// The chat template: a Jinja file, or a tokenizer_config.json whose `chat_template` to
    /// use. Default: the tokenizer_config.json beside a Hugging Face --tokenizer, else the
    /// built-in ChatML (the mocker's). It must be the engine's, or the router hashes other
    /// tokens than the engine caches.
    #[arg(long, env = "TANDEM_CHAT_TEMPLATE")]
    pub chat_template: Option<PathBuf>,
    /// Which of a tokenizer_config.json's named templates (default: "default", or
    /// "tool_use" for requests with tools when there is one).
    #[arg(long, env = "TANDEM_CHAT_TEMPLATE_NAME")]
    pub chat_template_name: Option<String>,
    /// Tool calls read out of the generated text: auto (on when the template knows
    /// `<tool_call>`), hermes (Hermes / Qwen `<tool_call>` JSON), or none.
    #[arg(long, env = "TANDEM_TOOL_CALL_PARSER", default_value = "auto")]
    pub tool_call_parser: String,
    /// Responses kept for `previous_response_id` (0: none are stored).
    #[arg(long, env = "TANDEM_RESPONSES_STORE_MAX", default_value_t = 10_000)]
    pub responses_store_max: usize,
    /// Bytes the stored responses may take at most.
    #[arg(long, env = "TANDEM_RESPONSES_STORE_MAX_BYTES", default_value_t = 256 << 20)]
    pub responses_store_max_bytes: usize,
    /// The body field naming a request's session, besides `x-session-id` and
    /// `tandem.session_id`: `user` (OpenAI's `user`, Anthropic's `metadata.user_id`), another
    /// top-level field's name, or `none`.
    #[arg(long, env = "TANDEM_SESSION_FIELD", default_value = "user")]
    pub session_field: String,
    /// Backend groups (a TOML file): model names served by groups of endpoints and this
    /// cluster's pool in priority order, with spillover, cooldowns and limits (README,
    /// "Backend groups"); read again when it changes.
    #[arg(long = "groups", env = "TANDEM_GROUPS")]
    pub groups_file: Option<PathBuf>,
    #[command(flatten)]
    pub semantic_cache: crate::args::semantic_cache::SemanticCacheArgs,
    /// Threads that serve the HTTP connections, each with its own single-threaded runtime:
    /// a connection stays on one, so a request runs on one thread from end to end (fewer
    /// wake-ups than the shared runtime's work stealing). 0: the shared runtime serves them.
    /// Default: one per CPU in `tandem frontend` (the sidecars of --backend-url keep a
    /// connection pool per thread, the gRPC clients of workers and indexer a channel per
    /// thread); 0 in `tandem up`'s own process (its in-process workers' engines run on the
    /// shared runtime, and handing every call over to them cost more than the threads save).
    /// TLS connections are served by the shared runtime.
    #[arg(long, env = "TANDEM_SERVING_THREADS")]
    pub serving_threads: Option<usize>,
}

impl HttpArgs {
    /// `--tokenizer`'s default; `tandem up --model PATH.gguf` replaces it with the file's own.
    pub const DEFAULT_TOKENIZER: &'static str = "cl100k_base";
    /// `--model`'s default: a served name for the mocker.
    pub const DEFAULT_MODEL: &'static str = "mocker";

    /// These flags as a `tandem frontend` process takes them (`tandem up --processes`): every
    /// field, so the child serves exactly as the in-process frontend would (src/up.rs tests).
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--model={}", self.model),
            format!("--tokenizer={}", self.tokenizer),
            format!("--context-length={}", self.context_length),
            format!("--drain-timeout-s={}", self.drain_timeout_s),
            format!("--tool-call-parser={}", self.tool_call_parser),
            format!("--responses-store-max={}", self.responses_store_max),
            format!(
                "--responses-store-max-bytes={}",
                self.responses_store_max_bytes
            ),
            format!("--session-field={}", self.session_field),
        ];
        if !self.lora_adapters.is_empty() {
            a.push(format!("--lora-adapters={}", self.lora_adapters.join(",")));
        }
        if let Some(path) = &self.chat_template {
            a.push(format!("--chat-template={}", path.display()));
        }
        if let Some(name) = &self.chat_template_name {
            a.push(format!("--chat-template-name={name}"));
        }
        if let Some(path) = &self.groups_file {
            a.push(format!("--groups={}", path.display()));
        }
        a.extend(self.semantic_cache.to_args());
        if let Some(n) = self.serving_threads {
            a.push(format!("--serving-threads={n}"));
        }
        a
    }
}

/// `tandem frontend`.
#[derive(Args, Debug, Clone)]
pub struct FrontendArgs {
    #[command(flatten)]
    pub plane: PlaneArgs,
    #[command(flatten)]
    pub routing: crate::args::routing::RoutingArgs,
    #[command(flatten)]
    pub http: HttpArgs,
    /// HTTP listen address (or --host and --port).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "0.0.0.0:8000")]
    pub listen: String,
    #[command(flatten)]
    pub host_port: crate::args::listen::HostPort,
    /// Tokens per KV block (must match the workers').
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// A standalone `tandem indexer` to ask instead of an embedded index.
    #[arg(long, env = "TANDEM_INDEXER_URL")]
    pub indexer_url: Option<String>,
    /// Share active-sequence deltas with other frontend replicas.
    #[arg(long, env = "TANDEM_REPLICA_SYNC", default_value_t = true, action = ArgAction::Set)]
    pub replica_sync: bool,
    #[command(flatten)]
    pub backends: crate::backends::BackendArgs,
    #[command(flatten)]
    pub flow: crate::args::flow::FlowArgs,
    /// API keys (tenants) and TLS on the HTTP listener.
    #[command(flatten)]
    pub access: crate::access::AccessArgs,
}

/// A frontend's config from its flags.
pub fn frontend_config(
    namespace: &str,
    routing: &crate::args::routing::RoutingArgs,
    http: &HttpArgs,
    block_size: u32,
    indexer_url: Option<String>,
    replica_sync: bool,
) -> anyhow::Result<FrontendConfig> {
    let mut backend = BackendConfig::new(RouterId(random_id()));
    backend.routing = routing.config()?;
    backend.indexer_url = indexer_url;
    backend.replica_sync = replica_sync;
    let tokenizer: TokenizerSpec = http.tokenizer.parse().context("--tokenizer")?;
    Ok(FrontendConfig {
        view: ViewConfig {
            namespace: namespace.to_string(),
            model: Some(http.model.clone()),
            block_size: BlockSize::new(block_size).context("--block-size")?,
            connect_timeout: Duration::from_secs(2),
            embedded_index: true,
        },
        http: HttpConfig {
            served_model_name: http.model.clone(),
            // `a,,b` or a trailing comma names no adapter; HttpState checks the rest.
            lora_adapters: http
                .lora_adapters
                .iter()
                .map(|a| a.trim())
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect(),
            context_length: http.context_length,
            chat_template: chat_template(http, &tokenizer),
            tool_call_parser: http
                .tool_call_parser
                .parse()
                .map_err(|e| anyhow::anyhow!("--tool-call-parser: {e}"))?,
            responses_store: ResponsesStoreConfig {
                max_responses: http.responses_store_max,
                max_bytes: http.responses_store_max_bytes,
            },
            session_field: http.session_field.parse().unwrap_or_default(),
            semantic_cache: http.semantic_cache.config()?,
            serving_threads: http.serving_threads.unwrap_or(0),
            ..Default::default()
        },
        tokenizer,
        backend,
        drain_timeout: Duration::from_secs(http.drain_timeout_s),
        groups: http.groups_file.clone().map(|file| {
            // The binary is where the environment is read: the keys `api_key_env` names.
            #[allow(clippy::disallowed_methods)]
            let env: EnvLookup = Arc::new(|name: &str| std::env::var(name).ok());
            GroupsOptions::new(file, env)
        }),
    })
}

/// The chat template the flags name; the tokenizer_config.json beside a Hugging Face
/// tokenizer.json when none is named.
fn chat_template(http: &HttpArgs, tokenizer: &TokenizerSpec) -> ChatTemplateSpec {
    let beside = match tokenizer {
        TokenizerSpec::HuggingFace(path) => ChatTemplateSpec::tokenizer_config_beside(path),
        TokenizerSpec::Tiktoken(_) => None,
        TokenizerSpec::Gguf(path) if http.chat_template.is_none() => {
            return ChatTemplateSpec::Gguf { path: path.clone() };
        }
        TokenizerSpec::Gguf(_) => None,
    };
    ChatTemplateSpec::from_flags(
        http.chat_template.as_deref(),
        http.chat_template_name.as_deref(),
        beside.as_deref(),
    )
}

/// `tandem indexer`.
#[derive(Args, Debug, Clone)]
pub struct IndexerArgs {
    #[command(flatten)]
    pub plane: PlaneArgs,
    /// gRPC listen address (or --host and --port).
    #[arg(long, env = "TANDEM_LISTEN", default_value = "0.0.0.0:7000")]
    pub listen: String,
    #[command(flatten)]
    pub host_port: crate::args::listen::HostPort,
    /// Tokens per KV block (must match the workers').
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
}

async fn bind(addr: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

/// The process's shutdown: drained on SIGTERM or SIGINT, stopped on a second one.
fn shutdown_on_signals() -> Shutdown {
    let root = Shutdown::new();
    tandem_runtime::shutdown::shutdown_on_signals(root.clone());
    root
}

impl WorkerArgs {
    /// The sidecar's config, when the engine is external.
    pub fn sidecar_config(&self, role: WorkerRole) -> anyhow::Result<Option<SidecarConfig>> {
        let x = &self.external;
        if x.engine == "mocker" || x.engine == "native" {
            if x.engine_url.is_some() || x.engine_kv_events.is_some() {
                anyhow::bail!(
                    "--engine-url and --engine-kv-events need --engine vllm|sglang|openai"
                );
            }
            return Ok(None);
        }
        let kind: EngineKind = x.engine.parse().map_err(|e: String| anyhow::anyhow!(e))?;
        let url = x
            .engine_url
            .as_deref()
            .with_context(|| format!("--engine {} needs --engine-url", x.engine))?;
        let id = WorkerId(self.worker_id.unwrap_or_else(random_id));
        let mut c = SidecarConfig::new(id, role, kind, url);
        c.model = self.model.clone();
        c.engine_model = x.engine_model.clone();
        c.namespace = self.plane.namespace.clone();
        c.advertise_host = self.advertise_host.clone();
        c.rack = self.topology_rack.clone();
        c.kv_events = x.engine_kv_events.clone();
        c.kv_replay = x.engine_kv_replay.clone();
        c.kv_topic = x.engine_kv_topic.clone();
        c.block_size = Some(self.engine.block_size);
        c.device_blocks = Some(u64::from(self.engine.device_blocks));
        c.host_blocks = Some(u64::from(self.engine.host_blocks));
        c.incremental_output = x.engine_incremental_output;
        c.bootstrap_host = x.engine_bootstrap_host.clone();
        c.bootstrap_port = x.engine_bootstrap_port;
        c.engine_advertise = x.engine_advertise.clone();
        c.load_interval = Duration::from_millis(self.load_interval_ms);
        c.health_interval = Duration::from_millis(x.engine_health_interval_ms.max(10));
        c.health_failures = x.engine_health_failures.max(1);
        c.startup_timeout = Duration::from_secs(x.engine_startup_timeout_s);
        c.drain_timeout = Duration::from_secs(self.drain_timeout_s);
        c.prefill_timeout = Duration::from_millis(self.prefill_timeout_ms.unwrap_or(5000));
        Ok(Some(c))
    }
}

pub async fn run_worker(args: WorkerArgs, role: WorkerRole) -> anyhow::Result<()> {
    let service = match role {
        WorkerRole::Prefill => "tandem-prefill",
        _ => "tandem-decode",
    };
    let _telemetry = args
        .plane
        .init_telemetry(service, args.worker_id.map(|id| id.to_string()))?;
    if let Some(cfg) = args.sidecar_config(role)? {
        anyhow::ensure!(
            args.metrics_addr.is_none(),
            "--metrics-addr serves the metrics of tandem's own engine: in front of an external \
             engine, scrape the engine's own /metrics"
        );
        let listener = bind(&args.host_port.resolve(&args.listen)?).await?;
        let deps = args
            .plane
            .connect(&format!("{role:?}-{}", cfg.worker_id.0))
            .await?;
        tandem_external::sidecar::run(
            cfg,
            listener,
            deps.discovery,
            deps.events,
            shutdown_on_signals(),
        )
        .await?;
        return Ok(());
    }
    let mut cfg = args.config(role)?;
    if args.external.engine == "native" {
        let model = crate::model_file::ModelFile::from_flag(&args.model, &args.model_cache)
            .await?
            .with_context(|| {
                format!(
                    "--engine native computes a GGUF model: --model must be a path to a .gguf \
                     file or a named model ({}), got {:?}",
                    crate::models::names(),
                    args.model
                )
            })?;
        model.configure(
            &mut cfg,
            &args.engine.native(),
            crate::model_file::available_cores(),
        )?;
        if let Some(ms) = args.prefill_timeout_ms {
            cfg.prefill_timeout = Duration::from_millis(ms);
        }
    }
    let listener = bind(&args.host_port.resolve(&args.listen)?).await?;
    let deps = args
        .plane
        .connect(&format!("{role:?}-{}", cfg.worker_id.0))
        .await?;
    let events: Arc<dyn EventPlane> = match &args.inject_kv_event_faults {
        Some(spec) => {
            let faults: tandem_runtime::events::EventFaults = spec
                .parse()
                .map_err(|e: String| anyhow::anyhow!("--inject-kv-event-faults: {e}"))?;
            tracing::warn!(?faults, "injecting faults into this worker's KV events");
            Arc::new(tandem_runtime::events::FaultyEventPlane::new(
                deps.events,
                faults,
                &[".kv-events"],
            ))
        }
        None => deps.events,
    };
    let deps = WorkerDeps {
        discovery: deps.discovery,
        events,
        transport: args.kv.open().await?,
    };
    let shutdown = shutdown_on_signals();
    match role {
        WorkerRole::Prefill => tandem_prefill_worker::run(cfg, listener, deps, shutdown).await?,
        _ => tandem_decode_worker::run(cfg, listener, deps, shutdown).await?,
    }
    Ok(())
}

pub async fn run_frontend(args: FrontendArgs) -> anyhow::Result<()> {
    let _telemetry = args.plane.init_telemetry("tandem-frontend", None)?;
    let mut cfg = frontend_config(
        &args.plane.namespace,
        &args.routing,
        &args.http,
        args.block_size,
        args.indexer_url.clone(),
        args.replica_sync,
    )?;
    args.flow.apply(&mut cfg)?;
    // Both modes below (workers, --backend-url) serve HTTP with this config.
    args.access.apply(&mut cfg.http)?;
    let public = args.host_port.resolve(&args.listen)?;
    let admin = crate::args::listen::admin_addr(args.access.admin_listen.as_deref(), &public)?;
    let listener = bind(&public).await?;
    let admin = match admin {
        Some(addr) => Some(bind(&addr).await?),
        None => None,
    };
    // Every call a request makes stays on its thread (the sidecars keep a connection pool per
    // thread, the workers' and the indexer's gRPC clients a channel per thread): serve on
    // threads of their own.
    cfg.http.serving_threads = args
        .http
        .serving_threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZero::get));
    if args.backends.is_set() {
        // The sidecars' events stay in this process, and so would router sync: no other
        // replica could hear it.
        cfg.backend.replica_sync = false;
        let sidecars = args.backends.sidecars(&args.http.model, args.block_size)?;
        return crate::backends::run(cfg, sidecars, listener, admin, shutdown_on_signals()).await;
    }
    let deps = args.plane.connect("frontend").await?;
    tandem_frontend::run_frontend(cfg, listener, admin, deps, shutdown_on_signals()).await?;
    Ok(())
}

pub async fn run_indexer(args: IndexerArgs) -> anyhow::Result<()> {
    let _telemetry = args.plane.init_telemetry("tandem-indexer", None)?;
    let listener = bind(&args.host_port.resolve(&args.listen)?).await?;
    let deps = args.plane.connect("indexer").await?;
    let cfg = ViewConfig {
        namespace: args.plane.namespace.clone(),
        model: None,
        block_size: BlockSize::new(args.block_size).context("--block-size")?,
        connect_timeout: Duration::from_secs(2),
        embedded_index: true,
    };
    tandem_frontend::run_indexer(cfg, listener, deps, shutdown_on_signals()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{EngineArgs, HttpArgs, frontend_config};
    use crate::args::routing::RoutingArgs;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
        #[command(flatten)]
        http: HttpArgs,
        #[command(flatten)]
        routing: RoutingArgs,
    }

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn lora_flags_reach_the_engine_and_the_frontend() {
        let engine = |cli: &Cli| {
            let (role, id) = (
                tandem_protocol::WorkerRole::Decode,
                tandem_protocol::WorkerId(1),
            );
            cli.engine.config(role, id, "m", "ns")
        };
        let adapters = |cli: &Cli| {
            let f = frontend_config("ns", &cli.routing, &cli.http, 16, None, false).unwrap();
            f.http.lora_adapters
        };
        let cli = parse(&[
            "--max-loras=2",
            "--adapter-load-ms=7.5",
            "--lora-adapters= sql-lora ,chat-lora,",
        ]);
        let w = engine(&cli).unwrap();
        assert_eq!(w.engine.scheduler.max_loras, 2);
        assert_eq!(w.engine.mocker.adapter_load_ms, 7.5);
        assert_eq!(adapters(&cli), ["sql-lora", "chat-lora"]);
        // Defaults: no adapter limit, none served.
        let cli = parse(&[]);
        let w = engine(&cli).unwrap();
        assert_eq!(w.engine.scheduler.max_loras, 0);
        assert_eq!(w.engine.mocker.adapter_load_ms, 20.0);
        assert!(adapters(&cli).is_empty());
        let e = engine(&parse(&["--adapter-load-ms=-1"])).unwrap_err();
        assert!(e.to_string().contains("--adapter-load-ms"), "{e}");
    }
}
