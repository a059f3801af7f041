//! Discovery on etcd.
//!
//! Layout: one key per worker, `/tandem/<namespace>/workers/<role>/<worker_id>` (role lowercase,
//! id as 16 hex digits), whose value is the [`WorkerRecord`] as JSON (readable with `etcdctl get
//! --prefix /tandem/`), attached to a lease of [`EtcdConfig::lease_ttl`] kept alive every TTL/3.
//!
//! Client: our own small etcd v3 gRPC client (`client.rs`, stubs generated from proto/etcd/
//! without protoc). It neither reconnects its streams nor recovers a channel after the server
//! restarts, by design: every call here runs under a timeout and every failure leads to a fresh
//! client. No deadline travels to etcd (tonic would send it as `grpc-timeout`, and etcd would
//! end the long-lived watch and keep-alive streams): unary calls get a local timeout.
//!
//! Robustness: a registration (`registration.rs`) re-establishes itself forever: it resumes its
//! lease when etcd still knows it, else grants a new one, and puts its key again. A watch
//! (`watch.rs`) re-connects, re-lists and emits the difference, so a removal that happened while
//! it was disconnected (including a wiped etcd) is still reported.

pub(crate) mod client;
mod registration;
mod watch;

use std::time::Duration;

use async_trait::async_trait;
use tandem_protocol::{WorkerId, WorkerRecord, WorkerRole};
use tokio_util::sync::CancellationToken;

use self::client::EtcdClient;
use super::{Discovery, DiscoveryWatch, Registration, parse_role, role_name};
use crate::error::{RuntimeError, with_timeout};

/// How to reach etcd and how to register there.
#[derive(Clone)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379` (`http://` is assumed when missing).
    pub endpoints: Vec<String>,
    /// Namespace: keys live under `/tandem/<namespace>/`. Non-empty, no `/`.
    pub namespace: String,
    /// Lease TTL; whole seconds, at least 1 s (etcd may raise very small values to its minimum).
    pub lease_ttl: Duration,
    /// Deadline for connecting (per endpoint tried, authentication included), for each unary
    /// call, and for an HTTP/2 ping's answer.
    pub connect_timeout: Duration,
    /// Largest delay between reconnect attempts (backoff starts at 100 ms and doubles).
    pub max_backoff: Duration,
    /// Credentials when etcd has auth enabled (both or neither).
    pub username: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for EtcdConfig {
    /// The password stays out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdConfig")
            .field("endpoints", &self.endpoints)
            .field("namespace", &self.namespace)
            .field("lease_ttl", &self.lease_ttl)
            .field("connect_timeout", &self.connect_timeout)
            .field("max_backoff", &self.max_backoff)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:2379".into()],
            namespace: "default".into(),
            lease_ttl: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(3),
            max_backoff: Duration::from_secs(2),
            username: None,
            password: None,
        }
    }
}

