//! A real Prometheus (Debian's `prometheus`) scrapes a running cluster — the frontend's
//! `/metrics` and each worker's own, found through their discovery records — and every
//! PromQL expression that deploy/ uses (the Grafana dashboard's panels, the autoscalers'
//! queries) evaluates to data.

use tandem_test_support as common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::chat::{chat, serial, streamed};
use common::cluster::{Cluster, Options, wait_for};
use common::http;
use common::metrics::Metrics;
use common::words;
use serde_json::Value;

/// A Prometheus server on a free loopback port; killed on drop.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    /// Starts it scraping `jobs` (job name → targets) every second.
    fn start(dir: &Path, jobs: &[(&str, Vec<String>)]) -> Prometheus {
        let mut config = String::from(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n",
        );
        for (job, targets) in jobs {
            let list: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
            config.push_str(&format!(
                "  - job_name: {job}\n    static_configs:\n      - targets: [{}]\n",
                list.join(", ")
            ));
        }
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let port = tandem_runtime::external::free_port().unwrap();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let log = dir.join("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect(
                "starting prometheus (Debian's `prometheus` package; scripts/test.sh installs it)",
            );
        Prometheus { child, addr, log }
    }

    /// The result vector of an instant query (None while Prometheus is not answering).
    fn query(&self, expr: &str) -> Option<Vec<Value>> {
        let path = format!("/api/v1/query?query={}", percent_encode(expr));
        let r = http::get(self.addr, &path).ok()?;
        let v: Value = serde_json::from_str(&r.text()).ok()?;
        assert_eq!(
            v["status"],
            "success",
            "query {expr:?} failed: {v}\n(log: {})",
            self.log.display()
        );
        v["data"]["result"].as_array().cloned()
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Every PromQL expression deploy/ uses: the Grafana dashboards' `targets[].expr`, the
/// `query:` of every KEDA trigger and the prometheus-adapter rules' queries, with Grafana's
/// interval variables set to one minute.
fn deploy_expressions() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let mut out = Vec::new();
    let mut files = Vec::new();
    collect_files(&root, &mut files);
    for file in files {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(&file).unwrap();
        match file.extension().and_then(|e| e.to_str()) {
            Some("json") => {
                let v: Value = serde_json::from_str(&text)
                    .unwrap_or_else(|e| panic!("{name} is not JSON: {e}"));
                let mut exprs = Vec::new();
                json_exprs(&v, &mut exprs);
                out.extend(exprs.into_iter().map(|e| (name.clone(), e)));
            }
            Some("yaml" | "yml") => {
                out.extend(yaml_queries(&text).into_iter().map(|e| (name.clone(), e)));
            }
            _ => {}
        }
    }
    out.into_iter()
        .map(|(f, e)| {
            let e = e
                .replace("$__rate_interval", "1m")
                .replace("$__interval", "1m")
                .replace("$__range", "1m");
            (f, e)
        })
        .collect()
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect_files(&p, out);
        } else {
            out.push(p);
        }
    }
}

/// `expr` fields anywhere in a Grafana dashboard.
fn json_exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", Value::String(s)) if !s.trim().is_empty() => out.push(s.clone()),
                    _ => json_exprs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| json_exprs(v, out)),
        _ => {}
    }
}

/// The values of `query:` (KEDA's Prometheus triggers) and `seriesQuery:` / `metricsQuery:`
/// (prometheus-adapter rules) keys in a YAML file: plain, quoted or as a block scalar.
fn yaml_queries(text: &str) -> Vec<String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let trimmed = line.trim_start();
        let key = trimmed.trim_start_matches("- ");
        let value = ["query:", "metricsQuery:", "seriesQuery:"]
            .iter()
            .find_map(|k| key.strip_prefix(k));
        if let Some(rest) = value {
            let rest = rest.trim();
            if rest.starts_with('|') || rest.starts_with('>') {
                let indent = line.len() - trimmed.len();
                let mut body = Vec::new();
                while i + 1 < lines.len() {
                    let next = lines[i + 1];
                    let next_indent = next.len() - next.trim_start().len();
                    if !next.trim().is_empty() && next_indent <= indent {
                        break;
                    }
                    body.push(next.trim());
                    i += 1;
                }
                out.push(body.join(" ").trim().to_string());
            } else {
                let unquoted = if let Some(single) =
                    rest.strip_prefix('\'').and_then(|r| r.strip_suffix('\''))
                {
                    single.replace("''", "'")
                } else if let Some(double) =
                    rest.strip_prefix('"').and_then(|r| r.strip_suffix('"'))
                {
                    double.replace("\\\"", "\"")
                } else {
                    rest.to_string()
                };
                out.push(unquoted);
            }
        }
        i += 1;
    }
    out
}

