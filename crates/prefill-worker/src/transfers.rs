//! The fence between a prefill worker's KV writes and a decode worker's reuse of the blocks
//! they target.
//!
//! A decode worker that gives up on a remote prefill (timeout, stream failure, its client
//! gone) cannot reuse the destination blocks while this worker may still write into them: a
//! late write would land in another request's KV, or in its prefix cache. So it holds them and
//! calls `AbortPrefill`; the answer comes only when the prefill has stopped and its writer has
//! been flushed and closed — nothing more of it can arrive. A prefill aborted before it
//! started is refused when its request comes (a tombstone).
//!
//! Every running transfer has a [`TransferTicket`], the only owner of its writer. Dropping the
//! ticket (the prefill finished, failed, or its stream was dropped) flushes and closes the
//! writer in the background and then marks the transfer closed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use hashbrown::{HashMap, HashSet};
use parking_lot::Mutex;
use tandem_kv_transfer::BlockWriter;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Aborted transfers remembered so that their prefill is refused if it arrives late.
const MAX_TOMBSTONES: usize = 4096;

/// Longest a closing writer's flush may take before it is dropped anyway.
const CLOSE_FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

/// A transfer: the caller's request id and its destination region (compact descriptor).
pub type TransferKey = (u64, String);

/// Transfers in progress and tombstones of aborted ones.
#[derive(Debug)]
pub struct Transfers {
    inner: Mutex<Inner>,
    /// The worker's stop token: every transfer's token is its child.
    stop: CancellationToken,
}

#[derive(Debug, Default)]
struct Inner {
    running: HashMap<TransferKey, Running>,
    tombstones: HashSet<TransferKey>,
    tombstone_order: VecDeque<TransferKey>,
}

#[derive(Debug)]
struct Running {
    cancel: CancellationToken,
    closed: watch::Receiver<bool>,
}

/// The transfer was aborted by its caller before it started.
#[derive(Debug, thiserror::Error)]
#[error("the caller aborted this prefill before it started")]
pub struct AbortedBeforeStart;

impl Transfers {
    /// Transfers of a worker whose tasks stop with `stop`.
    pub fn new(stop: CancellationToken) -> Self {
        Transfers {
            inner: Mutex::default(),
            stop,
        }
    }

    /// Registers a transfer about to start; its ticket must own the writer once connected.
    pub fn start(self: &Arc<Self>, key: TransferKey) -> Result<TransferTicket, AbortedBeforeStart> {
        let mut inner = self.inner.lock();
        if inner.tombstones.contains(&key) || inner.running.contains_key(&key) {
            return Err(AbortedBeforeStart);
        }
        let cancel = self.stop.child_token();
        let (tx, rx) = watch::channel(false);
        inner.running.insert(
            key.clone(),
            Running {
                cancel: cancel.clone(),
                closed: rx,
            },
        );
        Ok(TransferTicket {
            key: Some(key),
            transfers: self.clone(),
            cancel,
            closed: Some(tx),
            writer: None,
            on_closed: None,
        })
    }

    /// Aborts `key`: a running transfer is cancelled and the returned receiver turns true
    /// once its writer is closed; None when it is not running (finished, or never started).
    /// Either way it cannot start afterwards.
    pub fn abort(&self, key: TransferKey) -> Option<watch::Receiver<bool>> {
        let mut inner = self.inner.lock();
        let waiter = inner.running.get(&key).map(|r| {
            r.cancel.cancel();
            r.closed.clone()
        });
        if inner.tombstones.insert(key.clone()) {
            inner.tombstone_order.push_back(key);
            while inner.tombstone_order.len() > MAX_TOMBSTONES {
                if let Some(old) = inner.tombstone_order.pop_front() {
                    inner.tombstones.remove(&old);
                }
            }
        }
        waiter
    }

    /// Transfers whose writer is not closed yet.
    pub fn running(&self) -> usize {
        self.inner.lock().running.len()
    }

    fn closed(&self, key: &TransferKey) {
        self.inner.lock().running.remove(key);
    }
}