impl EtcdConfig {
    /// Checks the values that would otherwise fail later and less clearly.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        if self.endpoints.is_empty() {
            return Err(RuntimeError::Config("etcd: no endpoints".into()));
        }
        if self.namespace.is_empty() || self.namespace.contains('/') {
            return Err(RuntimeError::Config(format!(
                "etcd: namespace {:?} must be non-empty and contain no '/'",
                self.namespace
            )));
        }
        if self.lease_ttl < Duration::from_secs(1) {
            return Err(RuntimeError::Config(format!(
                "etcd: lease TTL {:?} is below 1 s",
                self.lease_ttl
            )));
        }
        if self.connect_timeout.is_zero() {
            return Err(RuntimeError::Config("etcd: connect timeout is zero".into()));
        }
        if self.username.is_some() != self.password.is_some() {
            return Err(RuntimeError::Config(
                "etcd: username and password go together".into(),
            ));
        }
        Ok(())
    }

    /// The lease TTL in whole seconds, as etcd takes it.
    pub(crate) fn ttl_secs(&self) -> i64 {
        let secs = self.lease_ttl.as_secs() + u64::from(self.lease_ttl.subsec_nanos() > 0);
        i64::try_from(secs).unwrap_or(i64::MAX)
    }

    /// How often the lease is kept alive: TTL/3.
    pub(crate) fn keep_alive_interval(&self) -> Duration {
        self.lease_ttl / 3
    }

    /// `/tandem/<namespace>/workers/`
    pub fn workers_prefix(&self) -> String {
        format!("/tandem/{}/workers/", self.namespace)
    }

    /// `/tandem/<namespace>/workers/<role>/<worker_id>`
    pub fn worker_key(&self, role: WorkerRole, id: WorkerId) -> String {
        format!("{}{}/{}", self.workers_prefix(), role_name(role), id)
    }

    /// Inverse of [`EtcdConfig::worker_key`].
    pub fn parse_worker_key(&self, key: &str) -> Option<(WorkerRole, WorkerId)> {
        let rest = key.strip_prefix(&self.workers_prefix())?;
        let (role, id) = rest.split_once('/')?;
        let id = u64::from_str_radix(id, 16).ok()?;
        Some((parse_role(role)?, WorkerId(id)))
    }
}

/// Connects a fresh client (authenticated when credentials are configured). Bounded by the
/// connect timeout per endpoint tried (see [`EtcdClient::connect`]).
pub(crate) async fn connect(config: &EtcdConfig) -> Result<EtcdClient, RuntimeError> {
    let credentials = match (&config.username, &config.password) {
        (Some(user), Some(password)) => Some((user.as_str(), password.as_str())),
        _ => None,
    };
    let client = EtcdClient::connect(&config.endpoints, config.connect_timeout, credentials)
        .await
        .map_err(RuntimeError::etcd("connect"))?;
    tracing::trace!(endpoint = client.endpoint(), "connected to etcd");
    Ok(client)
}

/// Lists every worker under the prefix, with the store revision the listing is valid at.
/// Malformed values are skipped with a warning (an operator's stray key must not stop us).
pub(crate) async fn list_workers(
    client: &mut EtcdClient,
    config: &EtcdConfig,
) -> Result<(Vec<WorkerRecord>, i64), RuntimeError> {
    let prefix = config.workers_prefix();
    let response = with_timeout("etcd list", config.connect_timeout, async {
        client
            .get_prefix(prefix)
            .await
            .map_err(RuntimeError::etcd("list"))
    })
    .await?;
    let revision = response.header.map(|h| h.revision).unwrap_or(0);
    let mut records = Vec::with_capacity(response.kvs.len());
    for kv in &response.kvs {
        let key = String::from_utf8_lossy(&kv.key).into_owned();
        match decode_record(config, &key, &kv.value) {
            Ok(record) => records.push(record),
            Err(e) => tracing::warn!(error = %e, "skipping worker key"),
        }
    }
    Ok((records, revision))
}

/// Decodes a value and checks it names the worker its key does.
pub(crate) fn decode_record(
    config: &EtcdConfig,
    key: &str,
    value: &[u8],
) -> Result<WorkerRecord, RuntimeError> {
    let record: WorkerRecord =
        serde_json::from_slice(value).map_err(|source| RuntimeError::Decode {
            key: key.to_string(),
            source,
        })?;
    if config.parse_worker_key(key) != Some((record.role, record.id)) {
        return Err(RuntimeError::InvalidRequest(format!(
            "record for {} {:?} stored under key {key}",
            record.id, record.role
        )));
    }
    Ok(record)
}

/// Discovery on etcd. Cheap to clone.
#[derive(Clone, Debug)]
pub struct EtcdDiscovery {
    config: EtcdConfig,
}