fn traffic(c: &Cluster, seed: u64, n: usize) {
    for i in 0..n {
        let shared = words(seed, 120);
        let body = chat(&shared, &words(seed * 100 + i as u64, 8), 24);
        let body = if i % 2 == 0 { streamed(body) } else { body };
        let r = c.post("/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
    }
}

#[test]
fn prometheus_scrapes_the_cluster_and_every_deploy_expression_has_data() {
    let _serial = serial();
    let mut c = Cluster::start(
        "prometheus",
        Options {
            prefill: 1,
            decode: 2,
            disagg: "always",
            kv_transport: "tcp",
            worker_args: vec!["--metrics-addr=127.0.0.1:0".into()],
            ..Options::default()
        },
    );
    let workers = c.worker_metrics_addrs();
    assert_eq!(workers.len(), 3, "{workers:?}");

    // The workers' own series, read straight from them before Prometheus does. Every
    // prompt went remote: the prefill worker computed the prompts, looked them up in its
    // prefix cache, published their blocks and sent their KV; the decode workers received
    // the KV and generated.
    traffic(&c, 1, 6);
    let model = "{model_name=\"mocker\"}";
    let mut decode_sum = [0.0f64; 6];
    for (role, addr) in &workers {
        let addr: SocketAddr = addr.parse().unwrap();
        let m = Metrics::parse(&http::get(addr, "/metrics").unwrap().text());
        let usage = m.get(&format!("vllm:kv_cache_usage_perc{model}"));
        assert!((0.0..=1.0).contains(&usage), "{role}: {usage}");
        assert_eq!(m.get("tandem_worker_draining"), 0.0);
        assert!(m.get(&format!("vllm:num_requests_running{model}")) >= 0.0);
        if role == "prefill" {
            assert!(m.get(&format!("vllm:prompt_tokens_total{model}")) > 0.0);
            assert!(m.get(&format!("vllm:prefix_cache_queries_total{model}")) > 0.0);
            assert!(m.get("tandem_worker_kv_events_published_total") > 0.0);
            assert!(m.get("tandem_worker_kv_transfer_bytes_total{direction=\"sent\"}") > 0.0);
            // The traffic just ran: its prompts are within the last 10 s.
            assert!(m.get("tandem_worker_tokens_per_second{kind=\"prompt\"}") > 0.0);
            assert!(m.get("tandem_worker_step_tokens_count") > 0.0);
        } else {
            decode_sum[0] += m.get(&format!("vllm:generation_tokens_total{model}"));
            decode_sum[1] += m.get("tandem_worker_kv_transfer_bytes_total{direction=\"received\"}");
            decode_sum[2] += m.get("tandem_worker_tokens_per_second{kind=\"generation\"}");
            decode_sum[3] += m.get("tandem_worker_step_requests_count");
            decode_sum[4] += m.get("tandem_worker_kv_transfer_blocks_total{kind=\"moved\"}");
            decode_sum[5] += m.get("tandem_worker_kv_transfer_blocks_total{kind=\"held\"}");
            assert_eq!(m.get("tandem_worker_kv_transfer_fallbacks_total"), 0.0);
        }
    }
    assert!(decode_sum[0] > 0.0, "the decode workers generated nothing");
    assert!(decode_sum[1] > 0.0, "no decode worker received KV");
    assert!(decode_sum[2] > 0.0, "no recent generation rate");
    assert!(decode_sum[3] > 0.0, "no decode steps counted");
    // The transfers are paged: a decode worker that already held the shared prefix (six
    // requests on two workers: one served two at least) was sent only the rest.
    assert!(decode_sum[4] > 0.0, "no blocks moved");
    assert!(decode_sum[5] > 0.0, "every block was sent, even those held");
    let front = c.metrics();
    // The frontend counts the same held prefix, in tokens, from the first chunks.
    assert_eq!(
        front.get("tandem_remote_prefill_tokens_total{kind=\"held\"}"),
        16.0 * decode_sum[5]
    );
    assert!(front.get("tandem_remote_prefill_tokens_total{kind=\"moved\"}") > 0.0);
    assert!(front.get("tandem_router_overhead_seconds_count{phase=\"total\"}") >= 6.0);
    assert!(front.get("tandem_http_inter_token_latency_seconds_count") > 0.0);
    assert!(front.get("tandem_http_time_per_output_token_seconds_count") > 0.0);

    // Prometheus scrapes the frontend and every worker.
    let frontend = c.admin_of(0).to_string();
    let by_role = |want: &str| -> Vec<String> {
        workers
            .iter()
            .filter(|(role, _)| role == want)
            .map(|(_, a)| a.clone())
            .collect()
    };
    let prom = Prometheus::start(
        &c.dir,
        &[
            ("tandem-frontend", vec![frontend]),
            ("tandem-prefill", by_role("prefill")),
            ("tandem-decode", by_role("decode")),
        ],
    );
    wait_for("every target up", Duration::from_secs(60), || {
        let up = prom.query("up == 1")?;
        (up.len() == 4).then_some(())
    });
    // Traffic while Prometheus scrapes: rates need samples on both sides of it.
    for round in 0..4 {
        traffic(&c, 10 + round, 4);
        std::thread::sleep(Duration::from_millis(1200));
    }

    let exprs = deploy_expressions();
    let files: BTreeSet<&str> = exprs.iter().map(|(f, _)| f.as_str()).collect();
    assert!(
        exprs.len() >= 8,
        "deploy/ should hold the dashboards' and autoscalers' expressions: found {exprs:?}"
    );
    let mut empty = Vec::new();
    for (file, expr) in &exprs {
        let result = wait_for(
            &format!("{expr} to answer"),
            Duration::from_secs(20),
            || prom.query(expr),
        );
        if result.is_empty() {
            empty.push(format!("{file}: {expr}"));
        }
    }
    assert!(
        empty.is_empty(),
        "expressions without data (of {} in {files:?}):\n{}\n(Prometheus log: {})",
        exprs.len(),
        empty.join("\n"),
        prom.log.display()
    );
    // And the new series are in Prometheus with values, not only present.
    for expr in [
        "sum(tandem_router_overhead_seconds_count{phase=\"total\"}) > 0",
        "sum(rate(tandem_http_inter_token_latency_seconds_count[1m])) > 0",
        "sum(vllm:generation_tokens_total) > 0",
        "sum(tandem_worker_kv_transfer_bytes_total{job=\"tandem-prefill\",direction=\"sent\"}) > 0",
    ] {
        let r = prom.query(expr).expect("prometheus answers");
        assert!(!r.is_empty(), "{expr} is empty");
    }
    drop(prom);
    c.workers.clear();
}
