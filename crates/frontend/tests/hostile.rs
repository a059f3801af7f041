//! Hostile HTTP clients against the real server (issue 12 §5): [`http::serve`] on a loopback
//! port (real TCP, real hyper), a backend that always succeeds, and raw TCP clients writing
//! HTTP/1.1 bytes by hand.
//!
//! 1. `TANDEM_HOSTILE_REQUESTS` (default 10 000) requests over many connections, 16 at a
//!    time: malformed JSON, JSON of the wrong shape, invalid UTF-8, absurd numbers, bodies
//!    over `max_body_bytes` (64 KiB here) declared by `Content-Length` or chunked without
//!    one, a 100 KB header value, 10 000 headers, a 1 MB head, a 100 KB URI, malformed
//!    request lines, wrong and unknown methods, HTTP/1.0, pipelined requests,
//!    `Content-Length` with `Transfer-Encoding`, broken chunk sizes and lengths, bodies cut
//!    short, invalid header bytes, an HTTP/2 preface with garbage, raw garbage; some valid
//!    and leniently parsed requests mixed in. Every status that comes back is a 4xx (200
//!    for the valid ones), never a 5xx; a complete, well-formed request always gets its
//!    answers (no hang); garbage may get a 4xx or a close. About 5 s on two idle cores.
//! 2. Meanwhile 300 slow clients send a partial request head, one byte a second, and 20
//!    send a complete head and then their body one byte a second; all hold on. `/health`
//!    and a real chat request on new connections keep answering (within a liveness bound of
//!    5 s). The test prints how the slow clients ended: `serve` gives hyper a timer, so a
//!    head not complete after 30 s (`HEADER_READ_TIMEOUT`) closes its connection, and a body
//!    not complete after 30 s is answered 408 (`TANDEM_HOSTILE_SLOW_SECS`, default 5, sets
//!    how long they are watched; 45 s shows both closed).
//! 3. At the end no handler panicked (a panic hook counts them), the server task is still
//!    running, `/health` is 200 and a normal request is served. Last, the test prints
//!    whether a graceful shutdown finishes within 3 s with ten slow heads attached.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use tandem_frontend::http::{
    self, FinishReason, HttpConfig, HttpState, ServeError, Tokenizer, TokenizerSpec, ValidRequest,
};
use tandem_frontend::testing::{Chunks, FnBackend, token_chunks};
use tandem_protocol::Rng;

const MAX_BODY: usize = 64 * 1024;
const MODEL: &str = "hostile-model";
/// How long a complete request may go unanswered before it counts as a hang.
const ANSWER_WITHIN: Duration = Duration::from_secs(10);

/// The edge's answer to every request that gets through: a short text in two chunks.
fn text_backend(
    tokenizer: Arc<Tokenizer>,
) -> FnBackend<impl Fn(&ValidRequest) -> Result<Chunks, ServeError> + Send + Sync + 'static> {
    FnBackend::new(move |_req: &ValidRequest| {
        let tokens = tokenizer
            .encode("Hello there, client.")
            .map_err(|e| ServeError::internal(e.to_string()))?;
        Ok(token_chunks(
            &tokens,
            tokens.len().div_ceil(2),
            FinishReason::Stop,
        ))
    })
}

// --- raw HTTP ---------------------------------------------------------------------------------

/// One connection's script: bytes to write, whether to half-close after them, and what may
/// come back.
#[derive(Clone, Debug)]
struct Plan {
    kind: &'static str,
    writes: Vec<Vec<u8>>,
    shutdown: bool,
    /// Answers a correct server must send (complete, well-formed requests); 0 where closing
    /// without an answer is fine too.
    min_answers: usize,
    /// The number of valid requests in it, answered 200; every other answer is a 4xx.
    valid: usize,
    /// Requests it stands for (pipelines hold several).
    requests: usize,
}

