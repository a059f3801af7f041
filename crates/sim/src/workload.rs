//! The requests of a run come from `tandem-workload` ([`build`]: trace or synthetic, arrivals,
//! prompts expanded at arrival); this module names them for the simulator and maps that
//! crate's errors onto [`SimError`] with their messages unchanged.

use tandem_workload::WorkloadError;
pub use tandem_workload::{PromptSpec, RequestSpec, build};

use crate::error::SimError;

impl From<WorkloadError> for SimError {
    fn from(e: WorkloadError) -> Self {
        match e {
            WorkloadError::InvalidConfig(what) => SimError::InvalidConfig(what),
            WorkloadError::Trace(e) => SimError::Trace(e),
            WorkloadError::Empty => SimError::EmptyWorkload,
            WorkloadError::Plot(what) => SimError::Internal(format!("plot: {what}")),
            WorkloadError::Io { path, source } => SimError::Io { path, source },
        }
    }
}
