//! The crate's error type and its classification.

use std::time::Duration;

pub use tandem_protocol::ErrorClass;

/// Boxed source error for client libraries whose error types are generic.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What went wrong in our etcd client (`discovery/etcd/client.rs`).
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    /// Our side asked for something impossible: no endpoints, an endpoint that is no URI, an
    /// `https://` endpoint (this build has no TLS).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The connection to an endpoint could not be opened (the last endpoint tried, when all
    /// failed; the others are logged at debug).
    #[error("cannot connect to {endpoint}: {}", chain(.source))]
    Connect {
        endpoint: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// Connecting to an endpoint (and authenticating there) took longer than the connect timeout.
    #[error("connecting to {endpoint} timed out after {after:?}")]
    ConnectTimeout { endpoint: String, after: Duration },
    /// etcd refused `Auth.Authenticate` (wrong password, unknown user, auth not enabled...).
    #[error("authentication as {user:?} refused: {:?}: {}", .source.code(), .source.message())]
    Authenticate {
        user: String,
        #[source]
        source: tonic::Status,
    },
    /// A call ended with a gRPC error status, from etcd or from the transport under it.
    #[error("{:?}: {}", .0.code(), .0.message())]
    Status(#[source] tonic::Status),
    /// A stream ended, or its request side is gone.
    #[error("{0} closed")]
    Closed(&'static str),
    /// etcd answered a keep-alive with TTL 0: it no longer has the lease.
    #[error("lease {0} expired or unknown to etcd")]
    LeaseExpired(i64),
    /// etcd sent something we cannot use (e.g. a token that is no valid gRPC metadata).
    #[error("unusable answer: {0}")]
    Protocol(String),
}

/// `error: its source: its source...`, for errors whose own message is vague ("transport error").
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut next = error.source();
    while let Some(source) = next {
        text.push_str(": ");
        text.push_str(&source.to_string());
        next = source.source();
    }
    text
}

/// Everything that can go wrong in tandem-runtime.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// A configuration value is invalid (empty endpoint list, bad namespace, bad filter...).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A call was made with arguments the operation cannot accept.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// An etcd call failed.
    #[error("etcd {op} failed: {source}")]
    Etcd {
        op: &'static str,
        #[source]
        source: EtcdError,
    },
    /// A NATS call failed.
    #[error("nats {op} failed: {source}")]
    Nats {
        op: &'static str,
        #[source]
        source: BoxError,
    },
    /// A gRPC transport operation failed (bind, serve, connect).
    #[error("grpc transport {op} failed: {source}")]
    Transport {
        op: &'static str,
        #[source]
        source: tonic::transport::Error,
    },
    /// An operation did not finish within its deadline.
    #[error("{op} timed out after {after:?}")]
    Timeout { op: &'static str, after: Duration },
    /// A bounded buffer is full.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// A value read from discovery could not be decoded.
    #[error("malformed worker record at {key}: {source}")]
    Decode {
        key: String,
        #[source]
        source: serde_json::Error,
    },
    /// A value could not be encoded.
    #[error("encoding failed: {0}")]
    Encode(#[source] serde_json::Error),
    /// An external binary (etcd, nats-server) is not installed.
    #[error("`{binary}` not found on PATH (Debian package `{package}`)")]
    MissingBinary {
        binary: String,
        package: &'static str,
    },
    /// An external server process did not become ready.
    #[error("{what} failed to start: {detail}")]
    StartFailed { what: &'static str, detail: String },
    /// The operation was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// The other side of an in-process channel has gone away.
    #[error("closed: {0}")]
    Closed(&'static str),
    /// An I/O error (process spawn, files, sockets).
    #[error("i/o error during {op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

impl RuntimeError {
    /// The class of this error: the one place that decides how callers react to it.
    pub fn class(&self) -> ErrorClass {
        match self {
            RuntimeError::Config(_) | RuntimeError::InvalidRequest(_) => ErrorClass::InvalidRequest,
            RuntimeError::Overloaded(_) => ErrorClass::Overloaded,
            RuntimeError::Etcd { source, .. } => match source {
                EtcdError::InvalidArgument(_) => ErrorClass::InvalidRequest,
                EtcdError::Connect { .. }
                | EtcdError::ConnectTimeout { .. }
                | EtcdError::Authenticate { .. }
                | EtcdError::Status(_)
                | EtcdError::Closed(_)
                | EtcdError::LeaseExpired(_)
                | EtcdError::Protocol(_) => ErrorClass::Unavailable,
            },
            RuntimeError::Nats { .. }
            | RuntimeError::Transport { .. }
            | RuntimeError::Timeout { .. }
            | RuntimeError::Closed(_) => ErrorClass::Unavailable,
            RuntimeError::Cancelled => ErrorClass::Cancelled,
            RuntimeError::Decode { .. }
            | RuntimeError::Encode(_)
            | RuntimeError::MissingBinary { .. }
            | RuntimeError::StartFailed { .. }
            | RuntimeError::Io { .. } => ErrorClass::Internal,
        }
    }

    pub(crate) fn etcd(op: &'static str) -> impl FnOnce(EtcdError) -> RuntimeError {
        move |source| RuntimeError::Etcd { op, source }
    }

    pub(crate) fn nats<E>(op: &'static str) -> impl FnOnce(E) -> RuntimeError
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        move |source| RuntimeError::Nats {
            op,
            source: Box::new(source),
        }
    }

    pub(crate) fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> RuntimeError {
        move |source| RuntimeError::Io { op, source }
    }
}

/// Runs `fut` with a deadline, mapping expiry to [`RuntimeError::Timeout`].
pub(crate) async fn with_timeout<T, F>(
    op: &'static str,
    after: Duration,
    fut: F,
) -> Result<T, RuntimeError>
where
    F: std::future::Future<Output = Result<T, RuntimeError>>,
{
    match tokio::time::timeout(after, fut).await {
        Ok(result) => result,
        Err(_) => Err(RuntimeError::Timeout { op, after }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(
            RuntimeError::Config("x".into()).class(),
            ErrorClass::InvalidRequest
        );
        assert_eq!(
            RuntimeError::Timeout {
                op: "put",
                after: Duration::from_secs(1)
            }
            .class(),
            ErrorClass::Unavailable
        );
        assert_eq!(RuntimeError::Cancelled.class(), ErrorClass::Cancelled);
        let missing = RuntimeError::MissingBinary {
            binary: "etcd".into(),
            package: "etcd-server",
        };
        assert_eq!(missing.class(), ErrorClass::Internal);
        assert!(missing.to_string().contains("etcd-server"));
    }

    #[test]
    fn etcd_classes() {
        let bad = RuntimeError::etcd("connect")(EtcdError::InvalidArgument("no endpoints".into()));
        assert_eq!(bad.class(), ErrorClass::InvalidRequest);
        let status = tonic::Status::unavailable("etcdserver: no leader");
        let down = RuntimeError::etcd("put")(EtcdError::Status(status));
        assert_eq!(down.class(), ErrorClass::Unavailable);
        assert_eq!(
            down.to_string(),
            "etcd put failed: Unavailable: etcdserver: no leader"
        );
        let expired = RuntimeError::etcd("keep-alive")(EtcdError::LeaseExpired(7));
        assert_eq!(expired.class(), ErrorClass::Unavailable);
    }
}
