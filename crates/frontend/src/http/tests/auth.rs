//! API keys, tenants, cache salts, the keys file's reload, and TLS on the listener.

use std::path::Path;
use std::time::Duration;

use axum::http::header;
use serde_json::json;
use tandem_router::TenantLimits;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::*;
use crate::http::auth::AccessConfig;
use crate::http::tls::TlsConfig;

const ACME: &str = "sk-acme-0123456789abcdef";
const BETA: &str = "sk-beta-0123456789abcdef";

/// What one `set_tenants` call said.
type Named = Vec<(Arc<str>, TenantLimits)>;

/// A [`FakeBackend`] that also records every `set_tenants` call.
#[derive(Debug)]
struct Tenants {
    fake: Arc<FakeBackend>,
    calls: Mutex<Vec<Named>>,
}

#[async_trait::async_trait]
impl Backend for Tenants {
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError> {
        self.fake.generate(req).await
    }

    fn ready(&self) -> bool {
        self.fake.ready()
    }

    fn set_tenants(&self, tenants: Named) {
        self.calls.lock().push(tenants);
    }
}

impl Tenants {
    fn last_call(&self) -> Named {
        let mut call = self
            .calls
            .lock()
            .last()
            .cloned()
            .expect("set_tenants was called");
        call.sort_by(|a, b| a.0.cmp(&b.0));
        call
    }
}

struct Edge {
    app: Router,
    state: HttpState,
    fake: Arc<FakeBackend>,
    tenants: Arc<Tenants>,
}

fn edge(access: AccessConfig) -> Edge {
    try_edge(HttpConfig { access, ..config() }).unwrap()
}

fn try_edge(config: HttpConfig) -> Result<Edge, crate::http::StateError> {
    let fake = FakeBackend::text("ok");
    let tenants = Arc::new(Tenants {
        fake: fake.clone(),
        calls: Mutex::new(Vec::new()),
    });
    let state = HttpState::builder(tenants.clone(), config, cl100k()).build()?;
    Ok(Edge {
        app: crate::http::app(state.clone()),
        state,
        fake,
        tenants,
    })
}

fn inline(pairs: &[(&str, &str)]) -> AccessConfig {
    AccessConfig {
        api_keys: pairs
            .iter()
            .map(|(k, t)| (k.to_string(), t.to_string()))
            .collect(),
        ..AccessConfig::default()
    }
}

/// A fresh directory for one test's files, removed when the test passes.
fn dir(tag: &str) -> tandem_test_support::TestDir {
    tandem_test_support::temp_dir(&format!("auth-{tag}"))
}

