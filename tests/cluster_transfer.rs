//! Exact KV transfer on real processes (DESIGN.md §7): a disaggregated cluster produces the
//! tokens of an aggregated one over each KV transport, and a corrupted transfer is caught.
//!
//! Each test starts its own etcd, NATS and `tandem` processes (see `common::cluster`), so
//! tests share nothing but the machine; they run one at a time all the same
//! (`common::chat::serial`). Eventual conditions are polled with deadlines; no timing is
//! asserted beyond "ends within a bound" (CONVENTIONS 10).

mod common;

use std::time::Duration;

use common::chat::*;
use common::cluster::{Cluster, Options, prefill_id, words};
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
