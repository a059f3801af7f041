//! A worker's registration in etcd and the task that keeps it there.
//!
//! The task holds a *session*: a client, a lease, the lease's keep-alive stream. It sends a
//! keep-alive every TTL/3 and expects the answer within the connect timeout. Any failure
//! (stream closed, timeout, etcd answering TTL 0 because the lease is gone) ends the session;
//! the task then establishes a new one with backoff, forever: fresh client, resume the old lease
//! if etcd still knows it (etcd restarted on the same data) or grant a new one (lease expired,
//! etcd wiped), and put the key again with the latest record.
//!
//! The task stops when the [`Registration`] is dropped (the key then lapses with its lease) or
//! deregistered (the task deletes the key and revokes the lease, then acknowledges).

use std::time::Duration;

use async_trait::async_trait;
use tandem_protocol::{WorkerId, WorkerRecord, WorkerRole};
use tokio::sync::{oneshot, watch};
use tokio::time::{Instant, MissedTickBehavior};

use super::client::{EtcdClient, LeaseKeepAliveStream, LeaseKeeper};
use super::{EtcdConfig, connect};
use crate::discovery::{Backoff, Registration, RegistrationBackend};
use crate::error::{EtcdError, RuntimeError, with_timeout};

/// First delay before re-establishing a lost registration; doubles up to the configured max.
const INITIAL_BACKOFF: Duration = Duration::from_millis(100);

pub(super) async fn register(
    config: EtcdConfig,
    record: WorkerRecord,
) -> Result<Registration, RuntimeError> {
    let key = config.worker_key(record.role, record.id);
    let value = serde_json::to_vec(&record).map_err(RuntimeError::Encode)?;
    let session = establish(&config, &key, &value, None).await?;
    tracing::info!(%key, lease = session.lease_id, "registered in etcd");
    let (record_tx, record_rx) = watch::channel(value);
    let (stop_tx, stop_rx) = oneshot::channel();
    let keeper = Keeper {
        config: config.clone(),
        key,
        record_rx,
        stop_rx,
    };
    tokio::spawn(keeper.run(session));
    Ok(Registration::new(Box::new(EtcdRegistration {
        id: record.id,
        role: record.role,
        record_tx,
        stop_tx: Some(stop_tx),
        deregister_timeout: config.connect_timeout * 3,
    })))
}

struct EtcdRegistration {
    id: WorkerId,
    role: WorkerRole,
    /// The latest encoded record; the keeper puts each change.
    record_tx: watch::Sender<Vec<u8>>,
    /// Sending asks the keeper to deregister and acknowledge; dropping it stops the keeper.
    stop_tx: Option<oneshot::Sender<oneshot::Sender<()>>>,
    deregister_timeout: Duration,
}

#[async_trait]
impl RegistrationBackend for EtcdRegistration {
    fn id(&self) -> WorkerId {
        self.id
    }

    fn role(&self) -> WorkerRole {
        self.role
    }

    fn update(&self, record: WorkerRecord) -> Result<(), RuntimeError> {
        let value = serde_json::to_vec(&record).map_err(RuntimeError::Encode)?;
        self.record_tx
            .send(value)
            .map_err(|_| RuntimeError::Closed("etcd registration task"))
    }

    async fn deregister(mut self: Box<Self>) {
        let Some(stop_tx) = self.stop_tx.take() else {
            return;
        };
        let (ack_tx, ack_rx) = oneshot::channel();
        if stop_tx.send(ack_tx).is_err() {
            return;
        }
        if tokio::time::timeout(self.deregister_timeout, ack_rx)
            .await
            .is_err()
        {
            tracing::warn!(id = %self.id, "etcd deregistration timed out; the lease will lapse");
        }
    }
}

/// Why the keeper stops.
enum Stop {
    /// The registration was dropped: leave the key to lapse with the lease.
    Dropped,
    /// Deregister, then acknowledge.
    Deregister(oneshot::Sender<()>),
}

