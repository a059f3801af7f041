//! The worker's typed errors and their one mapping to gRPC status codes.

use tonic::{Code, Status};

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

impl From<WorkerError> for Status {
    /// `Unavailable` and `ResourceExhausted` tell the frontend to try another worker;
    /// `InvalidArgument` and `AlreadyExists` that no worker would take the request.
    fn from(e: WorkerError) -> Status {
        let code = match &e {
            WorkerError::InvalidRequest(_) => Code::InvalidArgument,
            WorkerError::DuplicateRequest(_) => Code::AlreadyExists,
            WorkerError::Overloaded(_) => Code::ResourceExhausted,
            WorkerError::Draining | WorkerError::Runtime(_) => Code::Unavailable,
            WorkerError::BadTransfer(_) | WorkerError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
