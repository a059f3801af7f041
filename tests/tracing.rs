//! Traces across three processes: a frontend, a decode worker and a prefill worker export
//! their spans over OTLP gRPC to a receiver built on the OpenTelemetry project's published
//! protos (Python's `opentelemetry-proto` with `grpcio`: tests/otlp_receiver.py), and the
//! span tree of one disaggregated request is checked — parentage across the processes
//! (W3C trace context in gRPC metadata), names, kinds and the GenAI attributes.

use tandem_test_support as common;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::chat::{chat, chunks, final_usage, serial, streamed};
use common::cluster::{Cluster, Options, decode_id, prefill_id, wait_for};
use common::http;
use common::words;
use serde_json::Value;

/// The receiver process; killed on drop.
struct Receiver {
    child: Child,
    port: u16,
    spans: PathBuf,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Receiver {
    fn start(dir: &Path) -> Receiver {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/otlp_receiver.py");
        let port_file = dir.join("otlp.port");
        let spans = dir.join("spans.jsonl");
        let log_path = dir.join("otlp_receiver.log");
        let child = Command::new(common::python("otlp"))
            .arg(&script)
            .arg(&port_file)
            .arg(&spans)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log_path).unwrap())
            .spawn()
            .expect(
                "the otlp venv's python3 (scripts/test.sh makes it: grpcio, opentelemetry-proto)",
            );
        let mut r = Receiver {
            child,
            port: 0,
            spans,
        };
        r.port = wait_for("the OTLP receiver's port", Duration::from_secs(30), || {
            if let Ok(Some(status)) = r.child.try_wait() {
                panic!(
                    "the OTLP receiver exited ({status}): {}",
                    std::fs::read_to_string(&log_path).unwrap_or_default()
                );
            }
            std::fs::read_to_string(&port_file)
                .ok()?
                .trim()
                .parse()
                .ok()
        });
        r
    }

    /// The spans written so far: whole lines only (the receiver's buffered writer may have
    /// flushed part of a batch's last line when this reads the file).
    fn spans(&self) -> Vec<Value> {
        let text = std::fs::read_to_string(&self.spans).unwrap_or_default();
        let whole = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        whole
            .lines()
            .map(|l| serde_json::from_str(l).expect("a span as one JSON line"))
            .collect()
    }
}

fn attr<'a>(span: &'a Value, key: &str) -> &'a Value {
    &span["attributes"][key]
}

/// The one span named `name` of `kind` in `service`.
fn one<'a>(spans: &'a [Value], (service, name, kind): (&str, &str, &str)) -> &'a Value {
    let found: Vec<&Value> = spans
        .iter()
        .filter(|s| s["service"] == service && s["name"] == name && s["kind"] == kind)
        .collect();
    assert_eq!(
        found.len(),
        1,
        "expected one {kind} span {name:?} of {service}, got {found:?}\nall: {spans:#?}"
    );
    found[0]
}

fn child_of(span: &Value, parent: &Value) {
    assert_eq!(
        span["parent_span_id"], parent["span_id"],
        "{} should be a child of {}",
        span["name"], parent["name"]
    );
    assert_eq!(span["trace_id"], parent["trace_id"]);
}

/// The `data:` payloads of an SSE body.
fn sse_events(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(str::to_string)
        .collect()
}

const WANTED: [(&str, &str, &str); 11] = [
    ("tandem-frontend", "chat mocker", "server"),
    ("tandem-frontend", "tokenize", "internal"),
    ("tandem-frontend", "queue", "internal"),
    ("tandem-frontend", "route", "internal"),
    ("tandem-frontend", "tandem.v1.Worker/Generate", "client"),
    ("tandem-frontend", "stream", "internal"),
    ("tandem-decode", "tandem.v1.Worker/Generate", "server"),
    ("tandem-decode", "tandem.v1.Worker/Prefill", "client"),
    ("tandem-decode", "decode", "internal"),
    ("tandem-prefill", "tandem.v1.Worker/Prefill", "server"),
    ("tandem-prefill", "kv_transfer", "internal"),
];