/// What came back on one connection.
#[derive(Debug, Default)]
struct Outcome {
    statuses: Vec<u16>,
    /// Neither closed nor answered in full within [`ANSWER_WITHIN`].
    hung: bool,
    reset: bool,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The statuses of the HTTP/1 responses in `buf`, in order, interim ones left out (bodies
/// skipped by `Content-Length` or chunked framing), and whether the last one is complete.
fn statuses(mut buf: &[u8]) -> (Vec<u16>, bool) {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let Some(end) = find(buf, b"\r\n\r\n") else {
            return (out, false);
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok());
        let Some(status) = status.filter(|_| head.starts_with("http/1.")) else {
            return (out, false);
        };
        buf = &buf[end + 4..];
        // Interim answers (`100 Continue`) precede the real one.
        if (100..200).contains(&status) {
            continue;
        }
        out.push(status);
        let header = |name: &str| {
            head.lines()
                .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
        };
        if header("transfer-encoding:").is_some_and(|v| v.contains("chunked")) {
            loop {
                let Some(line) = find(buf, b"\r\n") else {
                    return (out, false);
                };
                let size = std::str::from_utf8(&buf[..line])
                    .ok()
                    .and_then(|s| usize::from_str_radix(s.trim(), 16).ok());
                let Some(size) = size else {
                    return (out, false);
                };
                let Some(rest) = buf.get(line + 2 + size + 2..) else {
                    return (out, false);
                };
                buf = rest;
                if size == 0 {
                    break;
                }
            }
        } else {
            let len = header("content-length:").and_then(|v| v.parse::<usize>().ok());
            match len {
                Some(n) if buf.len() >= n => buf = &buf[n..],
                Some(_) => return (out, false),
                None => return (out, true),
            }
        }
    }
    (out, true)
}

async fn run_plan(addr: std::net::SocketAddr, plan: &Plan) -> Outcome {
    let mut outcome = Outcome::default();
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        outcome.reset = true;
        return outcome;
    };
    let _ = stream.set_nodelay(true);
    for w in &plan.writes {
        if stream.write_all(w).await.is_err() {
            break;
        }
    }
    if plan.shutdown {
        let _ = stream.shutdown().await;
    }
    let mut buf = Vec::new();
    let read = tokio::time::timeout(ANSWER_WITHIN, async {
        let mut chunk = [0u8; 16 * 1024];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) => return false,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(_) => return true,
            }
            // A connection kept alive after all expected answers: done with it.
            let (got, complete) = statuses(&buf);
            if complete && got.len() >= plan.requests.max(1) {
                return false;
            }
        }
    })
    .await;
    match read {
        Ok(reset) => outcome.reset = reset,
        Err(_) => outcome.hung = true,
    }
    outcome.statuses = statuses(&buf).0;
    outcome
}

fn post(path: &str, body: &[u8], extra: &str) -> Vec<u8> {
    let mut r = format!(
        "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n{extra}\r\n",
        body.len()
    )
    .into_bytes();
    r.extend_from_slice(body);
    r
}

fn close(req: &[u8]) -> Vec<u8> {
    // `Connection: close` right after the request line.
    let at = find(req, b"\r\n").map_or(req.len(), |i| i + 2);
    let mut r = req[..at].to_vec();
    r.extend_from_slice(b"Connection: close\r\n");
    r.extend_from_slice(&req[at..]);
    r
}

const PATHS: [&str; 4] = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
];

fn valid_chat() -> Vec<u8> {
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":4}}"#
    );
    post("/v1/chat/completions", body.as_bytes(), "")
}

fn health() -> Vec<u8> {
    b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n".to_vec()
}

/// One hostile (or, now and then, valid) plan.
fn plan(g: &mut Rng) -> Plan {
    let path = PATHS[g.below(PATHS.len())];
    // Kinds that send 70 KB to 1 MB (5, 6, 7, 8, 10) are one plan in twelve: a few hundred
    // of them make the point, thousands would only make the test slow.
    const HEAVY: [usize; 5] = [5, 6, 7, 8, 10];
    const LIGHT: [usize; 20] = [
        0, 1, 2, 3, 4, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24,
    ];
    let kind = if g.below(12) == 0 {
        HEAVY[g.below(HEAVY.len())]
    } else {
        LIGHT[g.below(LIGHT.len())]
    };
    match kind {
        0..=5 | 22 => payload_plan(g, kind, path),
        6..=10 | 19 | 23 => head_plan(g, kind, path),
        _ => framing_plan(g, kind, path),
    }
}

