//! `--backend-url`: the frontend in front of OpenAI-compatible servers directly, with no
//! worker processes and no etcd or NATS, as SGLang's gateway and vLLM's router are used.
//!
//! Each URL gets an in-process sidecar (the same code as `tandem decode --engine …`: health
//! checks that take a failing server out of the pool, load from its metrics, its KV events
//! when `--backend-kv-events` names its publisher) registered in in-memory discovery, so the
//! routing is the frontend's own. A server without KV events is routed on approximate KV: the
//! router remembers where it sent each prompt, for a TTL.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use tandem_external::{EngineKind, SidecarConfig, sidecar};
use tandem_protocol::{WorkerId, WorkerRole};
use tandem_runtime::discovery::MemoryDiscovery;
use tandem_runtime::events::MemoryEventPlane;
use tandem_runtime::shutdown::Shutdown;
use tokio::net::TcpListener;

/// Backends the frontend routes to directly.
#[derive(Args, Debug, Clone, Default)]
pub struct BackendArgs {
    /// An OpenAI-compatible server to route to directly (repeat for each); no workers, etcd
    /// or NATS are used then.
    #[arg(
        long = "backend-url",
        env = "TANDEM_BACKEND_URLS",
        value_delimiter = ','
    )]
    pub urls: Vec<String>,
    /// The backends' API: openai (vLLM-style completions with `return_token_ids`), vllm, or
    /// sglang (its native /generate).
    #[arg(long, env = "TANDEM_BACKEND_ENGINE", default_value = "openai")]
    pub backend_engine: String,
    /// The backends' ZMQ KV event publishers, in the order of --backend-url ("" for one
    /// without); without them routing uses approximate KV.
    #[arg(
        long = "backend-kv-events",
        env = "TANDEM_BACKEND_KV_EVENTS",
        value_delimiter = ','
    )]
    pub kv_events: Vec<String>,
    /// Their ZMQ replay sockets, likewise.
    #[arg(
        long = "backend-kv-replay",
        env = "TANDEM_BACKEND_KV_REPLAY",
        value_delimiter = ','
    )]
    pub kv_replay: Vec<String>,
    /// Milliseconds between the backends' health checks.
    #[arg(
        long,
        env = "TANDEM_BACKEND_HEALTH_INTERVAL_MS",
        default_value_t = 1000
    )]
    pub backend_health_interval_ms: u64,
    /// Failed health checks in a row before a backend leaves the pool.
    #[arg(long, env = "TANDEM_BACKEND_HEALTH_FAILURES", default_value_t = 3)]
    pub backend_health_failures: u32,
}

impl BackendArgs {
    pub fn is_set(&self) -> bool {
        !self.urls.is_empty()
    }

    /// One sidecar config per backend.
    pub fn sidecars(&self, model: &str, block_size: u32) -> anyhow::Result<Vec<SidecarConfig>> {
        let kind: EngineKind = self
            .backend_engine
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--backend-engine: {e}"))?;
        if self.kv_events.len() > self.urls.len() || self.kv_replay.len() > self.urls.len() {
            anyhow::bail!("more --backend-kv-events / --backend-kv-replay than --backend-url");
        }
        let nonempty = |v: Option<&String>| v.filter(|s| !s.is_empty()).cloned();
        self.urls
            .iter()
            .enumerate()
            .map(|(i, url)| {
                let mut c =
                    SidecarConfig::new(WorkerId(i as u64 + 1), WorkerRole::Decode, kind, url);
                c.model = model.to_string();
                c.kv_events = nonempty(self.kv_events.get(i));
                c.kv_replay = nonempty(self.kv_replay.get(i));
                c.block_size = Some(block_size);
                c.health_interval = Duration::from_millis(self.backend_health_interval_ms.max(10));
                c.health_failures = self.backend_health_failures.max(1);
                // A backend that is not up yet joins when it answers; others serve meanwhile.
                c.startup_timeout = Duration::from_secs(24 * 3600);
                c.load_interval = Duration::from_millis(250);
                Ok(c)
            })
            .collect()
    }
}

/// Runs the frontend `cfg` on `listener` (its operator's surfaces on `admin`) in front of
/// `backends`, until `root` stops.
pub async fn run(
    cfg: tandem_frontend::FrontendConfig,
    sidecars: Vec<SidecarConfig>,
    listener: TcpListener,
    admin: Option<TcpListener>,
    root: Shutdown,
) -> anyhow::Result<()> {
    let discovery = Arc::new(MemoryDiscovery::new());
    let events = Arc::new(MemoryEventPlane::new());
    // The sidecars drain once the frontend has.
    let stop = root.under();
    let mut tasks = tokio::task::JoinSet::new();
    for c in sidecars {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("binding a backend's loopback listener")?;
        let (d, e, s) = (discovery.clone(), events.clone(), stop.clone());
        let url = c.engine_url.clone();
        tasks.spawn(async move {
            if let Err(e) = sidecar::run(c, listener, d, e, s).await {
                tracing::error!(%url, error = %e, "backend stopped");
            }
        });
    }
    let cluster = tandem_frontend::ClusterDeps { discovery, events };
    let served = tandem_frontend::run_frontend(cfg, listener, admin, cluster, root.child()).await;
    stop.drain();
    while tasks.join_next().await.is_some() {}
    served?;
    Ok(())
}
