//! The PromQL of the dashboards and autoscalers: tandem's metric names only.

use std::collections::BTreeSet;

use serde_json::Value;

use super::*;
use crate::manifests::adapter_rules;

/// The metric names dashboards and autoscalers may use (frontend: `/metrics` on the admin
/// port; workers: `/metrics` on `--metrics-addr`).
const METRICS: &[&str] = &[
    "tandem_http_requests_total",
    "tandem_http_requests_in_flight",
    "tandem_http_time_to_first_token_seconds_bucket",
    "tandem_http_inter_token_latency_seconds_bucket",
    "tandem_http_time_per_output_token_seconds_bucket",
    "tandem_http_request_duration_seconds_bucket",
    "tandem_frontend_queue_depth",
    "tandem_frontend_queue_wait_seconds_bucket",
    "tandem_frontend_rejections_total",
    "tandem_router_overhead_seconds_bucket",
    "tandem_workers",
    "tandem_worker_running_requests",
    "tandem_worker_waiting_requests",
    "tandem_worker_kv_active_blocks",
    "tandem_worker_kv_total_blocks",
    "tandem_http_prompt_tokens_total",
    "tandem_http_cached_tokens_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "tandem_worker_kv_usage_ratio",
];

/// Every PromQL expression of the dashboards and autoscalers, with where it is from.
fn promql_expressions() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let dash: Value = serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana/tandem.json")).unwrap(),
    )
    .unwrap();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            out.push((
                format!("grafana panel {:?}", p["title"]),
                s(t, "expr").to_string(),
            ));
        }
    }
    let keda =
        std::fs::read_to_string(deploy().join("components/keda/scaledobjects.yaml")).unwrap();
    for so in yaml_docs(&keda) {
        for t in at(&so, "spec.triggers").as_array().unwrap() {
            out.push((
                format!("ScaledObject {}", name(&so)),
                s(t, "metadata.query").to_string(),
            ));
        }
    }
    for (metric, q) in adapter_rules() {
        out.push((format!("adapter rule {metric}"), q));
    }
    out
}

#[test]
fn promql_uses_only_tandem_metrics() {
    let exprs = promql_expressions();
    assert!(exprs.len() >= 30, "only {} expressions", exprs.len());
    for (from, e) in &exprs {
        let mut depth = Vec::new();
        for ch in e.chars() {
            match ch {
                '(' | '{' | '[' => depth.push(ch),
                ')' | '}' | ']' => {
                    let open = depth.pop();
                    assert_eq!(
                        open,
                        Some(match ch {
                            ')' => '(',
                            '}' => '{',
                            _ => '[',
                        }),
                        "{from}: unbalanced {e}"
                    );
                }
                _ => {}
            }
        }
        assert!(depth.is_empty(), "{from}: unbalanced {e}");
        let names: Vec<&str> = e
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .filter(|w| w.starts_with("tandem_") || w.starts_with("vllm:"))
            .collect();
        assert!(!names.is_empty(), "{from}: {e} reads no tandem metric");
        for n in names {
            assert!(
                METRICS.contains(&n),
                "{from}: {n} is not one of tandem's metrics"
            );
        }
        assert!(!e.to_lowercase().contains("gpu"), "{from}: {e}");
    }
    // One definition of each autoscaling signal: KEDA's queries are the adapter's.
    let keda: BTreeSet<&str> = exprs
        .iter()
        .filter(|(f, _)| f.starts_with("ScaledObject"))
        .map(|(_, e)| e.as_str())
        .collect();
    let adapter: BTreeSet<&str> = exprs
        .iter()
        .filter(|(f, _)| f.starts_with("adapter"))
        .map(|(_, e)| e.as_str())
        .collect();
    assert_eq!(
        keda, adapter,
        "KEDA triggers and prometheus-adapter rules scale on different queries"
    );
}
