//! Backend groups across real processes: a `tandem up` (cluster A) whose model `chat` is
//! served first by a hosted API (a stand-in on loopback that answers as OpenAI documents a
//! rate limit: 429, `Retry-After`, its error JSON), then by a second `tandem up` (cluster B,
//! under its own model name), then by A's own pool. The 429 spills to cluster B with the
//! headers that say so, and cools the hosted endpoint down; with cluster B gone, A's pool
//! answers; every spill is in A's `/metrics`. Token budgets: a task over its budget is demoted
//! to a batch group (cluster B), a session over its budget refused with 429.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use tandem_test_support as common;

use common::http;
use common::native::up;

/// A hosted API that is out of quota: every request gets OpenAI's 429. Counts them.
fn rate_limited_api() -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            // The request head, then its body (Content-Length), before answering.
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut length = 0;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0; length];
            let _ = reader.read_exact(&mut body);
            counter.fetch_add(1, Ordering::SeqCst);
            let answer = json!({"error": {"message": "Rate limit reached for requests",
                "type": "requests", "param": null, "code": "rate_limit_exceeded"}})
            .to_string();
            let _ = write!(
                stream,
                "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
                 retry-after: 30\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{answer}",
                answer.len()
            );
        }
    });
    (url, seen)
}

fn ask(addr: std::net::SocketAddr) -> http::Response {
    let body = json!({"model": "chat", "messages": [{"role": "user", "content": "Name three colors."}],
                      "max_tokens": 8});
    http::post_json(addr, "/v1/chat/completions", &body.to_string()).unwrap()
}

#[test]
fn a_rate_limited_group_spills_to_another_cluster_then_to_the_own_pool() {
    let (hosted, hosted_seen) = rate_limited_api();
    let b = up("groups-b", "mocker", &["--engine", "mocker"]);
    let dir = common::temp_dir("groups-a-file");
    let file = dir.join("groups.toml");
    std::fs::write(
        &file,
        format!(
            r#"
[[model]]
name = "chat"

  [[model.group]]
  name = "hosted"
    [[model.group.endpoint]]
    url = "{hosted}"

  [[model.group]]
  name = "cluster-b"
    [[model.group.endpoint]]
    url = "http://{}/v1"
    model = "mocker"

  [[model.group]]
  name = "own"
  pool = true
"#,
            b.addr
        ),
    )
    .unwrap();
    let a = up(
        "groups-a",
        "mocker",
        &["--engine", "mocker", "--groups", file.to_str().unwrap()],
    );

    let r = ask(a.addr);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-tandem-group"), Some("cluster-b"));
    assert_eq!(r.header("x-tandem-spillover-from"), Some("hosted"));
    assert_eq!(r.header("x-tandem-spillover-error"), Some("429"));
    assert!(
        r.header("x-tandem-decode-worker").is_some(),
        "cluster B's routing headers come through"
    );
    let v: Value = serde_json::from_str(&r.text()).unwrap();
    assert_eq!(
        v["model"], "mocker",
        "cluster B answered under its own name"
    );
    assert_eq!(hosted_seen.load(Ordering::SeqCst), 1);

    // The hosted endpoint cools down for its Retry-After: not asked again.
    let r = ask(a.addr);
    assert_eq!(r.header("x-tandem-group"), Some("cluster-b"));
    assert_eq!(r.header("x-tandem-spillover-error"), Some("unavailable"));
    assert_eq!(hosted_seen.load(Ordering::SeqCst), 1);

    // Cluster B gone: its endpoint cannot be reached, and A's own pool answers.
    drop(b);
    let r = ask(a.addr);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-tandem-group"), Some("own"));
    assert!(r.header("x-tandem-decode-worker").is_some());

    let metrics = http::get(a.admin, "/metrics").unwrap().text();
    for line in [
        r#"tandem_group_requests_total{model="chat",group="hosted",outcome="spilled"} 1"#,
        r#"tandem_group_requests_total{model="chat",group="cluster-b",outcome="ok"} 2"#,
        r#"tandem_group_requests_total{model="chat",group="own",outcome="ok"} 1"#,
        r#"tandem_group_requests_total{model="chat",group="cluster-b",outcome="unreachable"} 1"#,
        r#"tandem_group_spillovers_total{model="chat",from="hosted",to="cluster-b"} 2"#,
        r#"tandem_group_spillovers_total{model="chat",from="hosted",to="own"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
}

/// `model` asked with `headers`.
fn ask_with(addr: std::net::SocketAddr, model: &str, headers: &[(&str, &str)]) -> http::Response {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "Name three colors."}],
                      "max_tokens": 8});
    http::request(
        addr,
        "POST",
        "/v1/chat/completions",
        Some(body.to_string().as_bytes()),
        headers,
    )
    .unwrap()
}