/// A live lease with its key put.
struct Session {
    client: EtcdClient,
    lease_id: i64,
    keeper: LeaseKeeper,
    stream: LeaseKeepAliveStream,
}

struct Keeper {
    config: EtcdConfig,
    key: String,
    record_rx: watch::Receiver<Vec<u8>>,
    stop_rx: oneshot::Receiver<oneshot::Sender<()>>,
}

impl Keeper {
    async fn run(mut self, first: Session) {
        let mut backoff = Backoff::new(INITIAL_BACKOFF, self.config.max_backoff);
        let mut lease_hint = Some(first.lease_id);
        let mut session = Some(first);
        let (stop, last) = loop {
            let current = match session.take() {
                Some(s) => s,
                None => {
                    let value = self.record_rx.borrow().clone();
                    let attempt = establish(&self.config, &self.key, &value, lease_hint);
                    let outcome = tokio::select! {
                        stop = stopped(&mut self.stop_rx) => break (stop, None),
                        outcome = attempt => outcome,
                    };
                    match outcome {
                        Ok(s) => {
                            tracing::warn!(
                                key = %self.key,
                                lease = s.lease_id,
                                resumed = lease_hint == Some(s.lease_id),
                                "re-registered in etcd"
                            );
                            backoff.reset();
                            s
                        }
                        Err(error) => {
                            tracing::warn!(key = %self.key, %error, "etcd re-registration failed; retrying");
                            tokio::select! {
                                stop = stopped(&mut self.stop_rx) => break (stop, None),
                                _ = tokio::time::sleep(backoff.next_delay()) => continue,
                            }
                        }
                    }
                }
            };
            lease_hint = Some(current.lease_id);
            match self.keep(current).await {
                Ok((stop, s)) => break (stop, Some(s)),
                Err(error) => {
                    tracing::warn!(key = %self.key, %error, "etcd registration lost; re-registering");
                    tokio::select! {
                        stop = stopped(&mut self.stop_rx) => break (stop, None),
                        _ = tokio::time::sleep(backoff.next_delay()) => {}
                    }
                }
            }
        };
        if let Stop::Deregister(ack) = stop {
            self.remove(last, lease_hint).await;
            let _ = ack.send(());
        }
    }

    /// Keeps one session alive until it fails (`Err`) or the registration stops (`Ok`).
    async fn keep(&mut self, mut s: Session) -> Result<(Stop, Session), RuntimeError> {
        let period = self.config.keep_alive_interval();
        let mut ticker = tokio::time::interval_at(Instant::now() + period, period);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let timeout = self.config.connect_timeout;
        loop {
            tokio::select! {
                biased;
                stop = stopped(&mut self.stop_rx) => return Ok((stop, s)),
                changed = self.record_rx.changed() => {
                    if changed.is_err() {
                        return Ok((Stop::Dropped, s));
                    }
                    let value = self.record_rx.borrow_and_update().clone();
                    put(&mut s.client, &self.key, value, s.lease_id, timeout).await?;
                }
                _ = ticker.tick() => keep_alive_once(&mut s, timeout).await?,
            }
        }
    }

    /// Deletes the key and revokes the lease, best effort.
    async fn remove(&self, session: Option<Session>, lease: Option<i64>) {
        let timeout = self.config.connect_timeout;
        let client = match session {
            Some(s) => Ok(s.client),
            None => connect(&self.config).await,
        };
        let result = async {
            let mut client = client?;
            with_timeout("etcd delete", timeout, async {
                client
                    .delete(self.key.clone())
                    .await
                    .map_err(RuntimeError::etcd("delete"))
            })
            .await?;
            if let Some(lease) = lease {
                // The lease may be gone already (etcd wiped): only the key matters.
                let revoked = with_timeout("etcd lease revoke", timeout, async {
                    client
                        .lease_revoke(lease)
                        .await
                        .map_err(RuntimeError::etcd("lease revoke"))
                })
                .await;
                if let Err(error) = revoked {
                    tracing::debug!(lease, %error, "lease revoke failed after delete");
                }
            }
            Ok::<_, RuntimeError>(())
        }
        .await;
        match result {
            Ok(()) => tracing::info!(key = %self.key, "deregistered from etcd"),
            Err(error) => {
                tracing::warn!(key = %self.key, %error, "etcd deregistration failed; the lease will lapse")
            }
        }
    }
}

