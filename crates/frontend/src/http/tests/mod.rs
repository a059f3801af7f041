//! Tests of the HTTP edge against a fake [`Backend`], through the real axum router
//! (`tower::ServiceExt::oneshot`) and, for disconnects and shutdown, a loopback listener.

mod agents;
mod auth;
mod budgets;
mod cascade_verifier;
mod embeddings;
mod errors;
mod experiment;
mod groups;
mod hints;
mod lora;
mod ops;
mod responses;
mod semantic_cache;
mod templates;

use crate::http::TokenLogprob;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use futures::StreamExt;
use http_body_util::BodyExt;
use serde_json::Value;
use tower::ServiceExt;

use super::backend::{Backend, FinishReason, Generation, RouteInfo, TokenChunk, ValidRequest};
use super::error::ServeError;
use super::state::{HttpConfig, HttpState};
use super::tokenizer::{Tokenizer, TokenizerSpec};

/// cl100k_base, built once for all tests.
pub(crate) fn cl100k() -> Arc<Tokenizer> {
    static TOK: LazyLock<Arc<Tokenizer>> = LazyLock::new(|| {
        Arc::new(Tokenizer::load(&TokenizerSpec::default()).expect("cl100k_base"))
    });
    TOK.clone()
}

/// What the fake backend does with the next request.
#[derive(Clone, Debug)]
pub(crate) enum Script {
    /// Streams `text`'s tokens one per chunk, the last with `finish` (or, if `hang`, none:
    /// then the stream stays open until dropped).
    Text {
        text: String,
        finish: FinishReason,
        hang: bool,
    },
    /// `generate` itself fails.
    FailGenerate(ServeError),
    /// The first item of the stream is this error.
    FailFirst(ServeError),
    /// Streams `text`'s tokens, then this error.
    FailAfter(String, ServeError),
    /// Never yields anything until dropped.
    Hang,
    /// Ends at once, without any chunk.
    Empty,
}

pub(crate) const CACHED: u32 = 7;

/// A backend that plays a [`Script`] and records what it saw and whether its stream was
/// dropped.
#[derive(Debug)]
pub(crate) struct FakeBackend {
    script: Mutex<Script>,
    ready: AtomicBool,
    route: RouteInfo,
    pub seen: Mutex<Vec<ValidRequest>>,
    /// `Some(d)`: report `len(prompt) + d` prompt tokens as the engine's count.
    engine_delta: Mutex<Option<i64>>,
    dropped: Arc<AtomicBool>,
    /// Notified when a request arrives and when a stream is dropped.
    changed: Arc<tokio::sync::Notify>,
    /// Retries left in its budget (`None`: no budget kept).
    retries: Mutex<Option<u32>>,
    /// Answers a request that asks for an embedding with [`fake_embedding`] (else none, as
    /// an engine without embeddings).
    pub embeds: AtomicBool,
}

/// The fake's embedding of a prompt: its tokens counted into 16 buckets, at length 1 (the
/// same tokens in any order give the same vector; one token more or less moves it a little).
pub(crate) fn fake_embedding(prompt: &[u32]) -> Vec<f32> {
    let mut v = [0.0f32; 16];
    for &t in prompt {
        v[(t.wrapping_mul(2_654_435_761) >> 28) as usize] += 1.0;
    }
    let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.iter().map(|x| x / norm.max(f32::MIN_POSITIVE)).collect()
}

impl FakeBackend {
    pub(crate) fn new(script: Script) -> Arc<Self> {
        Arc::new(FakeBackend {
            script: Mutex::new(script),
            ready: AtomicBool::new(true),
            route: RouteInfo {
                decode_worker: 11,
                prefill_worker: Some(22),
            },
            seen: Mutex::new(Vec::new()),
            engine_delta: Mutex::new(None),
            dropped: Arc::new(AtomicBool::new(false)),
            changed: Arc::new(tokio::sync::Notify::new()),
            retries: Mutex::new(None),
            embeds: AtomicBool::new(true),
        })
    }

