//! The event plane: fire-and-forget pub/sub of byte payloads by subject.
//!
//! Used for KV events, load reports and router replica sync (codecs live above, in
//! `tandem_protocol`). Two implementations: [`NatsEventPlane`] (core NATS, no JetStream) and
//! [`MemoryEventPlane`] (in-process). Delivery is at most once: a publisher gets no ack, a
//! disconnected or lagging subscriber loses messages. Consumers therefore detect gaps by the
//! per-source event ids carried in the payloads and resync (docs/CONVENTIONS.md §7); they never assume a
//! complete stream.
//!
//! Subjects are dot-separated tokens ([`subjects`]). The memory plane matches subjects exactly;
//! NATS additionally understands its `*` / `>` wildcards in subscriptions.

pub mod faults;
pub mod memory;
pub mod nats;

use std::pin::Pin;
use std::task::{Context, Poll};

use async_trait::async_trait;
use bytes::Bytes;
use futures::Stream;
use futures::stream::BoxStream;

use crate::error::RuntimeError;

pub use faults::{EventFaults, FaultyEventPlane};
pub use memory::MemoryEventPlane;
pub use nats::{NatsAuth, NatsConfig, NatsEventPlane};

/// Publish and subscribe by subject.
#[async_trait]
pub trait EventPlane: Send + Sync + 'static {
    /// Publishes `payload` on `subject`. Never blocks unboundedly: when the transport cannot take
    /// the message (NATS down and its buffer full) the call fails after a bounded wait.
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), RuntimeError>;

    /// Subscribes to `subject`. Messages published after this returns are delivered (subject to
    /// the at-most-once caveats above).
    async fn subscribe(&self, subject: &str) -> Result<Subscription, RuntimeError>;
}

/// A stream of payloads from one subscription. Dropping it unsubscribes.
///
/// Use it as a [`futures::Stream`] (it is `Unpin`) or call [`Subscription::next`]. It ends
/// (`None`) only when the plane itself is gone; NATS subscriptions survive reconnections.
pub struct Subscription {
    subject: String,
    inner: BoxStream<'static, Bytes>,
}

impl Subscription {
    /// A subscription to `subject` reading from `inner`.
    pub fn new(subject: impl Into<String>, inner: BoxStream<'static, Bytes>) -> Self {
        Subscription {
            subject: subject.into(),
            inner,
        }
    }

    /// The subject subscribed to.
    pub fn subject(&self) -> &str {
        &self.subject
    }

    /// The next payload; `None` when the subscription has ended.
    pub async fn next(&mut self) -> Option<Bytes> {
        futures::StreamExt::next(&mut self.inner).await
    }
}

impl Stream for Subscription {
    type Item = Bytes;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription")
            .field("subject", &self.subject)
            .finish_non_exhaustive()
    }
}

/// The subjects tandem uses, all under `tandem.<namespace>.`.
pub mod subjects {
    /// KV events from every worker: `tandem.<ns>.kv-events`.
    pub fn kv_events(namespace: &str) -> String {
        format!("tandem.{namespace}.kv-events")
    }

    /// Periodic load reports: `tandem.<ns>.load`.
    pub fn load_reports(namespace: &str) -> String {
        format!("tandem.{namespace}.load")
    }

    /// Active-sequence deltas shared between frontend replicas: `tandem.<ns>.router-sync`.
    pub fn router_sync(namespace: &str) -> String {
        format!("tandem.{namespace}.router-sync")
    }

    /// Frontend replicas' presence, so that a lone one publishes no sync:
    /// `tandem.<ns>.router-hello`.
    pub fn router_hello(namespace: &str) -> String {
        format!("tandem.{namespace}.router-hello")
    }
}

/// Checks a subject for publishing: non-empty dot-separated tokens, no whitespace, no wildcard.
pub(crate) fn validate_subject(subject: &str, allow_wildcards: bool) -> Result<(), RuntimeError> {
    let bad = subject.is_empty()
        || subject.split('.').any(|token| {
            token.is_empty()
                || token.chars().any(char::is_whitespace)
                || (!allow_wildcards && (token == "*" || token == ">"))
        });
    if bad {
        return Err(RuntimeError::InvalidRequest(format!(
            "invalid subject {subject:?}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_faulty_plane_drops_duplicates_and_reorders_only_its_subjects() {
        let inner = std::sync::Arc::new(MemoryEventPlane::new());
        let faults: EventFaults = "drop=0.2,duplicate=0.2,reorder=0.2,seed=3".parse().unwrap();
        let plane = FaultyEventPlane::new(inner.clone(), faults, &[".kv-events"]);
        let mut kv = plane.subscribe("tandem.t.kv-events").await.unwrap();
        let mut load = plane.subscribe("tandem.t.load").await.unwrap();
        for i in 0..200u32 {
            plane
                .publish("tandem.t.kv-events", Bytes::from(i.to_le_bytes().to_vec()))
                .await
                .unwrap();
            plane
                .publish("tandem.t.load", Bytes::from(i.to_le_bytes().to_vec()))
                .await
                .unwrap();
        }
        tokio::time::sleep(faults::REORDER_FLUSH * 2).await;
        let c = plane.counts();
        assert_eq!(c.published, 200);
        assert!(
            c.dropped > 10 && c.duplicated > 10 && c.reordered > 10,
            "{c:?}"
        );
        let mut got = Vec::new();
        while let Ok(Some(b)) =
            tokio::time::timeout(std::time::Duration::from_millis(50), kv.next()).await
        {
            got.push(u32::from_le_bytes(b[..4].try_into().unwrap()));
        }
        assert_eq!(got.len() as u64, 200 - c.dropped + c.duplicated);
        assert!(
            got.windows(2).any(|w| w[1] < w[0]),
            "something came out of order"
        );
        // Other subjects pass untouched.
        for i in 0..200u32 {
            let b = load.next().await.unwrap();
            assert_eq!(u32::from_le_bytes(b[..4].try_into().unwrap()), i);
        }
        assert!("drop=2".parse::<EventFaults>().is_err());
        assert!("flip=0.1".parse::<EventFaults>().is_err());
    }

    #[test]
    fn subscription_is_an_unpin_stream_and_planes_are_shareable() {
        fn stream<S: Stream<Item = Bytes> + Unpin + Send + 'static>() {}
        fn send_sync<T: Send + Sync + 'static>() {}
        stream::<Subscription>();
        send_sync::<std::sync::Arc<dyn EventPlane>>();
        send_sync::<NatsEventPlane>();
        send_sync::<MemoryEventPlane>();
    }

    #[test]
    fn subject_names() {
        assert_eq!(subjects::kv_events("ns"), "tandem.ns.kv-events");
        assert_eq!(subjects::load_reports("ns"), "tandem.ns.load");
        assert_eq!(subjects::router_sync("ns"), "tandem.ns.router-sync");
        assert_eq!(subjects::router_hello("ns"), "tandem.ns.router-hello");
    }

    #[test]
    fn subject_validation() {
        assert!(validate_subject("tandem.ns.load", false).is_ok());
        assert!(validate_subject("", false).is_err());
        assert!(validate_subject("a..b", false).is_err());
        assert!(validate_subject("a b", false).is_err());
        assert!(validate_subject("a.*", false).is_err());
        assert!(validate_subject("a.*", true).is_ok());
    }
}
