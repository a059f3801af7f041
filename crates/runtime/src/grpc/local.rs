//! In-process calls: a gRPC service served in this process (the sidecars of `tandem frontend
//! --backend-url`, the workers of `tandem up`) is also registered here under the address it
//! advertises, and a client made with [`transport`] for that address calls the service
//! itself. The call runs the same generated service with the same protobuf encoding, but
//! without a socket, HTTP/2 framing or the wake-ups between a connection's tasks (on the
//! gateway path, the loopback hop cost about as much CPU as the rest of the frontend's work).
//! Any other address gets a [`Channel`] per serving thread ([`NetTransport`]). A worker's
//! `Generate`, the hot path, goes one step further ([`LocalRegistration::with_direct`],
//! [`direct_worker`]): the caller gets the service's own stream, and neither the request nor
//! any chunk is encoded.
//!
//! Stopping mirrors a server's graceful shutdown: once the registration's stop token is
//! cancelled, calls already running finish, and a transport looks the address up again, as a
//! channel reconnects: to a service registered there since (a worker restarted in this
//! process), else over the network (where a closed port answers `UNAVAILABLE`).

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::RwLock;
use tandem_protocol::grpc::DirectWorker;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::transport::Channel;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Service};

use crate::error::RuntimeError;

type LocalService = BoxCloneSyncService<http::Request<Body>, http::Response<Body>, Infallible>;

struct Entry {
    id: u64,
    service: LocalService,
    stop: CancellationToken,
    /// The worker's `Generate` as a plain call, where the service is a worker's.
    direct: Option<Arc<dyn DirectWorker>>,
}

/// The services of this process, by the address they advertise (`host:port`).
static LOCAL: LazyLock<RwLock<HashMap<String, Entry>>> = LazyLock::new(Default::default);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// `host:port` of an address given as `host:port` or as a URL.
fn authority(addr: &str) -> &str {
    let rest = addr.split_once("://").map_or(addr, |(_, rest)| rest);
    rest.trim_end_matches('/')
}

/// Keeps a service reachable in-process until dropped (or until its stop token is cancelled).
#[derive(Debug)]
#[must_use = "the service is reachable in-process only while the registration lives"]
pub struct LocalRegistration {
    key: String,
    id: u64,
}

impl LocalRegistration {
    /// Also offers the service's `Generate` to in-process callers as a plain call
    /// ([`direct_worker`]): no protobuf encoding of the request or of any chunk, the
    /// hot path's last per-token cost between an in-process frontend and its workers.
    pub fn with_direct(self, worker: Arc<dyn DirectWorker>) -> Self {
        if let Some(e) = LOCAL.write().get_mut(&self.key).filter(|e| e.id == self.id) {
            e.direct = Some(worker);
        }
        self
    }
}

/// The `Generate` of the worker serving `addr` in this process, while it serves.
pub fn direct_worker(addr: &str) -> Option<Arc<dyn DirectWorker>> {
    LOCAL
        .read()
        .get(authority(addr))
        .filter(|e| !e.stop.is_cancelled())
        .and_then(|e| e.direct.clone())
}

impl Drop for LocalRegistration {
    fn drop(&mut self) {
        let mut local = LOCAL.write();
        if local.get(&self.key).is_some_and(|e| e.id == self.id) {
            local.remove(&self.key);
        }
    }
}

/// Makes `service` the one clients of `advertised` (`host:port`, as peers are told) in this
/// process call directly, until the registration is dropped or `stop` is cancelled.
pub fn register_local<S>(advertised: &str, service: S, stop: CancellationToken) -> LocalRegistration
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let key = authority(advertised).to_string();
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let entry = Entry {
        id,
        service: BoxCloneSyncService::new(service),
        stop,
        direct: None,
    };
    LOCAL.write().insert(key.clone(), entry);
    LocalRegistration { key, id }
}

/// Where a client's calls go: a connection, or a service of this process.
#[derive(Clone)]
pub enum Transport {
    Net(NetTransport),
    Local {
        service: LocalService,
        stop: CancellationToken,
        /// The address, looked up again once the service stops.
        addr: String,
        timeout: Duration,
    },
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Transport::Net(n) => f.debug_tuple("Net").field(n).finish(),
            Transport::Local { .. } => f.write_str("Local"),
        }
    }
}

impl Transport {
    /// Whether calls stay in this process.
    pub fn is_local(&self) -> bool {
        matches!(self, Transport::Local { .. })
    }
}

/// A transport to `addr` (`host:port` or a URL): the service itself when this process serves
/// it, else a channel that connects on first use (see [`super::lazy_channel`]).
pub fn transport(addr: &str, timeout: Duration) -> Result<Transport, RuntimeError> {
    if let Some(e) = LOCAL.read().get(authority(addr))
        && !e.stop.is_cancelled()
    {
        return Ok(Transport::Local {
            service: e.service.clone(),
            stop: e.stop.clone(),
            addr: addr.to_string(),
            timeout,
        });
    }
    NetTransport::new(addr, timeout).map(Transport::Net)
}

