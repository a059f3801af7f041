//! The crate's error type and its classification.

use std::time::Duration;

pub use tandem_protocol::ErrorClass;

/// Everything that can go wrong in tandem-kv-transfer. `Clone` because one failure of a
/// pipelined write is reported to every later `put` and to the next `flush`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    /// A call was made with arguments the operation cannot accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A block id past the end of a region.
    #[error("block {block} out of range (region has {num_blocks} blocks)")]
    OutOfRange { block: u32, num_blocks: u32 },
    /// A source buffer whose length is not one block.
    #[error("block size mismatch: expected {expected} bytes, got {got}")]
    BlockSize { expected: u64, got: u64 },
    /// A part of a block that does not lie inside one block.
    #[error("part {start}..{end} is not inside a block of {bytes_per_block} bytes")]
    BadPart {
        start: u64,
        end: u64,
        bytes_per_block: u64,
    },
    /// A descriptor that cannot be decoded or does not fit the transport it was given to.
    #[error("bad region descriptor: {0}")]
    BadDescriptor(String),
    /// The transport or memory kind is not available in this build or on this machine.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// CUDA was asked for but no driver (or no device) is present.
    #[error("CUDA unavailable: {0}")]
    CudaUnavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {detail}")]
    Cuda { op: &'static str, detail: String },
    /// The UCX library could not be loaded at run time: `library` is not installed, or lacks
    /// a function the bindings need (`detail` is the loader's `dlerror`, which names the
    /// file itself).
    #[error("UCX not found ({detail})")]
    UcxNotFound {
        library: &'static str,
        detail: String,
    },
    /// The UCX library loaded at run time is older than the API the bindings were generated
    /// from.
    #[error(
        "UCX {found} is too old: tandem's UCX bindings were generated from UCX {required} and \
         need at least that version"
    )]
    UcxTooOld { found: String, required: String },
    /// A UCX call failed (status string from UCX).
    #[error("UCX {op} failed: {detail}")]
    Ucx { op: &'static str, detail: String },
    /// A socket operation failed.
    #[error("i/o error during {op}: {detail}")]
    Io { op: &'static str, detail: String },
    /// The peer closed the connection or was declared dead.
    #[error("peer failed: {0}")]
    PeerFailed(String),
    /// The receiving side rejected a write.
    #[error("rejected by the receiver: {0}")]
    Rejected(String),
    /// An operation did not finish within its deadline.
    #[error("{op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    /// A bounded resource is exhausted.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// The transport has shut down.
    #[error("transport closed")]
    Closed,
    /// The operation was cancelled before it completed.
    #[error("cancelled: {0}")]
    Cancelled(String),
}

impl TransferError {
    /// The class of this error: the one place that decides how callers react to it.
    pub fn class(&self) -> ErrorClass {
        match self {
            TransferError::InvalidArgument(_)
            | TransferError::OutOfRange { .. }
            | TransferError::BlockSize { .. }
            | TransferError::BadPart { .. }
            | TransferError::BadDescriptor(_)
            | TransferError::Unsupported(_) => ErrorClass::InvalidRequest,
            TransferError::Overloaded(_) => ErrorClass::Overloaded,
            TransferError::CudaUnavailable(_)
            | TransferError::UcxNotFound { .. }
            | TransferError::UcxTooOld { .. }
            | TransferError::Ucx { .. }
            | TransferError::Io { .. }
            | TransferError::PeerFailed(_)
            | TransferError::Timeout { .. }
            | TransferError::Closed => ErrorClass::Unavailable,
            TransferError::Cancelled(_) => ErrorClass::Cancelled,
            TransferError::Cuda { .. } | TransferError::Rejected(_) => ErrorClass::Internal,
        }
    }

    pub(crate) fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> TransferError {
        move |e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe => TransferError::PeerFailed(format!("{op}: {e}")),
            _ => TransferError::Io {
                op,
                detail: e.to_string(),
            },
        }
    }
}

/// Runs `fut` with a deadline, mapping expiry to [`TransferError::Timeout`].
pub(crate) async fn with_timeout<T, F>(
    op: &'static str,
    after: Duration,
    fut: F,
) -> Result<T, TransferError>
where
    F: std::future::Future<Output = Result<T, TransferError>>,
{
    match tokio::time::timeout(after, fut).await {
        Ok(r) => r,
        Err(_) => Err(TransferError::Timeout { op, after }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(
            TransferError::OutOfRange {
                block: 9,
                num_blocks: 4
            }
            .class(),
            ErrorClass::InvalidRequest
        );
        assert_eq!(
            TransferError::Timeout {
                op: "flush",
                after: Duration::from_secs(1)
            }
            .class(),
            ErrorClass::Unavailable
        );
        let eof = std::io::Error::from(std::io::ErrorKind::UnexpectedEof);
        assert!(matches!(
            TransferError::io("read")(eof),
            TransferError::PeerFailed(_)
        ));
    }
}