/// Writes `text` to `path` atomically (beside it, then renamed over it).
fn write_atomic(path: &Path, text: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A valid body for each generation endpoint.
fn endpoints() -> [(&'static str, Value); 4] {
    let messages = json!([{"role": "user", "content": "hi"}]);
    [
        ("/v1/chat/completions", json!({"messages": messages})),
        ("/v1/completions", json!({"prompt": "hi"})),
        ("/v1/responses", json!({"input": "hi"})),
        (
            "/v1/messages",
            json!({"model": "tandem-test", "max_tokens": 8, "messages": messages}),
        ),
    ]
}

fn with_headers(path: &str, body: &Value, headers: &[(&str, &str)]) -> Request<Body> {
    let mut req = post_json(path, body);
    for (k, v) in headers {
        req.headers_mut().insert(
            axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
            v.parse().unwrap(),
        );
    }
    req
}

async fn assert_unauthorized(path: &str, resp: Response<Body>) {
    assert_eq!(header(&resp, "www-authenticate"), Some("Bearer"), "{path}");
    if path == "/v1/messages" {
        assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
        let v = body_json(resp).await;
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("API key"),
            "{v}"
        );
    } else {
        let v = assert_error(
            resp,
            StatusCode::UNAUTHORIZED,
            Some("invalid_api_key"),
            None,
        )
        .await;
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    }
}

#[tokio::test]
async fn every_generation_endpoint_needs_a_valid_key() {
    let e = edge(inline(&[(ACME, "acme")]));
    for (path, body) in endpoints() {
        let none = send(&e.app, post_json(path, &body)).await;
        assert_unauthorized(path, none).await;
        let wrong = with_headers(path, &body, &[("authorization", "Bearer sk-wrong")]);
        assert_unauthorized(path, send(&e.app, wrong).await).await;
        let wrong = with_headers(path, &body, &[("x-api-key", "sk-acme-0123456789abcdeF")]);
        assert_unauthorized(path, send(&e.app, wrong).await).await;
        // A prefix of a real key is no key.
        let prefix = with_headers(path, &body, &[("x-api-key", &ACME[..10])]);
        assert_unauthorized(path, send(&e.app, prefix).await).await;
        // Another scheme carries no key.
        let basic = with_headers(path, &body, &[("authorization", "Basic c2stYWNtZQ==")]);
        assert_unauthorized(path, send(&e.app, basic).await).await;
    }
    assert!(e.fake.seen.lock().is_empty(), "nothing reached the backend");
    // Bearer and x-api-key both work, on every endpoint.
    for (path, body) in endpoints() {
        for h in [
            ("authorization", format!("Bearer {ACME}")),
            ("x-api-key", ACME.into()),
        ] {
            let resp = send(&e.app, with_headers(path, &body, &[(h.0, &h.1)])).await;
            assert_eq!(resp.status(), StatusCode::OK, "{path} {}", h.0);
            assert_eq!(e.fake.last_request().tenant.as_deref(), Some("acme"));
        }
    }
    // The scheme is case-insensitive; the Bearer header decides over x-api-key.
    let (path, body) = &endpoints()[0];
    let lower = with_headers(path, body, &[("authorization", &format!("bearer {ACME}"))]);
    assert_eq!(send(&e.app, lower).await.status(), StatusCode::OK);
    let both = with_headers(
        path,
        body,
        &[("authorization", "Bearer sk-wrong"), ("x-api-key", ACME)],
    );
    assert_unauthorized(path, send(&e.app, both).await).await;
}

#[tokio::test]
async fn probes_stay_open_and_models_need_a_key() {
    let e = edge(inline(&[(ACME, "acme")]));
    for path in ["/health", "/live"] {
        assert_eq!(
            send(&e.app, get(path)).await.status(),
            StatusCode::OK,
            "{path}"
        );
    }
    for path in ["/v1/models", "/v1/models/tandem-test"] {
        assert_unauthorized(path, send(&e.app, get(path)).await).await;
        let mut req = get(path);
        req.headers_mut().insert(
            header::AUTHORIZATION,
            format!("Bearer {ACME}").parse().unwrap(),
        );
        assert_eq!(send(&e.app, req).await.status(), StatusCode::OK, "{path}");
    }
    // The refusals are counted like any other status.
    let _ = send(
        &e.app,
        post_json("/v1/completions", &json!({"prompt": "x"})),
    )
    .await;
    let metrics = scrape(&e.state).await;
    let counted = r#"tandem_http_requests_total{endpoint="completion",status="401"} 1"#;
    assert!(metrics.contains(counted), "{metrics}");
}

#[tokio::test]
async fn keys_name_tenants_and_tenants_salt_the_cache() {
    let d = dir("salts");
    let file = d.join("keys.json");
    std::fs::write(
        &file,
        json!({"tenants": {
            "acme": {"keys": [ACME]},
            "beta": {"keys": [BETA], "cache_salt": "shared-x"},
        }})
        .to_string(),
    )
    .unwrap();
    let e = edge(AccessConfig {
        api_keys_file: Some(file),
        api_keys: vec![("sk-gamma-0123456789abcdef".into(), "gamma".into())],
        ..AccessConfig::default()
    });
    let ask = |key: &str, salt: Option<&str>, extra: Option<(&str, &str)>| {
        let mut body = json!({"prompt": "hi"});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        let auth = format!("Bearer {key}");
        let mut headers = vec![("authorization", auth.as_str())];
        headers.extend(extra);
        let req = with_headers("/v1/completions", &body, &headers);
        let (app, fake) = (e.app.clone(), e.fake.clone());
        async move {
            let resp = send(&app, req).await;
            assert_eq!(resp.status(), StatusCode::OK);
            let r = fake.last_request();
            (r.tenant.as_deref().map(str::to_string), r.cache_salt)
        }
    };
    let s = |t: &str, salt: &str| (Some(t.to_string()), Some(salt.to_string()));
    assert_eq!(ask(ACME, None, None).await, s("acme", "acme"));
    assert_eq!(ask(ACME, Some("u1"), None).await, s("acme", "acme\u{1f}u1"));
    // A configured salt replaces the name (tenants sharing it share blocks).
    assert_eq!(ask(BETA, None, None).await, s("beta", "shared-x"));
    assert_eq!(
        ask(BETA, Some("u1"), None).await,
        s("beta", "shared-x\u{1f}u1")
    );
    // Inline keys name tenants too; with keys, x-tandem-tenant is ignored.
    let gamma = "sk-gamma-0123456789abcdef";
    let spoof = Some(("x-tandem-tenant", "acme"));
    assert_eq!(ask(gamma, None, spoof).await, s("gamma", "gamma"));
    // Every named tenant's limits went to the backend, defaults where none were given.
    let names: Vec<_> = e.tenants.last_call().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, [Arc::from("acme"), "beta".into(), "gamma".into()]);
}