/// A well-formed request that gets `valid` 200s (else a 4xx), closing its connection.
fn one(kind: &'static str, req: Vec<u8>, valid: usize) -> Plan {
    Plan {
        kind,
        writes: vec![close(&req)],
        shutdown: false,
        min_answers: 1,
        valid,
        requests: 1,
    }
}

/// Bytes a server may answer with a 4xx or just close on.
fn garbage(kind: &'static str, writes: Vec<Vec<u8>>, shutdown: bool) -> Plan {
    Plan {
        kind,
        writes,
        shutdown,
        min_answers: 0,
        valid: 0,
        requests: 1,
    }
}

/// Bodies: bad JSON, shapes, UTF-8, numbers, sizes; hostile scheduling headers.
fn payload_plan(g: &mut Rng, kind: usize, path: &'static str) -> Plan {
    match kind {
        0 => {
            let bodies: [&[u8]; 6] = [
                b"{",
                b"{\"messages\": [}",
                b"nul",
                b"",
                b"{\"a\":1,}",
                b"\x00",
            ];
            one("malformed JSON", post(path, bodies[g.below(6)], ""), 0)
        }
        1 => {
            let bodies: [&[u8]; 5] = [
                b"[]",
                b"{\"messages\": 5}",
                b"{\"prompt\": {\"a\": []}}",
                b"\"text\"",
                b"{\"max_tokens\": \"many\"}",
            ];
            one("wrong shape", post(path, bodies[g.below(5)], ""), 0)
        }
        2 => {
            let body = b"{\"model\":\"\xff\xfe\",\"messages\":[{\"role\":\"user\",\"content\":\"\xc0\x80\"}]}";
            one("invalid UTF-8", post(path, body, ""), 0)
        }
        3 => {
            let nums = [
                "1e99999",
                "-9223372036854775809",
                "18446744073709551616",
                "NaN",
                "1e308",
                "-0",
                "123456789012345678901234567890",
            ];
            let n = nums[g.below(nums.len())];
            let body = format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"x"}}],"prompt":"x","input":"x","max_tokens":{n},"temperature":{n},"timeout":{n}}}"#
            );
            one("absurd numbers", post(path, body.as_bytes(), ""), 0)
        }
        4 => {
            // Declared over the limit, the body not sent: 413 at once.
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
                [MAX_BODY + 1, 10 << 20, usize::MAX / 2][g.below(3)]
            );
            Plan {
                min_answers: 1,
                ..garbage(
                    "over the limit (Content-Length)",
                    vec![head.into_bytes()],
                    false,
                )
            }
        }
        5 => {
            // Chunked, no length, one byte over the limit, then nothing more.
            let mut w = format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            .into_bytes();
            for _ in 0..=(MAX_BODY / 4096) {
                w.extend_from_slice(b"1000\r\n");
                w.extend(std::iter::repeat_n(b'a', 4096));
                w.extend_from_slice(b"\r\n");
            }
            Plan {
                min_answers: 1,
                ..garbage("over the limit (chunked)", vec![w], false)
            }
        }
        22 => {
            let headers = [
                "X-Tandem-Priority: \u{ff}\r\n",
                "X-Tandem-Timeout: -inf\r\n",
                "X-Tandem-Tenant: ../../root\r\n",
                "Authorization: Bearer \r\n",
                "Content-Type: text/html\r\n",
                "Expect: 100-continue\r\n",
            ];
            let extra = headers[g.below(headers.len())];
            let body = format!(r#"{{"model":"{MODEL}","prompt":"hi","max_tokens":0}}"#);
            one(
                "hostile headers",
                post("/v1/completions", body.as_bytes(), extra),
                0,
            )
        }
        _ => unreachable!("kind {kind} is not a payload_plan"),
    }
}

