//! A small etcd v3 client of our own, over tonic stubs generated from proto/etcd/ by build.rs
//! (protox: no system `protoc` needed to build this crate).
//!
//! It offers exactly what discovery and the etcd readiness probe use: connect (optionally
//! authenticating), range (one key or a prefix), put with a lease, delete one key, lease grant,
//! revoke and keep-alive (bidirectional stream), watch a prefix from a revision (bidirectional
//! stream) and member list. The wire format follows etcd's api/etcdserverpb/rpc.proto and
//! api/mvccpb/kv.proto (see the .proto files); tests/etcd_discovery.rs checks it against the
//! independent `etcd-client` crate on a real etcd.
//!
//! Deliberately absent, because the callers' robustness rules (see `mod.rs`) make them moot:
//! - No per-request deadline on the channel: tonic would send it as `grpc-timeout` and etcd
//!   would end the long-lived watch and keep-alive streams. Callers put each unary call under a
//!   local timeout instead.
//! - No reconnecting, no re-subscribing, no token refresh: after any failure callers drop the
//!   client and connect a fresh one (which authenticates again). A token that expired in an idle
//!   client therefore costs one failed call and a reconnect, as it did with `etcd-client`, whose
//!   automatic token refresh is off by default.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use self::pb::etcdserverpb::{
    AuthenticateRequest, DeleteRangeRequest, DeleteRangeResponse, LeaseGrantRequest,
    LeaseGrantResponse, LeaseKeepAliveRequest, LeaseKeepAliveResponse, LeaseRevokeRequest,
    LeaseRevokeResponse, MemberListRequest, MemberListResponse, PutRequest, PutResponse,
    RangeRequest, RangeResponse, WatchCreateRequest, WatchRequest, WatchResponse,
    auth_client::AuthClient, cluster_client::ClusterClient, kv_client::KvClient,
    lease_client::LeaseClient, watch_client::WatchClient, watch_request::RequestUnion,
};
use crate::error::EtcdError;

/// The generated messages and client stubs.
#[allow(
    missing_debug_implementations,
    dead_code,
    clippy::all,
    clippy::pedantic
)]
pub(crate) mod pb {
    // Sibling modules: the generated etcdserverpb code names `super::mvccpb::KeyValue`.
    pub(crate) mod mvccpb {
        tonic::include_proto!("mvccpb");
    }
    pub(crate) mod etcdserverpb {
        tonic::include_proto!("etcdserverpb");
    }
}

pub(crate) use self::pb::mvccpb::event::EventType;

/// Metadata key etcd reads the auth token from (etcd's api/v3rpc/rpctypes/metadatafields.go,
/// `TokenFieldNameGRPC`).
const TOKEN_KEY: &str = "token";

/// HTTP/2 ping period. Catches a hung (not closed) connection under a long-lived stream; etcd's
/// default enforcement refuses pings more frequent than every 5 s.
const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(10);

/// Requests queued on a keep-alive stream. The registration sends one and waits for its answer,
/// so one slot would do; a few leave room without ever growing.
const KEEP_ALIVE_BUFFER: usize = 4;

/// Where the next connect starts in the endpoint list (see [`EtcdClient::connect`]).
static NEXT_START: AtomicUsize = AtomicUsize::new(0);

/// Adds the auth token (when there is one) to every request, streams included.
#[derive(Clone)]
pub(crate) struct TokenInterceptor {
    token: Option<AsciiMetadataValue>,
}

impl std::fmt::Debug for TokenInterceptor {
    // The token is a credential: never in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenInterceptor")
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Interceptor for TokenInterceptor {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(token) = &self.token {
            request.metadata_mut().insert(TOKEN_KEY, token.clone());
        }
        Ok(request)
    }
}

type Service = InterceptedService<Channel, TokenInterceptor>;

/// A connection to one etcd member, authenticated when credentials were given. Cheap to clone
/// (the clones share the connection).
#[derive(Clone, Debug)]
pub(crate) struct EtcdClient {
    /// The member this client talks to, for logs.
    endpoint: String,
    kv: KvClient<Service>,
    lease: LeaseClient<Service>,
    watch: WatchClient<Service>,
    cluster: ClusterClient<Service>,
}