/// Resolves when the registration is deregistered or dropped.
async fn stopped(stop_rx: &mut oneshot::Receiver<oneshot::Sender<()>>) -> Stop {
    match stop_rx.await {
        Ok(ack) => Stop::Deregister(ack),
        Err(_) => Stop::Dropped,
    }
}

/// Connects, gets a lease (resuming `lease_hint` when etcd still has it) and puts the key.
async fn establish(
    config: &EtcdConfig,
    key: &str,
    value: &[u8],
    lease_hint: Option<i64>,
) -> Result<Session, RuntimeError> {
    let timeout = config.connect_timeout;
    let mut client = connect(config).await?;
    let resumed = match lease_hint {
        Some(id) => match keep_alive_stream(&mut client, id, timeout).await {
            Ok((keeper, stream)) => Some((id, keeper, stream)),
            Err(error) => {
                tracing::debug!(lease = id, %error, "previous lease not resumable");
                None
            }
        },
        None => None,
    };
    let (lease_id, keeper, stream) = match resumed {
        Some(resumed) => resumed,
        None => {
            let ttl = config.ttl_secs();
            let grant = with_timeout("etcd lease grant", timeout, async {
                client
                    .lease_grant(ttl)
                    .await
                    .map_err(RuntimeError::etcd("lease grant"))
            })
            .await?;
            let id = grant.id;
            let (keeper, stream) = keep_alive_stream(&mut client, id, timeout).await?;
            (id, keeper, stream)
        }
    };
    put(&mut client, key, value.to_vec(), lease_id, timeout).await?;
    Ok(Session {
        client,
        lease_id,
        keeper,
        stream,
    })
}

/// Opens the keep-alive stream of a lease; fails when etcd does not know the lease.
async fn keep_alive_stream(
    client: &mut EtcdClient,
    lease: i64,
    timeout: Duration,
) -> Result<(LeaseKeeper, LeaseKeepAliveStream), RuntimeError> {
    with_timeout("etcd lease keep-alive", timeout, async {
        client
            .lease_keep_alive(lease)
            .await
            .map_err(RuntimeError::etcd("lease keep-alive"))
    })
    .await
}

async fn put(
    client: &mut EtcdClient,
    key: &str,
    value: Vec<u8>,
    lease: i64,
    timeout: Duration,
) -> Result<(), RuntimeError> {
    with_timeout("etcd put", timeout, async {
        client
            .put(key, value, lease)
            .await
            .map(|_| ())
            .map_err(RuntimeError::etcd("put"))
    })
    .await
}

/// One keep-alive round trip. TTL 0 in the answer means etcd no longer has the lease.
async fn keep_alive_once(s: &mut Session, timeout: Duration) -> Result<(), RuntimeError> {
    let lease = s.lease_id;
    with_timeout("etcd keep-alive", timeout, async {
        s.keeper
            .keep_alive()
            .await
            .map_err(RuntimeError::etcd("keep-alive send"))?;
        match s.stream.message().await {
            Ok(Some(response)) if response.ttl > 0 => Ok(()),
            Ok(Some(_)) => Err(RuntimeError::Etcd {
                op: "keep-alive",
                source: EtcdError::LeaseExpired(lease),
            }),
            Ok(None) => Err(RuntimeError::Closed("etcd keep-alive stream")),
            Err(source) => Err(RuntimeError::Etcd {
                op: "keep-alive",
                source,
            }),
        }
    })
    .await
}