/// Channels per serving thread that a [`NetTransport`] may hold (threads past this share
/// them, modulo).
const THREAD_CHANNELS: usize = 64;

/// Channels to one address: one for code off the serving threads, and one per serving thread
/// (`crate::serving`), made on that thread when it first calls. A channel's tasks (its
/// buffer's worker, the HTTP/2 connection) run on the runtime that made it, so a call from a
/// serving thread over a channel made elsewhere woke another thread for every message each
/// way (on `tandem up --processes`, the frontend's connection task was about a quarter of its
/// CPU, and it made ~10 system calls a request against ~6 on one thread).
#[derive(Clone)]
pub struct NetTransport {
    channels: Arc<NetChannels>,
    /// The channel this clone calls through, chosen where it is first polled.
    chosen: Option<Channel>,
}

struct NetChannels {
    addr: String,
    timeout: Duration,
    /// Off the serving threads: made with the transport, so a bad address fails there.
    shared: Channel,
    threads: Box<[OnceLock<Channel>]>,
}

impl std::fmt::Debug for NetTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetTransport")
            .field("addr", &self.channels.addr)
            .field("chosen", &self.chosen.is_some())
            .finish()
    }
}

impl NetTransport {
    fn new(addr: &str, timeout: Duration) -> Result<NetTransport, RuntimeError> {
        let shared = super::lazy_channel(addr, timeout)?;
        Ok(NetTransport {
            channels: Arc::new(NetChannels {
                addr: addr.to_string(),
                timeout,
                shared,
                threads: (0..THREAD_CHANNELS).map(|_| Default::default()).collect(),
            }),
            chosen: None,
        })
    }

    /// The channel of the thread this runs on (made now if it has none).
    fn channel(&mut self) -> &mut Channel {
        let channels = &self.channels;
        self.chosen
            .get_or_insert_with(|| match crate::serving::serving_index() {
                0 => channels.shared.clone(),
                i => channels.threads[(i - 1) % THREAD_CHANNELS]
                    .get_or_init(|| {
                        // The address made the shared channel: it makes this one too.
                        super::lazy_channel(&channels.addr, channels.timeout)
                            .unwrap_or_else(|_| channels.shared.clone())
                    })
                    .clone(),
            })
    }
}

type ResponseFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<Body>, BoxError>> + Send + 'static>>;

