//! [`WorkloadError`]: why a workload could not be made, or a figure not drawn.

use crate::trace::TraceError;

/// Errors of this crate. All but [`WorkloadError::Plot`] and [`WorkloadError::Io`] are the
/// caller's input to fix (a flag, a trace file); see [`WorkloadError::is_invalid_input`].
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A field of a [`crate::WorkloadConfig`] or a [`crate::Slo`] out of range; the message
    /// names the flag.
    #[error("{0}")]
    InvalidConfig(String),
    #[error("trace: {0}")]
    Trace(#[from] TraceError),
    #[error("the workload has no requests")]
    Empty,
    /// The plotting library refused to draw (a broken contract: it draws into a string).
    #[error("plot: {0}")]
    Plot(String),
    /// An output file could not be written.
    #[error("writing {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl WorkloadError {
    /// Whether the caller's input is at fault (a flag or a file), not this crate.
    pub fn is_invalid_input(&self) -> bool {
        !matches!(self, WorkloadError::Plot(_) | WorkloadError::Io { .. })
    }
}
