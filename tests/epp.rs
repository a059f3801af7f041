//! `tandem epp` against an independent ext_proc client: tests/epp_client.py, an Envoy
//! stand-in on the grpc project's generated Envoy protos (`xds-protos`) and `grpcio`, which
//! also forwards each picked request to the chosen vLLM stand-in as a gateway would.
//!
//! - Two sidecar workers in front of `tandem-standin` engines register their engines' HTTP
//!   endpoints; a prompt sent through the picked endpoint is cached there (the engine's KV
//!   events reach the picker's index), and the same prefix is picked onto it again — in
//!   full-duplex streamed mode, then buffered — with the header and the `envoy.lb` metadata
//!   naming the same list, the chosen endpoint first and the other as the fallback.
//! - With one request in flight per worker saturating it and no queue, a third request is
//!   shed with an immediate 429 and an OpenAI-style JSON error; when one held request's
//!   stream closes its tracker entry leaves and the next request is picked again.
//! - A picker with no workers answers 503, and its gRPC health says NOT_SERVING for
//!   readiness and the ext_proc service (SERVING for liveness).

use tandem_test_support as common;

use std::net::SocketAddr;
use std::process::Command;
use std::time::Duration;

use common::chat::serial;
use common::cluster::{Cluster, Options, Proc, wait_for};
use serde_json::Value;
use tandem_runtime::external::free_port;

const CLIENT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/epp_client.py");

/// Runs the client's `args`; its JSON report.
fn client(args: &[&str]) -> Value {
    let out = Command::new(common::python("epp"))
        .arg(CLIENT)
        .args(args)
        .output()
        .expect("the epp venv's python3 (scripts/test.sh makes it: grpcio, xds-protos)");
    assert!(
        out.status.success(),
        "epp_client.py {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the client's report is JSON")
}

/// A running picker: its gRPC and metrics addresses.
struct Epp {
    proc: Proc,
    grpc: String,
    metrics: SocketAddr,
}

fn spawn_epp(c: &Cluster, namespace: &str, extra: &[&str]) -> Epp {
    let grpc = format!("127.0.0.1:{}", free_port().unwrap());
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port().unwrap()));
    let mut args = vec!["epp".to_string()];
    args.extend(c.plane_args());
    // Another namespace for the picker without workers.
    let at = args.iter().position(|a| a == "--namespace").unwrap();
    args[at + 1] = namespace.to_string();
    args.extend(["--listen".into(), grpc.clone()]);
    args.extend(["--metrics-addr".into(), metrics.to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let log = c.dir.join(format!("epp-{namespace}.log"));
    let proc = Proc::spawn("epp", "epp", &args, &log);
    Epp {
        proc,
        grpc,
        metrics,
    }
}

/// Waits until the picker's gRPC health names `want` for its ext_proc service.
fn wait_health(epp: &mut Epp, want: &str) -> Value {
    wait_for("the picker's gRPC health", Duration::from_secs(30), || {
        assert!(epp.proc.is_running(), "epp exited:\n{}", epp.proc.log());
        let h = client(&["health", &epp.grpc]);
        (h["envoy.service.ext_proc.v3.ExternalProcessor"] == want).then_some(h)
    })
}

#[test]
fn the_picker_routes_prefixes_sheds_and_reports_health() {
    let _serial = serial();
    let c = Cluster::start(
        "epp",
        Options {
            decode: 2,
            engine: Some("vllm"),
            ..Options::default()
        },
    );
    let engines: Vec<String> = c.engines.iter().map(|e| e.addr.to_string()).collect();

    // No workers in its namespace: 503, and not ready.
    let mut empty = spawn_epp(&c, "t-epp-empty", &[]);
    let h = wait_health(&mut empty, "NOT_SERVING");
    assert_eq!(h["liveness"], "SERVING", "{h}");
    let r = client(&["unavailable", &empty.grpc]);
    assert_eq!(r["picked"]["kind"], "immediate", "{r}");
    assert_eq!(r["picked"]["status"], 503, "{r}");
    assert_eq!(
        r["picked"]["body"]["error"]["type"], "unavailable_error",
        "{r}"
    );
    assert_eq!(r["readiness"], "NOT_SERVING", "{r}");
    assert_eq!(r["liveness"], "SERVING", "{r}");
    drop(empty);

    // Routing by prefix.
    let ns = c.namespace.clone();
    let mut epp = spawn_epp(&c, &ns, &[]);
    let h = wait_health(&mut epp, "SERVING");
    assert_eq!(h["readiness"], "SERVING", "{h}");
    let r = client(&["prefix", &epp.grpc, &epp.metrics.to_string()]);
    let first = &r["first"];
    assert_eq!(first["kind"], "request_headers", "{r}");
    assert_eq!(
        first["header"], first["metadata"],
        "header and metadata differ: {r}"
    );
    assert_eq!(first["clear_route_cache"], true, "{r}");
    let list: Vec<&str> = first["header"].as_str().unwrap().split(',').collect();
    assert_eq!(list.len(), 2, "the chosen endpoint and one fallback: {r}");
    assert_ne!(list[0], list[1], "{r}");
    for e in &list {
        assert!(
            engines.iter().any(|x| x == e),
            "{e} is no engine of {engines:?}: {r}"
        );
    }
    assert_eq!(r["first_body_echoed"], true, "{r}");
    assert_eq!(r["first_status"], 200, "{r}");
    assert_eq!(r["first_response_echoed"], true, "{r}");
    assert!(r["index_entries"].as_f64().unwrap() >= 32.0, "{r}");
    // Buffered mode answers in the body response; same prefix, same endpoint first.
    let second = &r["second"];
    assert_eq!(second["kind"], "request_body", "{r}");
    assert_eq!(second["header"], second["metadata"], "{r}");
    let again: Vec<&str> = second["header"].as_str().unwrap().split(',').collect();
    assert_eq!(again[0], list[0], "the cached prefix went elsewhere: {r}");
    assert_eq!(r["other"]["kind"], "request_headers", "{r}");
    drop(epp);

    // Shedding: one request in flight saturates a worker; no queue.
    let mut shed = spawn_epp(
        &c,
        &ns,
        &[
            "--saturation-requests=1",
            "--queue-max=0",
            "--replica-sync=false",
        ],
    );
    wait_health(&mut shed, "SERVING");
    let r = client(&["shed", &shed.grpc]);
    let held: Vec<&str> = ["held0", "held1"]
        .iter()
        .map(|k| {
            assert_eq!(r[k]["kind"], "request_headers", "{r}");
            r[k]["header"].as_str().unwrap().split(',').next().unwrap()
        })
        .collect();
    assert_ne!(held[0], held[1], "a saturated worker was picked: {r}");
    assert_eq!(r["shed"]["kind"], "immediate", "{r}");
    assert_eq!(r["shed"]["status"], 429, "{r}");
    assert_eq!(
        r["shed"]["body"]["error"]["type"], "overloaded_error",
        "{r}"
    );
    assert!(r["shed"]["headers"]["retry-after"].is_string(), "{r}");
    assert_eq!(r["after_release"]["kind"], "request_headers", "{r}");
    let freed = r["after_release"]["header"].as_str().unwrap();
    assert_eq!(freed.split(',').next().unwrap(), held[0], "{r}");
}