impl EtcdClient {
    /// Connects to one of `endpoints` (`http://` is assumed when there is no scheme), then
    /// authenticates as `credentials` (user, password) when given. Each endpoint gets
    /// `connect_timeout` for TCP connect plus authentication, which also serves as the HTTP/2
    /// ping timeout. Fails with the last endpoint's error when none works.
    ///
    /// Multiple endpoints are tried in order, starting one further along the list at each
    /// connect, and the client then sticks to the member that answered. Why not tonic's
    /// `Channel::balance_list` (what etcd-client uses): its balancer keeps an endpoint whose
    /// connection was refused in the ready set (the error is only returned by the call), so with
    /// one member down a share of calls fails, and since every failure here costs a fresh client
    /// and a re-registration, that share would keep registrations churning. Trying in order
    /// skips a refused member at connect time, and the moving start point makes successive
    /// fresh clients (one per failure) leave a member that accepts connections but fails calls
    /// (say, one cut off from the quorum).
    pub(crate) async fn connect(
        endpoints: &[String],
        connect_timeout: Duration,
        credentials: Option<(&str, &str)>,
    ) -> Result<Self, EtcdError> {
        // Every endpoint is checked up front: a typo is the caller's error even when another
        // endpoint would have answered.
        let built = endpoints
            .iter()
            .map(|e| endpoint(e, connect_timeout))
            .collect::<Result<Vec<_>, _>>()?;
        if built.is_empty() {
            return Err(EtcdError::InvalidArgument("no etcd endpoints".into()));
        }
        let start = NEXT_START.fetch_add(1, Ordering::Relaxed) % built.len();
        let mut last = None;
        for i in 0..built.len() {
            let (url, endpoint) = &built[(start + i) % built.len()];
            let attempt = connect_one(url, endpoint, credentials);
            let error = match tokio::time::timeout(connect_timeout, attempt).await {
                Ok(Ok(client)) => return Ok(client),
                Ok(Err(error)) => error,
                Err(_) => EtcdError::ConnectTimeout {
                    endpoint: url.clone(),
                    after: connect_timeout,
                },
            };
            tracing::debug!(endpoint = %url, %error, "etcd endpoint failed");
            last = Some(error);
        }
        Err(last.unwrap_or_else(|| EtcdError::InvalidArgument("no etcd endpoints".into())))
    }

    /// The endpoint this client is connected to.
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Reads one key (linearizable).
    pub(crate) async fn get(
        &mut self,
        key: impl Into<Vec<u8>>,
    ) -> Result<RangeResponse, EtcdError> {
        let request = RangeRequest {
            key: key.into(),
            ..RangeRequest::default()
        };
        Ok(self.kv.range(request).await?.into_inner())
    }

    /// Reads every key starting with `prefix` (linearizable), with the store revision in the
    /// header.
    pub(crate) async fn get_prefix(
        &mut self,
        prefix: impl Into<Vec<u8>>,
    ) -> Result<RangeResponse, EtcdError> {
        let key = prefix.into();
        let request = RangeRequest {
            range_end: prefix_end(&key),
            key,
            ..RangeRequest::default()
        };
        Ok(self.kv.range(request).await?.into_inner())
    }

    /// Puts `key = value` attached to `lease` (0: no lease).
    pub(crate) async fn put(
        &mut self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
        lease: i64,
    ) -> Result<PutResponse, EtcdError> {
        let request = PutRequest {
            key: key.into(),
            value: value.into(),
            lease,
            ..PutRequest::default()
        };
        Ok(self.kv.put(request).await?.into_inner())
    }

    /// Deletes one key (no error when it is absent: `deleted` is then 0).
    pub(crate) async fn delete(
        &mut self,
        key: impl Into<Vec<u8>>,
    ) -> Result<DeleteRangeResponse, EtcdError> {
        let request = DeleteRangeRequest {
            key: key.into(),
            ..DeleteRangeRequest::default()
        };
        Ok(self.kv.delete_range(request).await?.into_inner())
    }

    /// Grants a lease of `ttl` seconds, its id chosen by etcd.
    pub(crate) async fn lease_grant(&mut self, ttl: i64) -> Result<LeaseGrantResponse, EtcdError> {
        let request = LeaseGrantRequest { ttl, id: 0 };
        Ok(self.lease.lease_grant(request).await?.into_inner())
    }

    /// Revokes a lease, deleting the keys attached to it.
    pub(crate) async fn lease_revoke(&mut self, id: i64) -> Result<LeaseRevokeResponse, EtcdError> {
        let request = LeaseRevokeRequest { id };
        Ok(self.lease.lease_revoke(request).await?.into_inner())
    }