#[test]
fn a_disaggregated_request_is_one_trace_across_three_processes() {
    let _serial = serial();
    let dir = common::temp_dir("tracing");
    let receiver = Receiver::start(&dir);
    let otlp = format!("--otlp-endpoint=http://127.0.0.1:{}", receiver.port);
    let c = Cluster::start(
        "tracing",
        Options {
            prefill: 1,
            decode: 1,
            disagg: "always",
            kv_transport: "tcp",
            frontend_args: vec![otlp.clone()],
            worker_args: vec![otlp],
            ..Options::default()
        },
    );

    // The client's own trace context: the frontend's span continues it.
    let client_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_span = "00f067aa0ba902b7";
    let traceparent = format!("00-{client_trace}-{client_span}-01");
    let body = streamed(chat(&words(7, 200), "trace this request", 12));
    let r = http::request(
        c.addr,
        "POST",
        "/v1/chat/completions",
        Some(serde_json::to_string(&body).unwrap().as_bytes()),
        &[
            ("content-type", "application/json"),
            ("traceparent", &traceparent),
        ],
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.header("x-tandem-prefill-worker"),
        Some(prefill_id(0).to_string().as_str())
    );
    let usage = final_usage(&chunks(&sse_events(&r.text())));

    let spans = wait_for("the request's spans", Duration::from_secs(30), || {
        let spans: Vec<Value> = receiver
            .spans()
            .into_iter()
            .filter(|s| s["trace_id"] == client_trace)
            .collect();
        let all = WANTED.iter().all(|(svc, name, kind)| {
            spans
                .iter()
                .any(|s| s["service"] == *svc && s["name"] == *name && s["kind"] == *kind)
        });
        all.then_some(spans)
    });
    let [root, tokenize, queue, route, gen_client, stream] =
        [0, 1, 2, 3, 4, 5].map(|i| one(&spans, WANTED[i]));
    let [gen_server, prefill_client, decode, prefill_server, transfer] =
        [6, 7, 8, 9, 10].map(|i| one(&spans, WANTED[i]));

    // Parentage: the client's span, then the frontend's layers, then across the processes.
    assert_eq!(root["parent_span_id"], client_span);
    for s in [tokenize, queue, route, gen_client, stream] {
        child_of(s, root);
    }
    child_of(gen_server, gen_client);
    child_of(prefill_client, gen_server);
    child_of(decode, gen_server);
    child_of(prefill_server, prefill_client);
    child_of(transfer, prefill_server);
    // Every span of the trace is one of these (nothing orphaned, nothing doubled).
    assert_eq!(spans.len(), WANTED.len(), "{spans:#?}");
    let ids: HashSet<&str> = spans
        .iter()
        .map(|s| s["span_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), spans.len());

    // The GenAI conventions on the request's span.
    assert_eq!(attr(root, "gen_ai.operation.name"), "chat");
    assert_eq!(attr(root, "gen_ai.request.model"), "mocker");
    assert_eq!(attr(root, "gen_ai.request.max_tokens"), 12);
    assert_eq!(
        attr(root, "gen_ai.usage.input_tokens"),
        u64::from(usage.prompt_tokens)
    );
    assert_eq!(
        attr(root, "gen_ai.usage.output_tokens"),
        u64::from(usage.completion_tokens)
    );
    assert_eq!(
        attr(root, "gen_ai.response.finish_reasons"),
        &serde_json::json!(["length"])
    );
    assert!(
        attr(root, "gen_ai.server.time_to_first_token")
            .as_f64()
            .unwrap()
            > 0.0
    );
    assert_eq!(attr(root, "http.response.status_code"), 200);
    assert_eq!(attr(root, "http.route"), "/v1/chat/completions");
    assert_eq!(attr(root, "tandem.decode_worker"), decode_id(0));
    assert_eq!(attr(root, "tandem.prefill_worker"), prefill_id(0));
    // The routing decision's terms.
    assert_eq!(attr(route, "tandem.route.decode_worker"), decode_id(0));
    assert_eq!(attr(route, "tandem.route.prefill_worker"), prefill_id(0));
    assert!(attr(route, "tandem.route.cost").is_number());
    assert_eq!(attr(route, "tandem.route.candidates"), 1);
    // The gRPC conventions and what moved.
    assert_eq!(attr(gen_client, "rpc.system"), "grpc");
    assert_eq!(attr(gen_server, "rpc.method"), "Generate");
    assert_eq!(attr(gen_server, "tandem.prefill"), "remote");
    assert_eq!(attr(prefill_client, "tandem.outcome"), "remote");
    assert!(attr(transfer, "tandem.bytes").as_u64().unwrap() > 0);
    assert_eq!(
        attr(decode, "tandem.output_tokens"),
        u64::from(usage.completion_tokens)
    );
    // Time nests: the decode worker's call lies within the frontend's.
    let t = |s: &Value, k: &str| s[k].as_u64().unwrap();
    assert!(t(gen_server, "start") >= t(gen_client, "start"));
    assert!(t(transfer, "end") <= t(prefill_server, "end"));

    // A request without a trace context begins its own trace (sampling ratio 1).
    let r = c.post(
        "/v1/chat/completions",
        &chat(&words(8, 40), "a fresh trace", 4),
    );
    assert_eq!(r.status, 200);
    wait_for("a second trace", Duration::from_secs(30), || {
        let roots: Vec<Value> = receiver
            .spans()
            .into_iter()
            .filter(|s| s["name"] == "chat mocker" && s["trace_id"] != client_trace)
            .collect();
        (roots.len() == 1 && roots[0]["parent_span_id"] == "").then_some(())
    });
}