/// Heads: huge values, counts and URIs, malformed lines, bad header bytes, lenient ones.
fn head_plan(g: &mut Rng, kind: usize, path: &'static str) -> Plan {
    match kind {
        6 => {
            let value = "v".repeat(100_000);
            let extra = format!("X-Big: {value}\r\n");
            garbage(
                "100 KB header",
                vec![close(&post(path, b"{}", &extra))],
                false,
            )
        }
        7 => {
            let extra: String = (0..10_000).map(|i| format!("X-H{i}: v\r\n")).collect();
            garbage(
                "10 000 headers",
                vec![close(&post(path, b"{}", &extra))],
                false,
            )
        }
        8 => {
            let extra = format!("X-Huge: {}\r\n", "h".repeat(1 << 20));
            garbage("1 MB head", vec![post(path, b"{}", &extra)], false)
        }
        9 => {
            let lines: [&[u8]; 7] = [
                b"GET\r\n\r\n",
                b"POST /v1/chat/completions HTTP/9.9\r\n\r\n",
                b"GET /%ZZ%00 HTTP/1.1\r\nHost: t\r\n\r\n",
                b" GET / HTTP/1.1\r\n\r\n",
                b"GET / HTTP/1.1 extra\r\n\r\n",
                b"\r\n\r\n\r\n",
                b"GET /\x7f HTTP/1.1\r\n\r\n",
            ];
            garbage(
                "malformed request line",
                vec![lines[g.below(7)].to_vec()],
                true,
            )
        }
        23 => {
            // Lenient but legal: an absolute-form target, bare-LF line ends. Served (200).
            let lines: [&[u8]; 2] = [
                b"GET http://elsewhere/v1/models HTTP/1.1\r\nHost: t\r\n\r\n",
                b"GET /health HTTP/1.1\nHost: t\n\n",
            ];
            Plan {
                valid: 1,
                ..garbage(
                    "lenient request line",
                    vec![lines[g.below(2)].to_vec()],
                    true,
                )
            }
        }
        10 => {
            let long = format!("GET /{} HTTP/1.1\r\nHost: t\r\n\r\n", "u".repeat(100_000));
            garbage("100 KB URI", vec![long.into_bytes()], true)
        }
        19 => {
            let heads: [&[u8]; 4] = [
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Bad: a\x00b\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nBad Name: v\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n: empty\r\n\r\n",
                b"POST /v1/completions HTTP/1.1\r\nHost: t\r\n folded: v\r\n\r\n",
            ];
            garbage("invalid header", vec![heads[g.below(4)].to_vec()], true)
        }
        _ => unreachable!("kind {kind} is not a head_plan"),
    }
}

