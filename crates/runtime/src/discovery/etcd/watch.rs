//! Following the worker set in etcd, across disconnections and etcd restarts.
//!
//! One background task per watch: list the prefix (revision R), report the difference against
//! what was reported before, then watch from R+1 until the stream fails or is cancelled (etcd
//! restart, compaction past R, hung connection caught by HTTP/2 pings). Then start over with a
//! fresh client after a backoff. Since every (re)start re-lists and diffs, no removal is ever
//! missed, even when etcd comes back wiped and its revisions start again from 1.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::client::{EtcdClient, EventType, WatchStream};
use super::{EtcdConfig, connect, decode_record, list_workers};
use crate::discovery::{Backoff, DiscoveryEvent, DiscoveryWatch, WATCH_BUFFER, WorkerView};
use crate::error::{RuntimeError, with_timeout};

const INITIAL_BACKOFF: Duration = Duration::from_millis(100);

/// `cancel` is a child of the caller's stop token; dropping the watch cancels it too.
pub(super) async fn watch(
    config: EtcdConfig,
    cancel: CancellationToken,
) -> Result<DiscoveryWatch, RuntimeError> {
    // The first listing happens here so that an unreachable etcd is the caller's error.
    let mut client = connect(&config).await?;
    let (snapshot, revision) = list_workers(&mut client, &config).await?;
    let (tx, rx) = mpsc::channel(WATCH_BUFFER);
    let task = WatchTask {
        config,
        view: WorkerView::new(),
        tx,
        cancel: cancel.clone(),
    };
    tokio::spawn(task.run(client, snapshot, revision));
    Ok(DiscoveryWatch::new(rx, Some(cancel.drop_guard())))
}

/// Why a watch session ended.
enum End {
    /// The consumer is gone: stop for good.
    Closed,
    /// The connection or the watch failed: resync.
    Lost(RuntimeError),
}

struct WatchTask {
    config: EtcdConfig,
    /// What this watch has reported so far.
    view: WorkerView,
    tx: mpsc::Sender<DiscoveryEvent>,
    cancel: CancellationToken,
}

impl WatchTask {
    async fn run(
        mut self,
        mut client: EtcdClient,
        mut snapshot: Vec<tandem_protocol::WorkerRecord>,
        mut revision: i64,
    ) {
        let mut backoff = Backoff::new(INITIAL_BACKOFF, self.config.max_backoff);
        loop {
            let events = self.view.resync(snapshot);
            if !self.emit(events).await {
                return;
            }
            match self.follow(&mut client, revision).await {
                End::Closed => return,
                End::Lost(error) => {
                    tracing::warn!(%error, "etcd discovery watch lost; resyncing");
                }
            }
            // Reconnect and re-list, with backoff, until it works or the watch is dropped.
            loop {
                if !self.sleep(backoff.next_delay()).await {
                    return;
                }
                let attempt = async {
                    let mut fresh = connect(&self.config).await?;
                    let (listed, rev) = list_workers(&mut fresh, &self.config).await?;
                    Ok::<_, RuntimeError>((fresh, listed, rev))
                };
                let outcome = tokio::select! {
                    _ = self.cancel.cancelled() => return,
                    outcome = attempt => outcome,
                };
                match outcome {
                    Ok((fresh, listed, rev)) => {
                        tracing::info!(
                            revision = rev,
                            workers = listed.len(),
                            "etcd discovery watch resynced"
                        );
                        (client, snapshot, revision) = (fresh, listed, rev);
                        backoff.reset();
                        break;
                    }
                    Err(error) => tracing::warn!(%error, "etcd discovery resync failed; retrying"),
                }
            }
        }
    }

    /// Watches from `revision + 1` until the watch fails or the consumer leaves.
    async fn follow(&mut self, client: &mut EtcdClient, revision: i64) -> End {
        let prefix = self.config.workers_prefix();
        let opened = with_timeout("etcd watch", self.config.connect_timeout, async {
            client
                .watch_prefix(prefix, revision + 1)
                .await
                .map_err(RuntimeError::etcd("watch"))
        });
        let mut stream: WatchStream = tokio::select! {
            _ = self.cancel.cancelled() => return End::Closed,
            opened = opened => match opened {
                Ok(stream) => stream,
                Err(error) => return End::Lost(error),
            },
        };
        loop {
            let message = tokio::select! {
                _ = self.cancel.cancelled() => return End::Closed,
                message = stream.message() => message,
            };
            let response = match message {
                Ok(Some(response)) => response,
                Ok(None) => return End::Lost(RuntimeError::Closed("etcd watch stream")),
                Err(source) => {
                    return End::Lost(RuntimeError::Etcd {
                        op: "watch",
                        source,
                    });
                }
            };
            if response.canceled {
                return End::Lost(RuntimeError::InvalidRequest(format!(
                    "etcd cancelled the watch (compact revision {}): {}",
                    response.compact_revision, response.cancel_reason
                )));
            }
            let mut out = Vec::new();
            for event in &response.events {
                let Some(kv) = &event.kv else { continue };
                let key = String::from_utf8_lossy(&kv.key).into_owned();
                let Some((role, id)) = self.config.parse_worker_key(&key) else {
                    tracing::warn!(%key, "ignoring unexpected key under the workers prefix");
                    continue;
                };
                // An unknown event type (none exists in etcd 3.x) is no usable worker either.
                match EventType::try_from(event.r#type) {
                    Ok(EventType::Put) => match decode_record(&self.config, &key, &kv.value) {
                        Ok(record) => out.extend(self.view.put(record)),
                        Err(error) => {
                            // An unreadable record is no usable worker.
                            tracing::warn!(%error, "malformed worker record");
                            out.extend(self.view.remove(role, id));
                        }
                    },
                    Ok(EventType::Delete) | Err(_) => out.extend(self.view.remove(role, id)),
                }
            }
            if !self.emit(out).await {
                return End::Closed;
            }
        }
    }

    /// Sends events to the consumer; false when it is gone.
    async fn emit(&self, events: Vec<DiscoveryEvent>) -> bool {
        for event in events {
            tokio::select! {
                _ = self.cancel.cancelled() => return false,
                sent = self.tx.send(event) => if sent.is_err() { return false },
            }
        }
        true
    }

    /// Sleeps unless cancelled; false when cancelled.
    async fn sleep(&self, delay: Duration) -> bool {
        tokio::select! {
            _ = self.cancel.cancelled() => false,
            _ = tokio::time::sleep(delay) => true,
        }
    }
}
