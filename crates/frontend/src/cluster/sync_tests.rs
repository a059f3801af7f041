//! Replica sync's presence rule on the in-memory event plane, on paused time.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tandem_protocol::{Envelope, RequestId};
use tandem_router::{RouterId, SyncHello, SyncMessage};
use tandem_runtime::events::memory::MemoryEventPlane;
use tandem_runtime::events::{EventPlane, Subscription, subjects};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{HELLO_EVERY, PEER_TTL, ReplicaSync};

const NS: &str = "sync-test";

fn free(router: u64, request: u64) -> SyncMessage {
    SyncMessage::Free {
        router: RouterId(router),
        request: RequestId(request),
    }
}

/// A replica whose applied peer messages are recorded.
async fn replica(
    me: u64,
    events: &Arc<dyn EventPlane>,
    tasks: &TaskTracker,
    stop: &CancellationToken,
) -> (ReplicaSync, Arc<Mutex<Vec<SyncMessage>>>, Gauge) {
    let applied = Arc::new(Mutex::new(Vec::new()));
    let a = applied.clone();
    let gauge = Gauge::default();
    let sync = ReplicaSync::start(
        RouterId(me),
        NS,
        events.clone(),
        move |m: &SyncMessage| a.lock().push(m.clone()),
        gauge.clone(),
        (tasks, stop.clone()),
    )
    .await
    .unwrap();
    (sync, applied, gauge)
}

/// The next message on `sub` within `wait`, decoded.
async fn next<T: Envelope>(sub: &mut Subscription, wait: Duration) -> Option<T> {
    let bytes = tokio::time::timeout(wait, sub.next()).await.ok()??;
    Some(T::decode(&bytes).unwrap())
}

async fn hello_from(sub: &mut Subscription, router: u64, wait: Duration) -> Option<SyncHello> {
    let until = tokio::time::Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(tokio::time::Instant::now());
        let h: SyncHello = next(sub, left).await?;
        if h.router == RouterId(router) {
            return Some(h);
        }
    }
}

async fn say_hello(events: &Arc<dyn EventPlane>, router: u64, answer: bool) {
    let hello = SyncHello {
        router: RouterId(router),
        answer,
    };
    let subject = subjects::router_hello(NS);
    events
        .publish(&subject, hello.encode().unwrap().into())
        .await
        .unwrap();
}

fn plane() -> Arc<dyn EventPlane> {
    Arc::new(MemoryEventPlane::new())
}

#[tokio::test(start_paused = true)]
async fn a_lone_replica_says_hello_and_publishes_no_sync() {
    let (events, tasks, stop) = (plane(), TaskTracker::new(), CancellationToken::new());
    let mut hellos = events.subscribe(&subjects::router_hello(NS)).await.unwrap();
    let mut syncs = events.subscribe(&subjects::router_sync(NS)).await.unwrap();
    let (a, _, _) = replica(1, &events, &tasks, &stop).await;
    let first = hello_from(&mut hellos, 1, Duration::from_millis(10)).await;
    assert_eq!(
        first.map(|h| h.answer),
        Some(false),
        "it announces itself at start"
    );
    for i in 0..10 {
        a.send(free(1, i));
    }
    assert!(!a.has_peers());
    let got: Option<SyncMessage> = next(&mut syncs, 3 * HELLO_EVERY).await;
    assert_eq!(got, None, "nothing published with no peer");
    // It keeps saying hello.
    assert!(hello_from(&mut hellos, 1, HELLO_EVERY * 2).await.is_some());
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_newcomers_hello_is_answered_at_once_and_turns_the_sync_on_until_it_falls_silent() {
    let (events, tasks, stop) = (plane(), TaskTracker::new(), CancellationToken::new());
    let mut hellos = events.subscribe(&subjects::router_hello(NS)).await.unwrap();
    let mut syncs = events.subscribe(&subjects::router_sync(NS)).await.unwrap();
    let (a, _, peers) = replica(1, &events, &tasks, &stop).await;
    let announce = hello_from(&mut hellos, 1, Duration::from_millis(50)).await;
    assert_eq!(announce.map(|h| h.answer), Some(false));
    say_hello(&events, 2, false).await;
    // The answer comes well before the next periodic hello.
    let answer = hello_from(&mut hellos, 1, Duration::from_millis(20)).await;
    assert_eq!(answer.map(|h| h.answer), Some(true));
    assert!(a.has_peers());
    assert_eq!(peers.get(), 1);
    a.send(free(1, 7));
    let got: Option<SyncMessage> = next(&mut syncs, Duration::from_millis(20)).await;
    assert_eq!(got, Some(free(1, 7)));
    // A peer heard before is not answered again.
    say_hello(&events, 2, false).await;
    let again = hello_from(&mut hellos, 1, Duration::from_millis(20)).await;
    assert_eq!(again, None);
    // An answer is not answered either.
    say_hello(&events, 3, true).await;
    assert_eq!(
        hello_from(&mut hellos, 1, Duration::from_millis(20)).await,
        None
    );
    // Once no peer has been heard for the TTL, nothing is published again.
    assert_eq!(peers.get(), 2, "the answer's sender counts too");
    tokio::time::sleep(PEER_TTL + HELLO_EVERY + Duration::from_millis(100)).await;
    assert!(!a.has_peers());
    assert_eq!(peers.get(), 0);
    while next::<SyncMessage>(&mut syncs, Duration::ZERO)
        .await
        .is_some()
    {}
    a.send(free(1, 8));
    let got: Option<SyncMessage> = next(&mut syncs, 2 * HELLO_EVERY).await;
    assert_eq!(got, None);
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn two_replicas_find_each_other_and_apply_only_each_others_messages() {
    let (events, tasks, stop) = (plane(), TaskTracker::new(), CancellationToken::new());
    let (a, applied_a, _) = replica(1, &events, &tasks, &stop).await;
    // B starts later: its hello is answered at once, so both publish without waiting for
    // a periodic hello.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (b, applied_b, _) = replica(2, &events, &tasks, &stop).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(a.has_peers() && b.has_peers());
    a.send(free(1, 1));
    b.send(free(2, 2));
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(*applied_a.lock(), vec![free(2, 2)]);
    assert_eq!(*applied_b.lock(), vec![free(1, 1)]);
    // The periodic hellos keep them present.
    tokio::time::sleep(PEER_TTL * 3).await;
    assert!(a.has_peers() && b.has_peers());
    stop.cancel();
}

#[tokio::test(start_paused = true)]
async fn a_sync_message_from_a_replica_that_says_no_hello_counts_as_presence() {
    // A replica of an older build publishes its sync messages and says no hello.
    let (events, tasks, stop) = (plane(), TaskTracker::new(), CancellationToken::new());
    let (a, applied, _) = replica(1, &events, &tasks, &stop).await;
    let subject = subjects::router_sync(NS);
    events
        .publish(&subject, free(9, 4).encode().unwrap().into())
        .await
        .unwrap();
    // Garbage on either subject is skipped.
    events
        .publish(&subject, vec![1, 2, 3].into())
        .await
        .unwrap();
    let hello = subjects::router_hello(NS);
    events.publish(&hello, vec![1, 2, 3].into()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(*applied.lock(), vec![free(9, 4)]);
    assert!(a.has_peers());
    stop.cancel();
}