/// Methods, versions, pipelines, message framing, other protocols, garbage; valid ones.
fn framing_plan(g: &mut Rng, kind: usize, path: &'static str) -> Plan {
    match kind {
        11 => {
            let reqs = [
                format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n"),
                "DELETE /health HTTP/1.1\r\nHost: t\r\n\r\n".to_string(),
                format!("BREW {path} HTTP/1.1\r\nHost: t\r\n\r\n"),
                "PUT /metrics HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n".to_string(),
                "OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n".to_string(),
                format!("PATCH {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\n{{}}"),
            ];
            one(
                "wrong method",
                reqs[g.below(reqs.len())].clone().into_bytes(),
                0,
            )
        }
        12 => {
            let body = br#"{"prompt": 12}"#;
            let mut r = format!(
                "POST /v1/completions HTTP/1.0\r\nContent-Length: {}\r\n\r\n",
                body.len()
            )
            .into_bytes();
            r.extend_from_slice(body);
            Plan {
                writes: vec![r],
                ..one("HTTP/1.0", Vec::new(), 0)
            }
        }
        13 | 14 => {
            // Pipelined: a valid health check, hostile ones, the last closing.
            let n = 2 + g.below(4);
            let mut w = health();
            for i in 1..n {
                let r = match g.below(3) {
                    0 => post(path, b"{\"x\":", ""),
                    1 => format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").into_bytes(),
                    _ => post(path, b"{\"messages\": []}", ""),
                };
                w.extend(if i + 1 == n { close(&r) } else { r });
            }
            Plan {
                kind: "pipelined",
                writes: vec![w],
                shutdown: false,
                min_answers: n,
                valid: 1,
                requests: n,
            }
        }
        15 => {
            let r = format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
            );
            garbage(
                "Content-Length + Transfer-Encoding",
                vec![r.into_bytes()],
                true,
            )
        }
        16 => {
            let sizes = ["zz", "ffffffffffffffffffff", "-1", "1;ext=\x01"];
            let r = format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n{}\r\nabc\r\n0\r\n\r\n",
                sizes[g.below(sizes.len())]
            );
            garbage("broken chunk size", vec![r.into_bytes()], true)
        }
        17 => {
            // Declares 100 bytes, sends 10, half-closes.
            let r = format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{{\"a\": 123"
            );
            garbage("body cut short", vec![r.into_bytes()], true)
        }
        18 => {
            let cls = [
                "-1",
                "99999999999999999999999",
                "1, 2",
                "abc",
                "5\r\nContent-Length: 6",
            ];
            let r = format!(
                "POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {}\r\n\r\n{{}}",
                cls[g.below(cls.len())]
            );
            garbage("bad Content-Length", vec![r.into_bytes()], true)
        }
        20 => {
            let mut w = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            w.extend((0..g.below(64)).map(|_| g.next_u64() as u8));
            garbage("HTTP/2 preface + garbage", vec![w], true)
        }
        21 => {
            let n = g.below(512);
            let w = (0..n).map(|_| g.next_u64() as u8).collect();
            garbage("garbage bytes", vec![w], true)
        }
        24 => {
            if g.below(2) == 0 {
                one("valid chat", valid_chat(), 1)
            } else {
                one("valid health", health(), 1)
            }
        }
        _ => unreachable!("kind {kind} is not a framing_plan"),
    }
}

// --- the server ---------------------------------------------------------------------------------

