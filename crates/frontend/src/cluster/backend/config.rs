//! [`BackendConfig`]: how the cluster backend routes, retries, hedges and queues.

use std::time::Duration;

use tandem_router::{FlowConfig, ReplicaConfig, RouterId, RoutingConfig};

/// How the backend routes.
#[derive(Clone, Debug)]
pub struct BackendConfig {
    /// How requests are routed: the same type `tandem sim` takes.
    pub routing: RoutingConfig,
    /// This replica's id among the frontends sharing one view.
    pub router_id: RouterId,
    /// Share tracker changes with peer replicas over the event plane.
    pub replica_sync: bool,
    /// Standalone indexer (`tandem indexer`) address; None: the view's embedded index.
    pub indexer_url: Option<String>,
    /// Decode workers tried per request before giving up.
    pub max_attempts: u32,
    /// Times a request may move to another decode worker after its first token, when its
    /// worker fails mid-stream.
    pub max_migrations: u32,
    pub connect_timeout: Duration,
    pub seed: u64,
    /// The frontend's queue: its bound, bands, fairness and default tenant limits. When a
    /// worker is saturated is the routing's [`RoutingConfig::saturation`].
    pub flow: FlowConfig,
    /// The first retry's backoff ceiling (doubled per retry, full jitter).
    pub retry_backoff: Duration,
    pub retry_backoff_max: Duration,
    /// Hedged requests (off: None).
    pub hedge: Option<HedgeConfig>,
    /// Concurrent requests per session at most (None: no cap); see `cluster/sessions.rs`.
    pub session_cap: Option<u32>,
}

/// When a request without a first token is started on a second worker.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HedgeConfig {
    /// The quantile of recent TTFTs (of requests of the same size class) to wait for.
    pub quantile: f64,
    /// Never hedge sooner than this.
    pub min_delay_ms: u64,
    /// TTFTs of a size class needed before its requests are hedged.
    pub min_samples: usize,
}

impl Default for HedgeConfig {
    fn default() -> Self {
        HedgeConfig {
            quantile: 0.95,
            min_delay_ms: 50,
            min_samples: 20,
        }
    }
}

impl BackendConfig {
    pub fn new(router_id: RouterId) -> Self {
        BackendConfig {
            routing: RoutingConfig::default(),
            router_id,
            replica_sync: true,
            indexer_url: None,
            max_attempts: 3,
            max_migrations: 3,
            connect_timeout: Duration::from_secs(2),
            seed: router_id.0,
            flow: FlowConfig::default(),
            retry_backoff: Duration::from_millis(25),
            retry_backoff_max: Duration::from_secs(1),
            hedge: None,
            session_cap: None,
        }
    }

    /// The routing replica this configuration describes: what [`crate::run_frontend`] routes
    /// with.
    pub fn replica_config(&self) -> ReplicaConfig {
        ReplicaConfig {
            router_id: self.router_id,
            seed: self.seed,
            routing: self.routing,
        }
    }
}