/// Budgets across processes: once a task (`x-tandem-task`) has spent its budget on cluster
/// A's own pool, its requests go to the batch group (cluster B) while other tasks are still
/// served by the pool; a session over its budget for a model without a batch group is
/// refused with 429 `budget_exceeded`; the spend is in A's `/metrics`.
#[test]
fn a_task_over_its_budget_is_demoted_to_the_batch_cluster_and_a_session_refused() {
    let b = up("budgets-b", "mocker", &["--engine", "mocker"]);
    let dir = common::temp_dir("budgets-a-file");
    let file = dir.join("groups.toml");
    std::fs::write(
        &file,
        format!(
            r#"
[[budget]]
per = "task"
tokens = 1

[[budget]]
per = "session"
tokens = 1
window_seconds = 3600

[[model]]
name = "chat"

  [[model.group]]
  name = "own"
  pool = true
  cost = {{ prompt_per_million = 100.0, completion_per_million = 400.0 }}

  [[model.group]]
  name = "batch-b"
  batch = true
    [[model.group.endpoint]]
    url = "http://{}/v1"
    model = "mocker"
"#,
            b.addr
        ),
    )
    .unwrap();
    let a = up(
        "budgets-a",
        "mocker",
        &["--engine", "mocker", "--groups", file.to_str().unwrap()],
    );

    let eval = [("x-tandem-task", "nightly-eval")];
    let r = ask_with(a.addr, "chat", &eval);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-tandem-group"), Some("own"));
    assert_eq!(r.header("x-tandem-budget"), None);
    // The task's budget is spent: demoted to cluster B, which answers under its own name.
    let r = ask_with(a.addr, "chat", &eval);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-tandem-group"), Some("batch-b"));
    assert_eq!(r.header("x-tandem-budget"), Some("demoted"));
    let v: Value = serde_json::from_str(&r.text()).unwrap();
    assert_eq!(v["model"], "mocker");
    // Another task stays on the pool.
    let r = ask_with(a.addr, "chat", &[("x-tandem-task", "chat")]);
    assert_eq!(r.header("x-tandem-group"), Some("own"));

    // A session's budget, on the pool's own model (no batch group): refused once spent.
    let session = [("x-session-id", "conversation-1")];
    let r = ask_with(a.addr, "mocker", &session);
    assert_eq!(r.status, 200, "{}", r.text());
    let r = ask_with(a.addr, "mocker", &session);
    assert_eq!(r.status, 429, "{}", r.text());
    let v: Value = serde_json::from_str(&r.text()).unwrap();
    assert_eq!(v["error"]["code"], "budget_exceeded", "{v}");
    let after: u64 = r.header("retry-after").unwrap().parse().unwrap();
    assert!((3_500..=3_600).contains(&after), "{after}");

    let metrics = http::get(a.admin, "/metrics").unwrap().text();
    let parsed = common::metrics::Metrics::parse(&metrics);
    let spend = parsed
        .0
        .get(r#"tandem_tenant_spend_total{tenant="anonymous"}"#)
        .copied()
        .unwrap_or(0.0);
    // Priced at the pool group's cost: the two answers the pool gave for model "chat".
    assert!(spend > 0.0, "{metrics}");
    for line in [
        r#"tandem_budget_refusals_total{per="task",outcome="demoted"} 1"#,
        r#"tandem_budget_refusals_total{per="session",outcome="refused"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in\n{metrics}");
    }
}