    /// Keeps a retry budget of `n` retries.
    pub(crate) fn set_retry_budget(&self, n: u32) {
        *self.retries.lock() = Some(n);
    }

    pub(crate) fn text(text: &str) -> Arc<Self> {
        Self::new(Script::Text {
            text: text.to_string(),
            finish: FinishReason::Stop,
            hang: false,
        })
    }

    pub(crate) fn local(script: Script) -> Arc<Self> {
        let mut b = Self::new(script);
        Arc::get_mut(&mut b).unwrap().route.prefill_worker = None;
        b
    }

    /// From now on, report `len(prompt) + delta` as the engine's prompt length.
    pub(crate) fn report_prompt_tokens(&self, delta: i64) {
        *self.engine_delta.lock() = Some(delta);
    }

    /// Replaces the script for the next requests.
    pub(crate) fn set_script(&self, script: Script) {
        *self.script.lock() = script;
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::SeqCst);
    }

    pub(crate) fn last_request(&self) -> ValidRequest {
        self.seen.lock().last().cloned().expect("a request")
    }

    pub(crate) fn was_dropped(&self) -> bool {
        self.dropped.load(Ordering::SeqCst)
    }

    /// Waits (up to 5 s) for the last stream to be dropped.
    pub(crate) async fn wait_dropped(&self) {
        self.wait_until(|b| b.was_dropped(), "the backend stream was not dropped")
            .await;
    }

    /// Waits (up to 5 s) for a request to reach the backend.
    pub(crate) async fn wait_seen(&self) {
        self.wait_until(
            |b| !b.seen.lock().is_empty(),
            "no request reached the backend",
        )
        .await;
    }

    async fn wait_until(&self, done: impl Fn(&Self) -> bool, what: &str) {
        let waited = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let changed = self.changed.notified();
                if done(self) {
                    return;
                }
                changed.await;
            }
        });
        waited.await.unwrap_or_else(|_| panic!("{what}"));
    }
}

/// Sets a flag when dropped (moved into the fake's stream), and says so.
struct DropFlag(Arc<AtomicBool>, Arc<tokio::sync::Notify>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
        self.1.notify_waiters();
    }
}

fn chunks_of(text: &str, finish: Option<FinishReason>) -> Vec<Result<TokenChunk, ServeError>> {
    let tokens = cl100k().encode(text).unwrap();
    let mut chunks = crate::testing::token_chunks(&tokens, 1, finish.unwrap_or(FinishReason::Stop));
    for c in chunks.iter_mut().flatten() {
        c.cached_tokens = CACHED;
        c.finish = c.finish.and(finish);
    }
    chunks
}

