//! gRPC plumbing for the request plane: serving a tonic router on a listener the caller bound
//! (tests bind `127.0.0.1:0`), opening channels to peers, and calling a peer that this process
//! serves itself without a socket (`local.rs`).

use std::time::Duration;

use futures::StreamExt;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Router;
use tonic::transport::{Channel, Endpoint};

use crate::error::{RuntimeError, with_timeout};

mod local;

pub use local::{
    LocalRegistration, NetTransport, Transport, direct_worker, register_local, transport,
};

/// HTTP/2 ping period on client channels: notices a dead peer under an idle stream.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Serves `router` on connections accepted from `listener` until `shutdown` is cancelled, then
/// stops accepting and waits for open connections to finish their calls (long-lived streams
/// should watch a child of the same token). Accepted sockets get `TCP_NODELAY`.
pub async fn serve_tonic(
    router: Router,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), RuntimeError> {
    let incoming = TcpListenerStream::new(listener).map(|accepted| {
        accepted.inspect(|stream| {
            if let Err(error) = stream.set_nodelay(true) {
                tracing::debug!(%error, "cannot set TCP_NODELAY");
            }
        })
    });
    router
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
        .await
        .map_err(|source| RuntimeError::Transport {
            op: "serve",
            source,
        })
}

/// An endpoint for `addr` (`host:port` or a URL; `http://` is added when no scheme is given),
/// with `timeout` for connecting and for keep-alive pings.
pub fn endpoint(addr: &str, timeout: Duration) -> Result<Endpoint, RuntimeError> {
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let endpoint = Endpoint::from_shared(uri)
        .map_err(|e| RuntimeError::InvalidRequest(format!("bad gRPC address {addr:?}: {e}")))?;
    Ok(endpoint
        .connect_timeout(timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(timeout)
        .keep_alive_while_idle(true))
}

/// Connects to `addr` now, failing after `timeout`. The channel reconnects by itself later.
pub async fn connect_channel(addr: &str, timeout: Duration) -> Result<Channel, RuntimeError> {
    let endpoint = endpoint(addr, timeout)?;
    with_timeout("grpc connect", timeout, async {
        endpoint
            .connect()
            .await
            .map_err(|source| RuntimeError::Transport {
                op: "connect",
                source,
            })
    })
    .await
}

/// A channel to `addr` that connects on first use (calls fail, not this function, while the
/// peer is unreachable).
pub fn lazy_channel(addr: &str, timeout: Duration) -> Result<Channel, RuntimeError> {
    Ok(endpoint(addr, timeout)?.connect_lazy())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Routes;
    use tonic::transport::Server;

    #[tokio::test]
    async fn serve_accepts_connections_and_stops_on_cancel() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let shutdown = CancellationToken::new();
        let router = Server::builder().add_routes(Routes::default());
        let server = tokio::spawn(serve_tonic(router, listener, shutdown.clone()));
        let channel = connect_channel(&addr.to_string(), Duration::from_secs(5))
            .await
            .expect("connect without scheme");
        drop(channel);
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), server)
            .await
            .expect("server stops")
            .expect("no panic")
            .expect("clean stop");
    }

    #[tokio::test]
    async fn connecting_to_nothing_fails_as_unavailable() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let err = connect_channel(&format!("http://127.0.0.1:{port}"), Duration::from_secs(2))
            .await
            .expect_err("nothing listens");
        assert_eq!(err.class(), crate::ErrorClass::Unavailable);
        assert!(lazy_channel("127.0.0.1:1", Duration::from_secs(1)).is_ok());
        let bad = endpoint("http://exa mple:1", Duration::from_secs(1)).expect_err("bad uri");
        assert_eq!(bad.class(), crate::ErrorClass::InvalidRequest);
    }
}