/// A running transfer: owns its writer; cancelled by `AbortPrefill`. Dropping it closes the
/// writer (after a flush, in the background) and only then marks the transfer closed.
pub struct TransferTicket {
    key: Option<TransferKey>,
    transfers: Arc<Transfers>,
    cancel: CancellationToken,
    closed: Option<watch::Sender<bool>>,
    writer: Option<Box<dyn BlockWriter>>,
    /// Runs once the writer is closed, before the transfer counts as closed (the prefill
    /// worker releases the blocks it sent from).
    on_closed: Option<Box<dyn FnOnce() + Send>>,
}

impl std::fmt::Debug for TransferTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferTicket")
            .field("key", &self.key)
            .field("writer", &self.writer)
            .finish_non_exhaustive()
    }
}

impl TransferTicket {
    /// Sets what runs once the writer is closed.
    pub fn on_closed(&mut self, f: impl FnOnce() + Send + 'static) {
        self.on_closed = Some(Box::new(f));
    }

    /// Cancelled when the caller aborts the transfer.
    pub fn cancelled(&self) -> CancellationToken {
        self.cancel.clone()
    }

    pub fn set_writer(&mut self, writer: Box<dyn BlockWriter>) {
        self.writer = Some(writer);
    }

    pub fn writer(&mut self) -> Option<&mut Box<dyn BlockWriter>> {
        self.writer.as_mut()
    }
}

impl Drop for TransferTicket {
    fn drop(&mut self) {
        let (Some(key), Some(closed)) = (self.key.take(), self.closed.take()) else {
            return;
        };
        let transfers = self.transfers.clone();
        let on_closed = self.on_closed.take();
        let finish = move || {
            if let Some(f) = on_closed {
                f();
            }
            transfers.closed(&key);
            // Nobody may be waiting: the send only fails then.
            let _ = closed.send(true);
        };
        match (self.writer.take(), tokio::runtime::Handle::try_current()) {
            (Some(mut writer), Ok(rt)) => {
                rt.spawn(async move {
                    // Puts still in flight land (or fail) before the transfer counts as closed.
                    if let Err(e) = tokio::time::timeout(CLOSE_FLUSH_TIMEOUT, writer.flush()).await
                    {
                        tracing::warn!(error = %e, "closing a KV writer: flush timed out");
                    }
                    drop(writer);
                    finish();
                });
            }
            // No writer, or no runtime left to flush on (the process is ending).
            _ => finish(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: u64) -> TransferKey {
        (id, "kvt1:dest".to_string())
    }

    #[tokio::test]
    async fn an_abort_waits_for_the_writer_and_blocks_a_late_start() {
        let t = Arc::new(Transfers::new(CancellationToken::new()));
        let ticket = t.start(key(1)).unwrap();
        assert!(t.start(key(1)).is_err(), "one transfer per key");
        let cancelled = ticket.cancelled();
        let mut closed = t.abort(key(1)).expect("running");
        assert!(cancelled.is_cancelled());
        assert!(!*closed.borrow());
        drop(ticket);
        closed.wait_for(|c| *c).await.unwrap();
        assert_eq!(t.running(), 0);
        assert!(t.start(key(1)).is_err(), "aborted: refused afterwards");

        // Aborted before it ever started: nothing to wait for, and refused when it comes.
        assert!(t.abort(key(2)).is_none());
        assert!(t.start(key(2)).is_err());
        // Finished normally: nothing to wait for.
        drop(t.start(key(3)).unwrap());
        assert!(t.abort(key(3)).is_none());
    }

    #[tokio::test]
    async fn tombstones_are_bounded() {
        let t = Arc::new(Transfers::new(CancellationToken::new()));
        for id in 0..(MAX_TOMBSTONES as u64 + 10) {
            t.abort(key(id));
        }
        assert!(t.start(key(0)).is_ok(), "the oldest tombstone was dropped");
        assert!(t.start(key(MAX_TOMBSTONES as u64 + 9)).is_err());
    }
}