#[async_trait::async_trait]
impl Backend for FakeBackend {
    async fn generate(&self, req: ValidRequest) -> Result<Generation, ServeError> {
        if let Some(delta) = *self.engine_delta.lock() {
            let n = req.prompt_tokens.len() as i64 + delta;
            req.engine.set_prompt_tokens(u32::try_from(n).unwrap_or(0));
        }
        let asked = req.logprobs;
        let embedding = (req.embed && self.embeds.load(Ordering::SeqCst))
            .then(|| fake_embedding(&req.prompt_tokens));
        self.seen.lock().push(req);
        self.dropped.store(false, Ordering::SeqCst);
        self.changed.notify_waiters();
        let script = self.script.lock().clone();
        let (items, hang) = match script {
            Script::Text { text, finish, hang } => {
                (chunks_of(&text, (!hang).then_some(finish)), hang)
            }
            Script::FailGenerate(e) => return Err(e),
            Script::FailFirst(e) => (vec![Err(e)], true),
            Script::FailAfter(text, e) => {
                let mut items = chunks_of(&text, None);
                items.push(Err(e));
                (items, true)
            }
            Script::Hang => (Vec::new(), true),
            Script::Empty => (Vec::new(), false),
        };
        // Asked for logprobs: the i-th token of a chunk has -i/4, and the next id as the
        // one other alternative.
        let items = items.into_iter().map(|item| {
            item.map(|mut c| {
                if let Some(n) = asked {
                    c.logprobs = c
                        .tokens
                        .iter()
                        .enumerate()
                        .map(|(i, &t)| {
                            let lp = -(i as f32) / 4.0;
                            let mut top = vec![(t, lp), (t + 1, lp - 1.0)];
                            top.truncate(n.into());
                            TokenLogprob { logprob: lp, top }
                        })
                        .collect();
                }
                c
            })
        });
        let mut items: Vec<_> = items.collect();
        if let (Some(v), Some(Ok(first))) = (embedding, items.first_mut()) {
            first.embedding = v;
        }
        let flag = DropFlag(self.dropped.clone(), self.changed.clone());
        let tail = if hang {
            futures::stream::pending().boxed()
        } else {
            futures::stream::empty().boxed()
        };
        let chunks = futures::stream::iter(items)
            .chain(tail)
            .map(move |item| {
                let _keep = &flag;
                item
            })
            .boxed();
        Ok(Generation {
            route: self.route,
            chunks,
        })
    }

    fn ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn try_retry(&self) -> bool {
        match &mut *self.retries.lock() {
            None => true,
            Some(0) => false,
            Some(n) => {
                *n -= 1;
                true
            }
        }
    }
}

pub(crate) fn config() -> HttpConfig {
    HttpConfig {
        served_model_name: "tandem-test".to_string(),
        ..HttpConfig::default()
    }
}

pub(crate) fn setup(backend: Arc<FakeBackend>, config: HttpConfig) -> (Router, HttpState) {
    let state = HttpState::new(backend, config, cl100k());
    (super::app(state.clone()), state)
}

/// `GET /metrics` on `state`'s admin listener.
pub(crate) async fn scrape(state: &HttpState) -> String {
    body_text(send(&super::admin_app(state.clone()), get("/metrics")).await).await
}

pub(crate) async fn send(app: &Router, req: Request<Body>) -> Response<Body> {
    app.clone().oneshot(req).await.expect("infallible")
}

pub(crate) fn post(path: &str, body: impl Into<Body>) -> Request<Body> {
    Request::post(path)
        .header("content-type", "application/json")
        .body(body.into())
        .unwrap()
}

pub(crate) fn post_json(path: &str, body: &Value) -> Request<Body> {
    post(path, body.to_string())
}

pub(crate) fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

pub(crate) async fn body_text(resp: Response<Body>) -> String {
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8(bytes.to_vec()).unwrap()
}

pub(crate) async fn body_json(resp: Response<Body>) -> Value {
    let text = body_text(resp).await;
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// The `data:` payloads of an SSE body, in order.
pub(crate) fn sse_data(body: &str) -> Vec<String> {
    assert!(
        body.ends_with("\n\n"),
        "events end with a blank line: {body:?}"
    );
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data event: {e:?}"))
                .to_string()
        })
        .collect()
}

pub(crate) fn header<'a>(resp: &'a Response<Body>, name: &str) -> Option<&'a str> {
    resp.headers().get(name).map(|v| v.to_str().unwrap())
}

/// Asserts an OpenAI error response: status, and the four fields of `error`.
pub(crate) async fn assert_error(
    resp: Response<Body>,
    status: StatusCode,
    code: Option<&str>,
    param: Option<&str>,
) -> Value {
    assert_eq!(resp.status(), status);
    assert_eq!(header(&resp, "content-type"), Some("application/json"));
    let v = body_json(resp).await;
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert_eq!(e["code"].as_str(), code, "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert_eq!(e.as_object().unwrap().len(), 4, "{v}");
    v
}