#[tokio::test]
async fn without_keys_the_tenant_header_names_the_tenant() {
    let e = edge(AccessConfig::default());
    // As before: anonymous, the request's own salt.
    let body = json!({"prompt": "hi", "cache_salt": "mine"});
    assert_eq!(
        send(&e.app, post_json("/v1/completions", &body))
            .await
            .status(),
        StatusCode::OK
    );
    let r = e.fake.last_request();
    assert_eq!((r.tenant, r.cache_salt.as_deref()), (None, Some("mine")));
    let plain = json!({"prompt": "hi"});
    send(&e.app, post_json("/v1/completions", &plain)).await;
    assert_eq!(e.fake.last_request().cache_salt, None);
    // A key is no key here: nothing is checked.
    let keyed = with_headers(
        "/v1/completions",
        &plain,
        &[("authorization", "Bearer whatever")],
    );
    assert_eq!(send(&e.app, keyed).await.status(), StatusCode::OK);
    assert_eq!(e.fake.last_request().tenant, None);
    // The gateway's header.
    let req = with_headers("/v1/completions", &body, &[("x-tandem-tenant", "team-7")]);
    assert_eq!(send(&e.app, req).await.status(), StatusCode::OK);
    let r = e.fake.last_request();
    assert_eq!(r.tenant.as_deref(), Some("team-7"));
    assert_eq!(r.cache_salt.as_deref(), Some("team-7\u{1f}mine"));
    for bad in ["", "two words", "a,b", &"x".repeat(129)] {
        let req = with_headers("/v1/completions", &body, &[("x-tandem-tenant", bad)]);
        let resp = send(&e.app, req).await;
        assert_error(resp, StatusCode::BAD_REQUEST, None, Some("x-tandem-tenant")).await;
    }
    // Models need nothing.
    assert_eq!(
        send(&e.app, get("/v1/models")).await.status(),
        StatusCode::OK
    );
    // No named tenants: the backend is told so once, at start.
    assert_eq!(e.tenants.calls.lock().as_slice(), &[Vec::new()]);
}

