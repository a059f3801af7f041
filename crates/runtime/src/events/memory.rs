//! In-process event plane: one bounded tokio broadcast channel per subject.
//!
//! A subscriber that falls more than `capacity` messages behind loses the oldest ones (tokio
//! broadcast lag semantics; logged at debug) and continues with what is still buffered, like a
//! slow NATS consumer. Consumers detect the gap by event ids. Subjects match exactly (no
//! wildcards).

use parking_lot::{Mutex, MutexGuard};
use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;

use super::{EventPlane, Subscription, validate_subject};
use crate::error::RuntimeError;

/// Default per-subject buffer, in messages.
pub const DEFAULT_CAPACITY: usize = 4096;

/// An in-process event plane. Cheap to clone; clones share the subjects.
#[derive(Clone)]
pub struct MemoryEventPlane {
    inner: Arc<Inner>,
}

struct Inner {
    capacity: usize,
    subjects: Mutex<HashMap<String, broadcast::Sender<Bytes>>>,
}

impl MemoryEventPlane {
    /// A plane buffering [`DEFAULT_CAPACITY`] messages per subject.
    pub fn new() -> Self {
        Self::with_capacity(DEFAULT_CAPACITY)
    }

    /// A plane buffering `capacity` messages per subject (at least 1).
    pub fn with_capacity(capacity: usize) -> Self {
        MemoryEventPlane {
            inner: Arc::new(Inner {
                capacity: capacity.max(1),
                subjects: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Number of live subscriptions on `subject`.
    pub fn subscriber_count(&self, subject: &str) -> usize {
        self.lock()
            .get(subject)
            .map_or(0, broadcast::Sender::receiver_count)
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, broadcast::Sender<Bytes>>> {
        // Every critical section is a single map operation: a poisoned map is still consistent.
        self.inner.subjects.lock()
    }
}

impl Default for MemoryEventPlane {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for MemoryEventPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryEventPlane")
            .field("capacity", &self.inner.capacity)
            .field("subjects", &self.lock().len())
            .finish()
    }
}

#[async_trait]
impl EventPlane for MemoryEventPlane {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), RuntimeError> {
        validate_subject(subject, false)?;
        let mut subjects = self.lock();
        if let Some(sender) = subjects.get(subject)
            && sender.send(payload).is_err()
        {
            // Nobody listens any more: forget the subject so the map does not grow forever.
            subjects.remove(subject);
        }
        Ok(())
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, RuntimeError> {
        validate_subject(subject, false)?;
        let receiver = self
            .lock()
            .entry(subject.to_string())
            .or_insert_with(|| broadcast::channel(self.inner.capacity).0)
            .subscribe();
        let name = subject.to_string();
        let stream = BroadcastStream::new(receiver).filter_map(move |item| {
            let payload = match item {
                Ok(payload) => Some(payload),
                Err(BroadcastStreamRecvError::Lagged(missed)) => {
                    tracing::debug!(subject = %name, missed, "memory event plane subscriber lagged");
                    None
                }
            };
            futures::future::ready(payload)
        });
        Ok(Subscription::new(subject, stream.boxed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn next(sub: &mut Subscription) -> Bytes {
        tokio::time::timeout(Duration::from_secs(5), sub.next())
            .await
            .expect("message in time")
            .expect("subscription open")
    }

    #[tokio::test]
    async fn fan_out_to_every_subscriber_of_the_subject_only() {
        let plane = MemoryEventPlane::new();
        let mut a = plane.subscribe("tandem.t.load").await.expect("subscribe");
        let mut b = plane.subscribe("tandem.t.load").await.expect("subscribe");
        let mut other = plane
            .subscribe("tandem.t.kv-events")
            .await
            .expect("subscribe");
        plane
            .publish("tandem.t.load", Bytes::from_static(b"one"))
            .await
            .expect("publish");
        assert_eq!(next(&mut a).await, Bytes::from_static(b"one"));
        assert_eq!(next(&mut b).await, Bytes::from_static(b"one"));
        assert!(
            tokio::time::timeout(Duration::from_millis(50), other.next())
                .await
                .is_err()
        );
        assert_eq!(plane.subscriber_count("tandem.t.load"), 2);
        drop(a);
        assert_eq!(plane.subscriber_count("tandem.t.load"), 1);
    }

    #[tokio::test]
    async fn publishing_without_subscribers_is_fine_and_not_replayed() {
        let plane = MemoryEventPlane::new();
        plane
            .publish("tandem.t.load", Bytes::from_static(b"lost"))
            .await
            .expect("publish");
        let mut sub = plane.subscribe("tandem.t.load").await.expect("subscribe");
        plane
            .publish("tandem.t.load", Bytes::from_static(b"seen"))
            .await
            .expect("publish");
        assert_eq!(next(&mut sub).await, Bytes::from_static(b"seen"));
    }

    #[tokio::test]
    async fn a_lagging_subscriber_loses_the_oldest_messages_and_continues() {
        let plane = MemoryEventPlane::with_capacity(4);
        let mut sub = plane.subscribe("s").await.expect("subscribe");
        for i in 0u8..10 {
            plane
                .publish("s", Bytes::from(vec![i]))
                .await
                .expect("publish");
        }
        // Only the newest 4 are left; the gap is visible in the payload ids.
        for expected in 6u8..10 {
            assert_eq!(next(&mut sub).await, Bytes::from(vec![expected]));
        }
    }

    #[tokio::test]
    async fn invalid_subjects_are_refused() {
        let plane = MemoryEventPlane::new();
        assert!(plane.publish("", Bytes::new()).await.is_err());
        assert!(plane.subscribe("a.*").await.is_err());
    }

    #[tokio::test]
    async fn the_map_forgets_subjects_nobody_listens_to() {
        let plane = MemoryEventPlane::new();
        let sub = plane.subscribe("s").await.expect("subscribe");
        drop(sub);
        plane.publish("s", Bytes::new()).await.expect("publish");
        assert_eq!(plane.lock().len(), 0);
    }
}