    /// Opens the keep-alive stream of lease `id` and renews the lease once; fails with
    /// [`EtcdError::LeaseExpired`] when etcd does not know the lease (as etcd-client does).
    pub(crate) async fn lease_keep_alive(
        &mut self,
        id: i64,
    ) -> Result<(LeaseKeeper, LeaseKeepAliveStream), EtcdError> {
        let (tx, rx) = mpsc::channel(KEEP_ALIVE_BUFFER);
        let mut keeper = LeaseKeeper { id, tx };
        keeper.keep_alive().await?;
        let stream = self
            .lease
            .lease_keep_alive(ReceiverStream::new(rx))
            .await?
            .into_inner();
        let mut stream = LeaseKeepAliveStream { stream };
        match stream.message().await? {
            Some(response) if response.ttl > 0 => Ok((keeper, stream)),
            Some(_) => Err(EtcdError::LeaseExpired(id)),
            None => Err(EtcdError::Closed("etcd lease keep-alive stream")),
        }
    }

    /// Watches every key starting with `prefix`, from `start_revision` (inclusive). The first
    /// response is normally etcd's `created` acknowledgement, without events.
    pub(crate) async fn watch_prefix(
        &mut self,
        prefix: impl Into<Vec<u8>>,
        start_revision: i64,
    ) -> Result<WatchStream, EtcdError> {
        let key = prefix.into();
        let create = WatchCreateRequest {
            range_end: prefix_end(&key),
            key,
            start_revision,
            ..WatchCreateRequest::default()
        };
        let request = WatchRequest {
            request_union: Some(RequestUnion::CreateRequest(create)),
        };
        // One slot: the create request is all we ever send.
        let (tx, rx) = mpsc::channel(1);
        tx.send(request)
            .await
            .map_err(|_| EtcdError::Closed("etcd watch request stream"))?;
        let stream = self
            .watch
            .watch(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(WatchStream {
            _requests: tx,
            stream,
        })
    }

    /// The cluster's members.
    pub(crate) async fn member_list(&mut self) -> Result<MemberListResponse, EtcdError> {
        let request = MemberListRequest::default();
        Ok(self.cluster.member_list(request).await?.into_inner())
    }
}

impl From<tonic::Status> for EtcdError {
    fn from(status: tonic::Status) -> Self {
        EtcdError::Status(status)
    }
}

/// Sends keep-alive requests on a lease's stream.
#[derive(Debug)]
pub(crate) struct LeaseKeeper {
    id: i64,
    tx: mpsc::Sender<LeaseKeepAliveRequest>,
}

impl LeaseKeeper {
    /// Asks etcd to renew the lease; the answer arrives on the [`LeaseKeepAliveStream`].
    pub(crate) async fn keep_alive(&mut self) -> Result<(), EtcdError> {
        self.tx
            .send(LeaseKeepAliveRequest { id: self.id })
            .await
            .map_err(|_| EtcdError::Closed("etcd lease keep-alive stream"))
    }
}

/// The answers to a lease's keep-alive requests.
#[derive(Debug)]
pub(crate) struct LeaseKeepAliveStream {
    stream: tonic::Streaming<LeaseKeepAliveResponse>,
}

impl LeaseKeepAliveStream {
    /// The next answer; `None` when etcd ended the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<LeaseKeepAliveResponse>, EtcdError> {
        Ok(self.stream.message().await?)
    }
}

/// The responses of one watch.
#[derive(Debug)]
pub(crate) struct WatchStream {
    // Kept open for as long as the watch is read: dropping it would end our side of the stream,
    // which etcd's LeaseKeepAlive takes as the end of the call (server/etcdserver/api/v3rpc/
    // lease.go returns on EOF); Watch tolerates it today, but we do not rely on that.
    _requests: mpsc::Sender<WatchRequest>,
    stream: tonic::Streaming<WatchResponse>,
}

impl WatchStream {
    /// The next response; `None` when etcd ended the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<WatchResponse>, EtcdError> {
        Ok(self.stream.message().await?)
    }
}

/// Opens the connection to one endpoint and authenticates there.
async fn connect_one(
    url: &str,
    endpoint: &Endpoint,
    credentials: Option<(&str, &str)>,
) -> Result<EtcdClient, EtcdError> {
    // Connect now rather than lazily: a dead member shows here, and the next one gets tried.
    let channel = endpoint
        .connect()
        .await
        .map_err(|source| EtcdError::Connect {
            endpoint: url.to_string(),
            source,
        })?;
    let token = match credentials {
        Some((user, password)) => Some(authenticate(channel.clone(), user, password).await?),
        None => None,
    };
    let interceptor = TokenInterceptor { token };
    Ok(EtcdClient {
        endpoint: url.to_string(),
        kv: KvClient::with_interceptor(channel.clone(), interceptor.clone()),
        lease: LeaseClient::with_interceptor(channel.clone(), interceptor.clone()),
        watch: WatchClient::with_interceptor(channel.clone(), interceptor.clone()),
        cluster: ClusterClient::with_interceptor(channel, interceptor),
    })
}