#[tokio::test]
async fn the_keys_file_is_reloaded_and_a_bad_one_keeps_the_old_keys() {
    let d = dir("reload");
    let file = d.join("keys.json");
    let keys = |tenant: &str, key: &str, rpm: u64| {
        json!({"tenants": {tenant: {"keys": [key], "requests_per_minute": rpm, "weight": 2}}})
            .to_string()
    };
    write_atomic(&file, &keys("acme", ACME, 60));
    let e = edge(AccessConfig {
        api_keys_file: Some(file.clone()),
        reload_interval: Duration::from_millis(20),
        ..AccessConfig::default()
    });
    let limits = |rpm| TenantLimits {
        requests_per_minute: Some(rpm),
        tokens_per_minute: None,
        weight: 2.0,
    };
    assert_eq!(e.tenants.last_call(), [(Arc::from("acme"), limits(60))]);
    let stop = CancellationToken::new();
    let watch = tokio::spawn(crate::http::watch_api_keys(e.state.clone(), stop.clone()));
    let status = |key: &str| {
        let req = with_headers(
            "/v1/completions",
            &json!({"prompt": "hi"}),
            &[("x-api-key", key)],
        );
        let app = e.app.clone();
        async move { send(&app, req).await.status() }
    };
    assert_eq!(status(ACME).await, StatusCode::OK);
    assert_eq!(status(BETA).await, StatusCode::UNAUTHORIZED);

    write_atomic(&file, &keys("beta", BETA, 120));
    wait_for_status(&status, BETA, StatusCode::OK).await;
    assert_eq!(status(ACME).await, StatusCode::UNAUTHORIZED);
    assert_eq!(e.fake.last_request().tenant.as_deref(), Some("beta"));
    assert_eq!(e.tenants.last_call(), [(Arc::from("beta"), limits(120))]);

    // Broken files (bad JSON, then a valid one with a bad field, then none at all) are
    // refused; the keys in force stay, and the backend hears nothing.
    let calls = e.tenants.calls.lock().len();
    for broken in ["{\"tenants\": {".to_string(), keys("acme", ACME, 0)] {
        write_atomic(&file, &broken);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(status(BETA).await, StatusCode::OK);
        assert_eq!(status(ACME).await, StatusCode::UNAUTHORIZED);
    }
    std::fs::remove_file(&file).unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(status(BETA).await, StatusCode::OK);
    assert_eq!(e.tenants.calls.lock().len(), calls);
    // Fixed again: in force at the next poll.
    write_atomic(&file, &keys("acme", ACME, 60));
    wait_for_status(&status, ACME, StatusCode::OK).await;
    assert_eq!(status(BETA).await, StatusCode::UNAUTHORIZED);

    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), watch)
        .await
        .expect("the watch ends with its token")
        .unwrap();
}

