//! Exact KV transfer on real processes (docs/ARCHITECTURE.md §7): a disaggregated cluster produces the
//! tokens of an aggregated one over each KV transport, and a corrupted transfer is caught.
//!
//! Each test starts its own etcd, NATS and `tandem` processes (see `common::cluster`), so
//! tests share nothing but the machine; they run one at a time all the same
//! (`common::chat::serial`). Eventual conditions are polled with deadlines; no timing is
//! asserted beyond "ends within a bound" (docs/CONVENTIONS.md §10).

use tandem_test_support as common;

use std::time::Duration;

use common::chat::*;
use common::cluster::{Cluster, Options, prefill_id};
use common::words;
use serde_json::json;

/// The mocker's tokens depend on a digest of every KV byte: a disaggregated cluster (every
/// prompt prefilled remotely, its KV moved by `transport`) must produce exactly the tokens
/// of an aggregated one. With `corrupt`, the prefill workers flip a byte of every transfer:
/// the decode worker's digest check must catch it and prefill locally, with the same tokens.
fn disaggregated_equals_aggregated(transport: &'static str, corrupt: bool) {
    let _serial = serial();
    let mut req = chat(&words(5, 2500), "Continue.", 48);
    req["seed"] = json!(1234);
    let mut texts = Vec::new();
    for mode in ["always", "never"] {
        let c = Cluster::start(
            &format!("mode-{mode}-{transport}-{corrupt}"),
            Options {
                prefill: 1,
                decode: 1,
                disagg: mode,
                kv_transport: transport,
                corrupt_transfers: corrupt,
                ..Options::default()
            },
        );
        let r = c.chat(&req);
        assert_eq!(r.completion.usage.completion_tokens, 48);
        if mode == "always" {
            assert_eq!(r.prefill, Some(prefill_id(0)));
            let outcome = |o: &str| {
                c.metrics()
                    .0
                    .get(&format!("tandem_prefills_total{{outcome=\"{o}\"}}"))
                    .copied()
                    .unwrap_or(0.0)
            };
            let log = c.workers.iter().find(|w| w.role == "decode").unwrap().log();
            if corrupt {
                assert_eq!(outcome("fallback"), 1.0, "the corruption went unnoticed");
                assert!(log.contains("digest mismatch"), "{log}");
            } else {
                assert_eq!(outcome("remote"), 1.0);
                assert!(
                    !log.contains("remote prefill failed"),
                    "the decode worker fell back:\n{log}"
                );
                // The KV really came from the prefill worker: it holds the prompt's blocks.
                let prompt = r.completion.usage.prompt_tokens;
                c.wait_metrics(
                    "both workers' blocks in the index",
                    Duration::from_secs(15),
                    |m| m.index_entries() >= 2 * blocks(prompt),
                );
            }
        } else {
            assert_eq!(r.prefill, None);
            // The tokens depend on the seed: equal texts below are not a coincidence.
            let mut other = req.clone();
            other["seed"] = json!(1235);
            assert_ne!(c.chat(&other).content(), r.content());
        }
        texts.push(r.content().to_string());
    }
    assert_eq!(
        texts[0], texts[1],
        "{transport}: the disaggregated output differs from the aggregated one"
    );
}

#[test]
fn disaggregated_output_equals_aggregated_over_ucx() {
    disaggregated_equals_aggregated("ucx", false);
}

#[test]
fn disaggregated_output_equals_aggregated_over_tcp() {
    disaggregated_equals_aggregated("tcp", false);
}

#[test]
fn disaggregated_output_equals_aggregated_inline() {
    disaggregated_equals_aggregated("inline", false);
}

#[test]
fn a_corrupted_transfer_falls_back_to_the_same_output() {
    disaggregated_equals_aggregated("ucx", true);
}

/// A decode worker killed (-9) while a prefill worker computes and writes a prompt's KV
/// into it: the prefill worker ends the transfer and holds no block afterwards (the blocks it
/// sends from stay pinned only until its writer is closed).
#[test]
fn a_decode_worker_killed_mid_transfer_leaves_no_blocks_on_the_prefill_worker() {
    use tandem_protocol::LoadReport;
    use tandem_runtime::events::{EventPlane, NatsConfig, NatsEventPlane, subjects};

    let _serial = serial();
    // Slow steps: the ~7k-token prompt takes seconds to prefill, so the kill lands mid-way.
    let mut c = Cluster::start(
        "kill-mid-transfer",
        Options {
            prefill: 1,
            decode: 1,
            disagg: "always",
            speedup: 0.1,
            ..Options::default()
        },
    );
    let plane =
        c.rt.block_on(NatsEventPlane::connect(NatsConfig {
            url: c.nats.url(),
            ..NatsConfig::default()
        }))
        .unwrap();
    let mut loads =
        c.rt.block_on(plane.subscribe(&subjects::load_reports(&c.namespace)))
            .unwrap();
    let prefill = prefill_id(0);
    let addr = c.addr;
    let body = chat(&words(8, 6000), "Summarise.", 8).to_string();
    let request =
        std::thread::spawn(move || common::http::post_json(addr, "/v1/chat/completions", &body));
    let report =
        |loads: &mut _, rt: &tokio::runtime::Runtime, what: &str, f: fn(&LoadReport) -> bool| {
            wait_report(rt, loads, prefill, what, f)
        };
    report(&mut loads, &c.rt, "prefilling", |r| {
        r.running_requests == 1 && r.kv_active_blocks > 0
    });
    c.worker(common::cluster::decode_id(0)).kill9();
    report(&mut loads, &c.rt, "idle after the kill", |r| {
        r.running_requests == 0 && r.waiting_requests == 0 && r.kv_active_blocks == 0
    });
    assert!(
        c.worker(prefill).is_running(),
        "the prefill worker survives"
    );
    // The request ends (no decode worker is left to serve it), it does not hang.
    let answer = request.join().expect("the request thread");
    assert!(answer.is_ok_and(|r| r.status != 200));
}

/// Waits up to 20 s for a load report of `worker` satisfying `f`.
fn wait_report(
    rt: &tokio::runtime::Runtime,
    loads: &mut tandem_runtime::events::Subscription,
    worker: u64,
    what: &str,
    f: fn(&tandem_protocol::LoadReport) -> bool,
) {
    use tandem_protocol::Envelope;
    rt.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let bytes = tokio::time::timeout_at(deadline, loads.next())
                .await
                .unwrap_or_else(|_| panic!("no load report of worker {worker} {what}"))
                .expect("the subscription lives");
            let r = tandem_protocol::LoadReport::decode(&bytes).unwrap();
            if r.worker_id.0 == worker && f(&r) {
                return;
            }
        }
    })
}
