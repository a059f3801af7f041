//! The gate when a request's client leaves while the pump plans it.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::registry::Registry;
use tandem_router::{FlowConfig, FlowQueue, Priority, RouteError};

use super::{Admission, FlowMetrics, Gate};

/// A plan whose drop wakes the gate, as a real plan's booking does when it ends.
struct Booked(Arc<Gate<(), Booked>>);

impl Drop for Booked {
    fn drop(&mut self) {
        self.0.wake();
    }
}

fn admission() -> Admission {
    Admission {
        tenant: "t".into(),
        priority: Priority::Standard,
        prompt_tokens: 1,
        charged: 2,
        deadline_ms: u64::MAX,
    }
}

/// The client leaves between the pump's check that it is still there and the plan's
/// delivery: the plan comes back undelivered and is dropped — after the queue's lock is
/// released, since dropping it takes that lock. (Dropped under it, the pump deadlocked
/// itself and then every runtime worker that touched the queue: a frontend that served no
/// more requests and ignored SIGTERM, seen under wrk at 32 connections.)
#[test]
fn a_plan_whose_client_left_while_it_was_planned_is_dropped_outside_the_lock() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let queue = FlowQueue::new(FlowConfig::default()).unwrap();
    let metrics = Arc::new(FlowMetrics::register(&mut Registry::default()));
    let gate = Arc::new(Gate::new(queue, metrics));
    let waiting = rt.spawn({
        let gate = gate.clone();
        async move {
            let a = admission();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            // Saturated: the request waits in the queue for the pump.
            let out = gate
                .acquire(&a, (), 0, deadline, |_| Err(RouteError::Saturated))
                .await;
            out.map(|_| ())
        }
    });
    let queued_by = std::time::Instant::now() + Duration::from_secs(10);
    while gate.is_empty() {
        assert!(
            std::time::Instant::now() < queued_by,
            "the request never queued"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let (done, finished) = std::sync::mpsc::channel();
    let pump = gate.clone();
    std::thread::spawn(move || {
        pump.pump(1, |_| {
            // The client leaves while its request is planned: its receiver is gone by the
            // time the plan is sent.
            waiting.abort();
            std::thread::sleep(Duration::from_millis(100));
            Ok(Booked(pump.clone()))
        });
        let _ = done.send(());
    });
    if finished.recv_timeout(Duration::from_secs(10)).is_err() {
        // Deadlocked threads cannot be joined: leave the runtime to the process.
        std::mem::forget(rt);
        panic!("the pump deadlocked on the queue's lock");
    }
    // The request is out of the queue, and the gate still takes requests.
    assert!(gate.is_empty());
    let a = admission();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
    let planned = rt.block_on(gate.acquire(&a, (), 2, deadline, |_| Ok(Booked(gate.clone()))));
    assert!(planned.is_ok());
}