impl EtcdDiscovery {
    /// Validates `config` and checks that etcd answers (one read under the connect timeout).
    pub async fn connect(config: EtcdConfig) -> Result<Self, RuntimeError> {
        config.validate()?;
        let mut client = connect(&config).await?;
        list_workers(&mut client, &config).await?;
        Ok(EtcdDiscovery { config })
    }

    /// The configuration in use.
    pub fn config(&self) -> &EtcdConfig {
        &self.config
    }
}

#[async_trait]
impl Discovery for EtcdDiscovery {
    /// Registers now (returning the error if etcd cannot be reached), then keeps the key alive
    /// in the background, re-registering after any loss until deregistered or dropped.
    async fn register(&self, record: WorkerRecord) -> Result<Registration, RuntimeError> {
        registration::register(self.config.clone(), record).await
    }

    async fn list(&self) -> Result<Vec<WorkerRecord>, RuntimeError> {
        // A fresh client per call: a cached one may be wedged after an etcd restart.
        let mut client = connect(&self.config).await?;
        let (mut records, _) = list_workers(&mut client, &self.config).await?;
        records.sort_by_key(|r| (r.id, role_name(r.role)));
        Ok(records)
    }

    /// Lists now (returning the error if etcd cannot be reached), then follows changes forever,
    /// reconnecting and resyncing after any loss.
    async fn watch(&self, stop: &CancellationToken) -> Result<DiscoveryWatch, RuntimeError> {
        watch::watch(self.config.clone(), stop.child_token()).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::discovery::tests::record;

    #[test]
    fn keys_follow_the_documented_layout() {
        let config = EtcdConfig {
            namespace: "prod".into(),
            ..EtcdConfig::default()
        };
        let key = config.worker_key(WorkerRole::Decode, WorkerId(0xabc));
        assert_eq!(key, "/tandem/prod/workers/decode/0000000000000abc");
        assert_eq!(
            config.parse_worker_key(&key),
            Some((WorkerRole::Decode, WorkerId(0xabc)))
        );
        assert_eq!(config.parse_worker_key("/tandem/prod/workers/x/1"), None);
        assert_eq!(
            config.parse_worker_key("/tandem/other/workers/decode/1"),
            None
        );
    }

    #[test]
    fn records_must_match_their_key() {
        let config = EtcdConfig::default();
        let r = record(1, WorkerRole::Prefill);
        let value = serde_json::to_vec(&r).expect("encode");
        let key = config.worker_key(WorkerRole::Prefill, WorkerId(1));
        assert_eq!(decode_record(&config, &key, &value).expect("decode"), r);
        let wrong = config.worker_key(WorkerRole::Decode, WorkerId(1));
        assert!(decode_record(&config, &wrong, &value).is_err());
        assert!(decode_record(&config, &key, b"{not json").is_err());
    }

    #[test]
    fn debug_output_hides_the_password() {
        let config = EtcdConfig {
            username: Some("root".into()),
            password: Some("s3cret".into()),
            ..EtcdConfig::default()
        };
        let shown = format!("{config:?}");
        assert!(
            shown.contains("root") && !shown.contains("s3cret"),
            "{shown}"
        );
    }

    #[test]
    fn config_validation() {
        let ok = EtcdConfig::default();
        assert!(ok.validate().is_ok());
        assert_eq!(ok.ttl_secs(), 10);
        let bad_ns = EtcdConfig {
            namespace: "a/b".into(),
            ..EtcdConfig::default()
        };
        assert!(bad_ns.validate().is_err());
        let short = EtcdConfig {
            lease_ttl: Duration::from_millis(500),
            ..EtcdConfig::default()
        };
        assert!(short.validate().is_err());
        let half = EtcdConfig {
            lease_ttl: Duration::from_millis(2500),
            ..EtcdConfig::default()
        };
        assert_eq!(half.ttl_secs(), 3);
        let no_endpoints = EtcdConfig {
            endpoints: vec![],
            ..EtcdConfig::default()
        };
        assert!(no_endpoints.validate().is_err());
    }
}