async fn wait_for_status<F, Fut>(status: &F, key: &str, want: StatusCode)
where
    F: Fn(&str) -> Fut,
    Fut: std::future::Future<Output = StatusCode>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while status(key).await != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new keys file was not loaded"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn bad_keys_files_are_refused_with_clear_errors() {
    let d = dir("bad");
    let file = d.join("keys.json");
    let cases: &[(&str, &str)] = &[
        ("{\"tenants\": {", "EOF"),
        (r#"{"tenant": {}}"#, "unknown field `tenant`"),
        (
            r#"{"tenants": {"a": {"keys": ["k1"], "salt": "x"}}}"#,
            "unknown field `salt`",
        ),
        (
            r#"{"tenants": {"a": {"keys": ["k1"]}, "a": {"keys": ["k2"]}}}"#,
            "tenant \"a\" is named twice",
        ),
        (
            r#"{"tenants": {"a": {"keys": ["k1"]}, "b": {"keys": ["k1"]}}}"#,
            "already a key of \"a\"",
        ),
        (
            r#"{"tenants": {"a": {"keys": ["k1", "k1"]}}}"#,
            "already a key of \"a\"",
        ),
        (r#"{"tenants": {"a": {"keys": [""]}}}"#, "an empty key"),
        (r#"{"tenants": {"a": {"keys": ["k 1"]}}}"#, "without spaces"),
        (r#"{"tenants": {"a": {"keys": []}}}"#, "has no keys"),
        (r#"{"tenants": {"a": {}}}"#, "missing field `keys`"),
        (
            r#"{"tenants": {"a b": {"keys": ["k1"]}}}"#,
            "must be 1-128 characters",
        ),
        (
            r#"{"tenants": {"a": {"keys": ["k1"], "weight": 0}}}"#,
            "weight",
        ),
        (
            r#"{"tenants": {"a": {"keys": ["k1"], "tokens_per_minute": 0}}}"#,
            "tokens per minute",
        ),
        (
            r#"{"tenants": {"a": {"keys": ["k1"], "cache_salt": ""}}}"#,
            "cache_salt",
        ),
        (
            r#"{"tenants": {"a": {"keys": ["k1"], "cache_salt": "x\u001fy"}}}"#,
            "control characters",
        ),
    ];
    for (text, want) in cases {
        std::fs::write(&file, text).unwrap();
        let cfg = HttpConfig {
            access: AccessConfig {
                api_keys_file: Some(file.clone()),
                ..AccessConfig::default()
            },
            ..config()
        };
        let err = try_edge(cfg)
            .err()
            .unwrap_or_else(|| panic!("{text} was accepted"));
        let msg = err.to_string();
        assert!(msg.contains(want), "{text}: {msg}");
        assert!(msg.contains("keys.json"), "the file is named: {msg}");
    }
    // A file that is not there.
    let missing = HttpConfig {
        access: AccessConfig {
            api_keys_file: Some(d.join("missing.json")),
            ..AccessConfig::default()
        },
        ..config()
    };
    let msg = try_edge(missing).err().unwrap().to_string();
    assert!(msg.contains("missing.json"), "{msg}");
    // Inline keys: a key given twice, a bad tenant name.
    for (pairs, want) in [
        (&[("k1", "a"), ("k1", "b")][..], "already a key"),
        (&[("k1", "a,b")][..], "must be 1-128"),
    ] {
        let cfg = HttpConfig {
            access: inline(pairs),
            ..config()
        };
        let msg = try_edge(cfg).err().unwrap().to_string();
        assert!(msg.contains("--api-keys") && msg.contains(want), "{msg}");
        assert!(!msg.contains("k1"), "keys are not echoed: {msg}");
    }
    // An empty file of tenants still requires keys: nobody gets in.
    std::fs::write(&file, r#"{"tenants": {}}"#).unwrap();
    let e = edge(AccessConfig {
        api_keys_file: Some(file.clone()),
        ..AccessConfig::default()
    });
    let resp = send(
        &e.app,
        post_json("/v1/completions", &json!({"prompt": "x"})),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::UNAUTHORIZED);
    // Keys never show in the config's Debug.
    let cfg = inline(&[(ACME, "acme")]);
    assert!(!format!("{cfg:?}").contains(ACME));
    assert!(!format!("{:?}", e.state).contains(ACME));
}

// ----- TLS -----

/// A self-signed certificate for `localhost` and its key, as PEM files in `dir`.
fn self_signed(dir: &Path) -> (TlsConfig, rcgen::Certificate) {
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let cfg = TlsConfig {
        cert: dir.join("cert.pem"),
        key: dir.join("key.pem"),
    };
    std::fs::write(&cfg.cert, ck.cert.pem()).unwrap();
    std::fs::write(&cfg.key, ck.signing_key.serialize_pem()).unwrap();
    (cfg, ck.cert)
}

fn client(cert: &rcgen::Certificate) -> tokio_rustls::TlsConnector {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One HTTP/1.1 request over TLS; the whole response as text.
async fn tls_request(
    connector: &tokio_rustls::TlsConnector,
    addr: std::net::SocketAddr,
    request: &str,
) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.expect("TLS handshake");
    assert_eq!(tls.get_ref().1.alpn_protocol(), None, "no ALPN was offered");
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut out))
        .await
        .expect("the response ends")
        .ok();
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn tls_serves_real_requests_and_plain_http_fails_cleanly() {
    let d = dir("tls");
    let (tls, cert) = self_signed(&d);
    let e = try_edge(HttpConfig {
        tls: Some(tls),
        access: inline(&[(ACME, "acme")]),
        ..config()
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(crate::http::serve_state(
        listener,
        None,
        e.state.clone(),
        shutdown.clone(),
    ));
    let connector = client(&cert);
    let health = "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let got = tls_request(&connector, addr, health).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    // A streamed chat completion with a key, over TLS.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}).to_string();
    let chat = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
         Authorization: Bearer {ACME}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let got = tls_request(&connector, addr, &chat).await;
    assert!(got.starts_with("HTTP/1.1 200"), "{got}");
    assert!(got.contains("data: [DONE]"), "{got}");
    assert_eq!(e.fake.last_request().tenant.as_deref(), Some("acme"));

    // Plain HTTP on the TLS port: no HTTP answer, the connection closes.
    let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
    plain.write_all(health.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut out))
        .await
        .expect("the server closes a plain connection")
        .ok();
    assert!(
        !out.starts_with(b"HTTP/"),
        "{:?}",
        String::from_utf8_lossy(&out)
    );
    // A silent client does not hold up others either.
    let _silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    // A client that does not trust the certificate fails its handshake; the server is fine.
    let other = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("localhost").unwrap();
    assert!(client(&other.cert).connect(name, tcp).await.is_err());
    let got = tls_request(&connector, addr, health).await;
    assert!(got.starts_with("HTTP/1.1 200"), "still serving: {got}");

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("graceful shutdown")
        .unwrap()
        .unwrap();
}

#[test]
fn bad_tls_files_are_refused_at_start() {
    let d = dir("tls-bad");
    let (tls, _) = self_signed(&d);
    let other = dir("tls-bad-other");
    let (mismatched, _) = self_signed(&other);
    let garbage = d.join("garbage.pem");
    std::fs::write(&garbage, "not pem at all").unwrap();
    let cases = [
        (
            TlsConfig {
                cert: d.join("missing.pem"),
                key: tls.key.clone(),
            },
            "missing.pem",
        ),
        (
            TlsConfig {
                cert: garbage.clone(),
                key: tls.key.clone(),
            },
            "no certificate",
        ),
        (
            TlsConfig {
                cert: tls.cert.clone(),
                key: garbage.clone(),
            },
            "no private key",
        ),
        // Swapped files: the key file holds no certificate.
        (
            TlsConfig {
                cert: tls.key.clone(),
                key: tls.cert.clone(),
            },
            "no certificate",
        ),
        // Another certificate's key.
        (
            TlsConfig {
                cert: tls.cert.clone(),
                key: mismatched.key.clone(),
            },
            "KeyMismatch",
        ),
    ];
    for (cfg, want) in cases {
        let err = try_edge(HttpConfig {
            tls: Some(cfg.clone()),
            ..config()
        })
        .err()
        .unwrap_or_else(|| panic!("{cfg:?} was accepted"));
        let msg = err.to_string();
        assert!(msg.contains("TLS") && msg.contains(want), "{cfg:?}: {msg}");
    }
    assert!(crate::http::tls::load(&tls).is_ok());
}

/// Every route of both listeners, with no key, a tenant's key and the admin key: with keys
/// and an admin key configured, and with neither (`auth.rs`, "The operator's surfaces").
#[tokio::test]
async fn each_listener_serves_its_routes_to_the_keys_that_open_them() {
    const ADMIN: &str = "sk-admin-0123456789abcdef";
    const OPS: [&str; 4] = ["/metrics", "/", "/status", "/status.json"];
    let keys = [None, Some(ACME), Some(ADMIN)];
    let request = |path: &str, key: Option<&str>| {
        let mut req = match endpoints().iter().find(|(p, _)| *p == path) {
            Some((p, body)) => post_json(p, body),
            None => get(path),
        };
        if let Some(k) = key {
            req.headers_mut().insert(
                header::AUTHORIZATION,
                format!("Bearer {k}").parse().unwrap(),
            );
        }
        req
    };
    let apis: Vec<&str> = endpoints()
        .iter()
        .map(|(p, _)| *p)
        .chain(["/v1/models", "/v1/models/tandem-test"])
        .collect();
    for secured in [true, false] {
        let access = if secured {
            AccessConfig {
                admin_key: Some(ADMIN.into()),
                ..inline(&[(ACME, "acme")])
            }
        } else {
            AccessConfig::default()
        };
        let e = edge(access);
        let admin = crate::http::admin_app(e.state.clone());
        for key in keys {
            let code = |app: &Router, path: &str| {
                let req = request(path, key);
                let app = app.clone();
                async move { send(&app, req).await.status().as_u16() }
            };
            let case = format!("secured {secured}, key {key:?}");
            for path in ["/health", "/live"] {
                assert_eq!(code(&e.app, path).await, 200, "public {path}, {case}");
                assert_eq!(code(&admin, path).await, 200, "admin {path}, {case}");
            }
            for path in &apis {
                let want = if !secured || key == Some(ACME) {
                    200
                } else {
                    401
                };
                assert_eq!(code(&e.app, path).await, want, "public {path}, {case}");
                assert_eq!(code(&admin, path).await, 404, "admin {path}, {case}");
            }
            for path in OPS {
                let (public, on_admin) = match (secured, key) {
                    (false, _) => (404, 200),
                    (true, Some(ADMIN)) => (200, 200),
                    (true, _) => (401, 401),
                };
                assert_eq!(code(&e.app, path).await, public, "public {path}, {case}");
                assert_eq!(code(&admin, path).await, on_admin, "admin {path}, {case}");
            }
        }
    }
    // An admin key that is also a tenant's is refused at start.
    let clash = AccessConfig {
        admin_key: Some(ACME.into()),
        ..inline(&[(ACME, "acme")])
    };
    let e = try_edge(HttpConfig {
        access: clash,
        ..config()
    });
    assert!(e.is_err_and(|e| e.to_string().contains("also a tenant's")));
}
