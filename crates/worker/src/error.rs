//! The worker's typed errors, their class, and through it their gRPC status.

use tandem_protocol::ErrorClass;
use tonic::Status;

/// Why a worker refused or failed a request.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("request {0} already exists on this worker")]
    DuplicateRequest(u64),
    #[error("overloaded: {0}")]
    Overloaded(String),
    #[error("worker is draining")]
    Draining,
    #[error("KV transfer failed: {0}")]
    BadTransfer(String),
    #[error("runtime: {0}")]
    Runtime(#[from] tandem_runtime::RuntimeError),
    #[error("internal error: {0}")]
    Internal(String),
}

impl WorkerError {
    /// The class that decides what the frontend does: another worker for `Overloaded`,
    /// `Unavailable` and `Internal` (this worker's trouble), nothing for `InvalidRequest`.
    pub fn class(&self) -> ErrorClass {
        match self {
            WorkerError::InvalidRequest(_) | WorkerError::DuplicateRequest(_) => {
                ErrorClass::InvalidRequest
            }
            WorkerError::Overloaded(_) => ErrorClass::Overloaded,
            // A runtime failure while serving (event plane, discovery) is this worker's, not
            // the request's.
            WorkerError::Draining | WorkerError::Runtime(_) => ErrorClass::Unavailable,
            WorkerError::BadTransfer(_) | WorkerError::Internal(_) => ErrorClass::Internal,
        }
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Status {
        e.class().status(e.to_string())
    }
}