impl Service<http::Request<Body>> for Transport {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        if let Transport::Local {
            stop,
            addr,
            timeout,
            ..
        } = self
            && stop.is_cancelled()
        {
            *self = transport(addr, *timeout)?;
        }
        match self {
            Transport::Net(net) => net.channel().poll_ready(cx).map_err(Into::into),
            Transport::Local { service, .. } => service.poll_ready(cx).map_err(|e| match e {}),
        }
    }

    fn call(&mut self, request: http::Request<Body>) -> ResponseFuture {
        match self {
            Transport::Net(net) => {
                let call = net.channel().call(request);
                Box::pin(async move { call.await.map_err(Into::into) })
            }
            Transport::Local { stop, .. } if stop.is_cancelled() => {
                let status = tonic::Status::unavailable("the service stopped serving");
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
            Transport::Local { service, .. } => {
                let call = service.call(request);
                Box::pin(async move { Ok(call.await.unwrap_or_else(|e| match e {})) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    async fn check(t: Transport) -> Result<i32, tonic::Status> {
        let reply = HealthClient::new(t)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await?;
        Ok(reply.into_inner().status)
    }

    /// A worker whose `Generate` answers one chunk naming the request.
    struct Echo;

    impl DirectWorker for Echo {
        fn generate_direct(
            self: Arc<Self>,
            request: tonic::Request<tandem_protocol::grpc::GenerateRequest>,
        ) -> tonic::codegen::BoxFuture<
            tonic::Response<tandem_protocol::grpc::ChunkStream>,
            tonic::Status,
        > {
            let chunk = tandem_protocol::grpc::GenerateChunk {
                tokens: vec![request.into_inner().request_id as u32],
                ..Default::default()
            };
            Box::pin(async move {
                let s: tandem_protocol::grpc::ChunkStream =
                    Box::pin(futures::stream::iter([Ok(chunk)]));
                Ok(tonic::Response::new(s))
            })
        }
    }

    #[tokio::test]
    async fn a_worker_is_called_directly_while_it_serves() {
        use futures::StreamExt;
        let (_, service) = tonic_health::server::health_reporter();
        let (addr, stop) = ("127.0.0.1:3", CancellationToken::new());
        let registration = register_local(addr, service, stop.clone()).with_direct(Arc::new(Echo));
        let worker = direct_worker(&format!("http://{addr}/")).expect("registered");
        let request = tandem_protocol::grpc::GenerateRequest {
            request_id: 42,
            ..Default::default()
        };
        let mut chunks = worker
            .generate_direct(tonic::Request::new(request))
            .await
            .expect("answered")
            .into_inner();
        assert_eq!(chunks.next().await.unwrap().unwrap().tokens, [42]);
        stop.cancel();
        assert!(direct_worker(addr).is_none(), "stopped: no direct calls");
        drop(registration);
        assert!(direct_worker(addr).is_none());
    }

    /// A health server on loopback that counts the connections it accepts.
    async fn counting_server() -> (String, Arc<AtomicU64>, CancellationToken) {
        use futures::StreamExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let accepted = Arc::new(AtomicU64::new(0));
        let count = accepted.clone();
        let incoming =
            tokio_stream::wrappers::TcpListenerStream::new(listener).inspect(move |_| {
                count.fetch_add(1, Ordering::Relaxed);
            });
        let stop = CancellationToken::new();
        let until = stop.clone().cancelled_owned();
        tokio::spawn(async move {
            let _reporter = reporter;
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, until)
                .await
        });
        (addr, accepted, stop)
    }

    #[tokio::test]
    async fn each_serving_thread_calls_over_a_connection_of_its_own() {
        use crate::serving::{ServingThreads, serving_index};
        let (addr, accepted, stop) = counting_server().await;
        let t = transport(&addr, Duration::from_secs(5)).expect("transport");
        assert!(!t.is_local());
        // Off the serving threads: the shared channel, one connection for every call.
        for _ in 0..3 {
            let status = check(t.clone()).await.expect("answered");
            assert_eq!(status, ServingStatus::Serving as i32);
        }
        assert_eq!(accepted.load(Ordering::Relaxed), 1);

        let threads = ServingThreads::start(2, "test-grpc").expect("threads");
        for _ in 0..3 {
            let calls: Vec<_> = (0..2)
                .map(|_| {
                    let t = t.clone();
                    threads.spawn(move || async move { (serving_index(), check(t).await) })
                })
                .collect();
            let mut on = Vec::new();
            for call in calls {
                let (thread, status) = call.await.expect("ran");
                assert_eq!(status.expect("answered"), ServingStatus::Serving as i32);
                on.push(thread);
            }
            on.sort_unstable();
            assert_eq!(on, [1, 2]);
        }
        // A connection per serving thread, opened there and kept for its later calls.
        assert_eq!(accepted.load(Ordering::Relaxed), 3);
        stop.cancel();
    }

    #[test]
    fn addresses_are_keyed_by_host_and_port() {
        assert_eq!(authority("http://127.0.0.1:5/"), "127.0.0.1:5");
        assert_eq!(authority("10.0.0.1:7"), "10.0.0.1:7");
    }

    #[tokio::test]
    async fn a_registered_service_is_called_in_process_until_it_stops() {
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        // Nothing listens on this address: only the in-process call can answer.
        let addr = "127.0.0.1:1";
        let stop = CancellationToken::new();
        let registration = register_local(addr, service, stop.clone());

        let t = transport(&format!("http://{addr}"), Duration::from_secs(1)).expect("transport");
        assert!(t.is_local());
        assert_eq!(
            check(t.clone()).await.expect("answered"),
            ServingStatus::Serving as i32
        );

        stop.cancel();
        // Nothing else serves the address: the network answers, and nothing listens there.
        let err = check(t.clone()).await.expect_err("stopped");
        assert_eq!(err.code(), tonic::Code::Unavailable);
        let fresh = transport(addr, Duration::from_secs(1)).expect("transport");
        assert!(!fresh.is_local(), "a stopped service is not handed out");

        // A service registered at the address since (a worker restarted in this process):
        // the old transport finds it, as a channel reconnects.
        let (again, service) = tonic_health::server::health_reporter();
        again
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let _restarted = register_local(addr, service, CancellationToken::new());
        assert_eq!(
            check(t).await.expect("answered"),
            ServingStatus::NotServing as i32
        );

        drop(registration);
        assert!(
            LOCAL.read().contains_key(addr),
            "the newer registration stays"
        );
    }

    #[tokio::test]
    async fn dropping_an_old_registration_keeps_a_newer_one() {
        let (_r1, s1) = tonic_health::server::health_reporter();
        let (_r2, s2) = tonic_health::server::health_reporter();
        let addr = "127.0.0.1:2";
        let old = register_local(addr, s1, CancellationToken::new());
        let new = register_local(addr, s2, CancellationToken::new());
        drop(old);
        assert!(
            transport(addr, Duration::from_secs(1))
                .expect("t")
                .is_local()
        );
        drop(new);
        assert!(
            !transport(addr, Duration::from_secs(1))
                .expect("t")
                .is_local()
        );
    }
}