struct Server {
    addr: std::net::SocketAddr,
    state: HttpState,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start() -> Server {
    let tokenizer = Arc::new(Tokenizer::load(&TokenizerSpec::default()).expect("cl100k_base"));
    let config = HttpConfig {
        served_model_name: MODEL.to_string(),
        max_body_bytes: MAX_BODY,
        context_length: 4096,
        ..HttpConfig::default()
    };
    let state = HttpState::new(Arc::new(text_backend(tokenizer.clone())), config, tokenizer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    let cancel = CancellationToken::new();
    // As the binary serves it: the generation endpoints called ahead of the router.
    let task = tokio::spawn(http::serve(
        listener,
        http::Front::public(state.clone()),
        cancel.clone(),
    ));
    Server {
        addr,
        state,
        cancel,
        task,
    }
}

/// A new connection's answer to `req`, and how long it took.
async fn timed(addr: std::net::SocketAddr, req: Vec<u8>) -> (Option<u16>, Duration) {
    let started = Instant::now();
    let plan = Plan {
        kind: "probe",
        writes: vec![close(&req)],
        shutdown: false,
        min_answers: 1,
        valid: 1,
        requests: 1,
    };
    let out = run_plan(addr, &plan).await;
    (out.statuses.first().copied(), started.elapsed())
}

/// How a slow client ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum SlowEnd {
    /// Held open until the test let go.
    Open,
    /// Could not connect at all.
    Refused,
    /// The server answered with this status (then closed).
    Answered(u16),
    /// The server closed (or reset) it without an answer, after this many seconds.
    Closed(u64),
}

/// A partial head: one more header byte a second will never end it.
const SLOW_HEAD: &[u8] = b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nX-Slow: ";
/// A complete head whose body then comes one byte a second.
const SLOW_BODY: &[u8] =
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 60000\r\n\r\n{\"a\":\"";

/// A slow client: `head`, then one more byte a second until `stop`.
async fn slow_client(addr: std::net::SocketAddr, head: &[u8], stop: Arc<AtomicBool>) -> SlowEnd {
    let started = Instant::now();
    let Ok(mut stream) = TcpStream::connect(addr).await else {
        return SlowEnd::Refused;
    };
    let mut buf = Vec::new();
    let mut written = stream.write_all(head).await.is_ok();
    while written && !stop.load(Ordering::SeqCst) {
        let mut chunk = [0u8; 1024];
        match tokio::time::timeout(Duration::from_secs(1), stream.read(&mut chunk)).await {
            Err(_) => written = stream.write_all(b"a").await.is_ok(),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    if written && stop.load(Ordering::SeqCst) {
        return SlowEnd::Open;
    }
    match statuses(&buf).0.first() {
        Some(&status) => SlowEnd::Answered(status),
        None => SlowEnd::Closed(started.elapsed().as_secs()),
    }
}

/// `n` slow clients sending `head`; `stop` lets go of them.
fn spawn_slow(
    addr: std::net::SocketAddr,
    n: usize,
    head: &'static [u8],
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<SlowEnd>> {
    (0..n)
        .map(|_| tokio::spawn(slow_client(addr, head, stop.clone())))
        .collect()
}

async fn ends(clients: Vec<tokio::task::JoinHandle<SlowEnd>>) -> BTreeMap<SlowEnd, usize> {
    let mut out = BTreeMap::new();
    for c in clients {
        *out.entry(c.await.expect("slow client")).or_default() += 1;
    }
    out
}

/// What the hostile load saw.
#[derive(Default)]
struct Load {
    findings: Vec<String>,
    /// Per kind: requests, answers, connections without an answer, resets, milliseconds.
    kinds: BTreeMap<&'static str, [usize; 5]>,
    requests: usize,
}

impl Load {
    fn record(&mut self, plan: &Plan, out: &Outcome, took: Duration) {
        let answers = out.statuses.len();
        let ok = |(i, &s): (usize, &u16)| {
            if i < plan.valid {
                s == 200
            } else {
                (400..500).contains(&s)
            }
        };
        if !out.statuses.iter().enumerate().all(ok) || answers < plan.min_answers || out.hung {
            let first = &plan.writes[0][..plan.writes[0].len().min(120)];
            self.findings.push(format!(
                "{}: statuses {:?} (want {} answers, {} of them valid), hung {}, reset {}; \
                 first bytes {:?}",
                plan.kind,
                out.statuses,
                plan.min_answers,
                plan.valid,
                out.hung,
                out.reset,
                String::from_utf8_lossy(first)
            ));
        }
        let e = self.kinds.entry(plan.kind).or_default();
        e[0] += plan.requests;
        e[1] += answers;
        e[2] += usize::from(answers == 0);
        e[3] += usize::from(out.reset);
        e[4] += took.as_millis() as usize;
        self.requests += plan.requests;
    }
}

/// `requests` hostile requests, from `connections` clients at a time.
async fn hostile_load(addr: std::net::SocketAddr, requests: usize, connections: u64) -> Load {
    let load = Arc::new(Mutex::new(Load::default()));
    let sent = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..connections)
        .map(|c| {
            let (load, sent) = (load.clone(), sent.clone());
            tokio::spawn(async move {
                let mut g = Rng::seed_from_u64(0x405_7113 ^ c);
                while sent.load(Ordering::SeqCst) < requests {
                    let plan = plan(&mut g);
                    sent.fetch_add(plan.requests, Ordering::SeqCst);
                    let t0 = Instant::now();
                    let out = run_plan(addr, &plan).await;
                    load.lock().record(&plan, &out, t0.elapsed());
                }
            })
        })
        .collect();
    for c in clients {
        c.await.expect("client task");
    }
    std::mem::take(&mut *load.lock())
}

/// `/health` and a chat request on new connections, every 250 ms, until `done` and at
/// least `min` have passed: their statuses and latencies.
fn spawn_probes(
    addr: std::net::SocketAddr,
    done: Arc<AtomicBool>,
    min: Duration,
) -> tokio::task::JoinHandle<Vec<(Option<u16>, Duration)>> {
    tokio::spawn(async move {
        let mut seen = Vec::new();
        let started = Instant::now();
        while !done.load(Ordering::SeqCst) || started.elapsed() < min {
            tokio::time::sleep(Duration::from_millis(250)).await;
            for req in [health(), valid_chat()] {
                seen.push(timed(addr, req).await);
            }
        }
        seen
    })
}

/// A test harness switch (`TANDEM_HOSTILE_*`), not configuration of tandem.
fn env_usize(name: &str) -> Option<usize> {
    #[allow(clippy::disallowed_methods)]
    let v = std::env::var(name).ok()?;
    v.parse().ok()
}

/// Counts panics (in handlers too: they run on this process's threads).
fn count_panics() -> Arc<AtomicUsize> {
    let panics = Arc::new(AtomicUsize::new(0));
    let default_hook = std::panic::take_hook();
    let counted = panics.clone();
    std::panic::set_hook(Box::new(move |info| {
        counted.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));
    panics
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_clients_get_4xx_and_the_server_stays_healthy() {
    let requests = env_usize("TANDEM_HOSTILE_REQUESTS").unwrap_or(10_000);
    let slow_secs = env_usize("TANDEM_HOSTILE_SLOW_SECS").unwrap_or(5) as u64;
    let panics = count_panics();
    let server = start().await;
    let addr = server.addr;
    let started = Instant::now();

    // Slow clients (300 on the head, 20 on the body) and probes, for the whole load.
    let stop = Arc::new(AtomicBool::new(false));
    let slow_heads = spawn_slow(addr, 300, SLOW_HEAD, &stop);
    let slow_bodies = spawn_slow(addr, 20, SLOW_BODY, &stop);
    let load_done = Arc::new(AtomicBool::new(false));
    let probes = spawn_probes(addr, load_done.clone(), Duration::from_secs(slow_secs));

    let load = hostile_load(addr, requests, 16).await;
    let load_time = started.elapsed();
    load_done.store(true, Ordering::SeqCst);
    let probes = probes.await.expect("probe task");
    // Requests counted in flight now: only the slow bodies are still being read.
    let in_flight = server.state.in_flight();
    stop.store(true, Ordering::SeqCst);
    let (heads, bodies) = (ends(slow_heads).await, ends(slow_bodies).await);
    let held = started.elapsed();

    // Still healthy.
    let (health_status, _) = timed(addr, health()).await;
    let (chat_status, _) = timed(addr, valid_chat()).await;
    let server_alive = !server.task.is_finished();

    // Graceful shutdown with ten slowloris connections attached.
    let stop_late = Arc::new(AtomicBool::new(false));
    let late = spawn_slow(addr, 10, SLOW_HEAD, &stop_late);
    tokio::time::sleep(Duration::from_millis(300)).await;
    server.cancel.cancel();
    let shutdown = tokio::time::timeout(Duration::from_secs(3), server.task).await;
    stop_late.store(true, Ordering::SeqCst);
    let late = ends(late).await;
    let _ = std::panic::take_hook();

    let slowest = probes.iter().map(|p| p.1).max().unwrap_or_default();
    eprintln!(
        "{} requests in {load_time:.1?}; per kind [requests, answers, connections without an \
         answer, resets, ms]: {:?}",
        load.requests, load.kinds
    );
    eprintln!(
        "after {held:.1?}: 300 slow heads {heads:?}, 20 slow bodies {bodies:?}; {} probes, \
         slowest {slowest:?}; {in_flight} requests counted in flight with the slow bodies \
         attached; graceful shutdown with 10 slow heads attached: {} ({late:?})",
        probes.len(),
        match &shutdown {
            Ok(_) => "finished",
            Err(_) => "still waiting after 3 s",
        }
    );
    assert!(
        load.findings.is_empty(),
        "{} findings:\n{}",
        load.findings.len(),
        load.findings[..load.findings.len().min(20)].join("\n")
    );
    assert_eq!(panics.load(Ordering::SeqCst), 0, "handlers panicked");
    assert!(server_alive, "the server task ended");
    assert!(
        probes.iter().all(|p| p.0 == Some(200)),
        "a probe was not answered 200: {probes:?}"
    );
    // A liveness bound, not a benchmark: seconds are an eternity on loopback, even on a
    // busy two-core machine.
    assert!(slowest < Duration::from_secs(5), "a probe took {slowest:?}");
    assert_eq!(health_status, Some(200));
    assert_eq!(chat_status, Some(200));
}