/// `Auth.Authenticate`: name and password for the token etcd expects on every later request.
async fn authenticate(
    channel: Channel,
    user: &str,
    password: &str,
) -> Result<AsciiMetadataValue, EtcdError> {
    let request = AuthenticateRequest {
        name: user.to_string(),
        password: password.to_string(),
    };
    let response = AuthClient::new(channel)
        .authenticate(request)
        .await
        .map_err(|source| EtcdError::Authenticate {
            user: user.to_string(),
            source,
        })?;
    AsciiMetadataValue::try_from(response.into_inner().token)
        .map_err(|_| EtcdError::Protocol("auth token is not valid gRPC metadata".into()))
}

/// The tonic endpoint for one etcd URL, with its normalised text.
fn endpoint(url: &str, connect_timeout: Duration) -> Result<(String, Endpoint), EtcdError> {
    if url.starts_with("https://") {
        // As etcd-client built without its TLS features: refuse rather than talk plain text.
        return Err(EtcdError::InvalidArgument(format!(
            "etcd endpoint {url:?}: https needs TLS, which this build does not support"
        )));
    }
    let url = if url.starts_with("http://") {
        url.to_string()
    } else {
        format!("http://{url}")
    };
    let endpoint = Endpoint::from_shared(url.clone())
        .map_err(|e| EtcdError::InvalidArgument(format!("etcd endpoint {url:?}: {e}")))?
        .connect_timeout(connect_timeout)
        .http2_keep_alive_interval(KEEP_ALIVE_INTERVAL)
        .keep_alive_timeout(connect_timeout)
        .keep_alive_while_idle(true);
    Ok((url, endpoint))
}

/// The `range_end` that makes a range or watch cover every key starting with `prefix`: the
/// prefix with its last byte below 0xff incremented and what follows dropped (etcd's
/// client/v3/op.go `getPrefix`). A prefix of only 0xff bytes (or empty) has no such key:
/// `\0` then means "every key from `prefix` on", as etcd defines (`noPrefixEnd`).
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&b| b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_covers_exactly_the_prefix() {
        assert_eq!(prefix_end(b"/tandem/a/workers/"), b"/tandem/a/workers0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"a\xfe\xff\xff"), b"a\xff");
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn endpoints_are_normalised_and_checked() {
        let timeout = Duration::from_secs(1);
        let (url, _) = endpoint("127.0.0.1:2379", timeout).expect("host:port");
        assert_eq!(url, "http://127.0.0.1:2379");
        let (url, _) = endpoint("http://etcd:2379", timeout).expect("url");
        assert_eq!(url, "http://etcd:2379");
        assert!(matches!(
            endpoint("https://etcd:2379", timeout),
            Err(EtcdError::InvalidArgument(_))
        ));
        assert!(matches!(
            endpoint("not a uri", timeout),
            Err(EtcdError::InvalidArgument(_))
        ));
    }

    #[tokio::test]
    async fn no_endpoints_is_an_invalid_argument() {
        let err = EtcdClient::connect(&[], Duration::from_secs(1), None)
            .await
            .expect_err("no endpoints");
        assert!(matches!(err, EtcdError::InvalidArgument(_)));
    }

    #[tokio::test]
    async fn a_refused_connection_names_the_endpoint_and_the_cause() {
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr").port()
        };
        let endpoints = [format!("127.0.0.1:{port}")];
        let err = EtcdClient::connect(&endpoints, Duration::from_secs(2), None)
            .await
            .expect_err("nothing listens");
        assert!(matches!(err, EtcdError::Connect { .. }), "{err:?}");
        let text = err.to_string();
        assert!(text.contains(&format!("http://127.0.0.1:{port}")), "{text}");
        assert!(text.to_lowercase().contains("refused"), "{text}");
    }

    #[test]
    fn the_token_goes_into_metadata_and_not_into_logs() {
        let token = AsciiMetadataValue::from_static("secret.1");
        let mut interceptor = TokenInterceptor { token: Some(token) };
        let request = interceptor
            .call(tonic::Request::new(()))
            .expect("intercepted");
        assert_eq!(
            request.metadata().get(TOKEN_KEY).map(|v| v.as_bytes()),
            Some(&b"secret.1"[..])
        );
        assert!(!format!("{interceptor:?}").contains("secret"));
        let mut none = TokenInterceptor { token: None };
        let request = none.call(tonic::Request::new(())).expect("intercepted");
        assert!(request.metadata().get(TOKEN_KEY).is_none());
    }
}
