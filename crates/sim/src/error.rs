//! [`SimError`]: why a simulation could not run.

use tandem_engine::EngineError;
use tandem_workload::TraceError;

/// Errors of `tandem sim`. Bad flags and bad input files are the caller's to fix
/// ([`SimError::InvalidConfig`], [`SimError::Trace`]); the rest are broken contracts between
/// the simulator and the crates it drives.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid simulation config: {0}")]
    InvalidConfig(String),
    #[error("trace: {0}")]
    Trace(#[from] TraceError),
    #[error("the workload has no requests")]
    EmptyWorkload,
    #[error("engine: {0}")]
    Engine(#[from] EngineError),
    #[error("router: {0}")]
    Route(#[from] tandem_router::RouteError),
    #[error("router config: {0}")]
    RouterConfig(#[from] tandem_router::ConfigError),
    #[error("index: {0}")]
    Index(#[from] tandem_indexer::IndexError),
    #[error("index feed: {0}")]
    Feed(#[from] tandem_router::FeedError),
    #[error("internal: {0}")]
    Internal(String),
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl SimError {
    /// Whether the caller's input is at fault (a flag or a file), not the simulator.
    pub fn is_invalid_input(&self) -> bool {
        matches!(
            self,
            SimError::InvalidConfig(_) | SimError::Trace(_) | SimError::EmptyWorkload
        )
    }
}
