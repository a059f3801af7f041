//! The HTTP client of the generation calls, the one request every token passes through.
//!
//! An `http://` engine is posted to through hyper's pooled client directly: reqwest, on top
//! of the same client, parsed the URL twice more per request for its redirect policy,
//! matched it against the proxy rules and wrapped the call in its own futures — about a
//! tenth of `tandem frontend --backend-url`'s CPU per request (BENCHMARKS.md). Engines are
//! not redirected and not proxied here. An `https://` engine (a hosted API) keeps reqwest,
//! for its TLS.
//!
//! Each serving thread (`tandem_runtime::serving`) has its own pool: a pooled connection's
//! task runs on the runtime that opened it, so a request served on one thread that took a
//! connection opened on another would wake that thread twice per call.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use reqwest::header::{CONTENT_TYPE, HeaderMap, HeaderValue};

use super::EngineError;

/// How long a connection to the engine may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an idle pooled connection is kept.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Pools of one engine: one for code off the serving threads, and one per serving thread
/// (threads past this share them, modulo).
const POOLS: usize = 65;

type PlainClient = Client<HttpConnector, Full<Bytes>>;

/// Posts JSON to one engine.
#[derive(Clone, Debug)]
pub(crate) enum Poster {
    /// A client per serving thread, made when that thread first posts.
    Plain(Arc<[OnceLock<PlainClient>]>),
    Tls(reqwest::Client),
}

fn plain_client() -> PlainClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(IDLE_TIMEOUT)
        .pool_timer(TokioTimer::new())
        .build(connector)
}

/// Where a post goes: parsed once, for the client that posts it.
#[derive(Clone, Debug)]
pub(crate) enum Target {
    Plain(http::Uri),
    Tls(reqwest::Url),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Plain(uri) => uri.fmt(f),
            Target::Tls(url) => url.fmt(f),
        }
    }
}

/// An engine's answer: its status, and its body as it arrives.
pub(crate) struct Answer {
    pub(crate) status: u16,
    body: AnswerBody,
}

enum AnswerBody {
    Plain(hyper::body::Incoming),
    Tls(reqwest::Response),
}

impl Poster {
    /// The client for an engine under `base` (`http://…` or `https://…`), with `tls` the
    /// reqwest client an `https://` engine is called with.
    pub(crate) fn for_base(base: &str, tls: &reqwest::Client) -> Poster {
        if base.starts_with("http://") {
            Poster::Plain((0..POOLS).map(|_| OnceLock::new()).collect())
        } else {
            Poster::Tls(tls.clone())
        }
    }

    /// `url` parsed for this client.
    pub(crate) fn target(&self, url: &str) -> Result<Target, EngineError> {
        let bad = |e: String| EngineError::Protocol(format!("--engine-url {url:?}: {e}"));
        match self {
            Poster::Plain(_) => url
                .parse()
                .map(Target::Plain)
                .map_err(|e| bad(format!("{e}"))),
            Poster::Tls(_) => reqwest::Url::parse(url)
                .map(Target::Tls)
                .map_err(|e| bad(e.to_string())),
        }
    }

    /// Posts `body` (JSON) to `target` with `headers`.
    pub(crate) async fn post(
        &self,
        target: &Target,
        headers: HeaderMap,
        body: Vec<u8>,
    ) -> Result<Answer, EngineError> {
        let unreachable = |e: &dyn std::fmt::Display| EngineError::Unreachable(e.to_string());
        match (self, target) {
            (Poster::Plain(clients), Target::Plain(uri)) => {
                let pool = tandem_runtime::serving::serving_index() % clients.len();
                let client = clients[pool].get_or_init(plain_client);
                let mut req = http::Request::post(uri.clone())
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|e| unreachable(&e))?;
                let h = req.headers_mut();
                h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                h.extend(headers);
                let resp = client.request(req).await.map_err(|e| {
                    // hyper's error alone says "client error (Connect)": its source says why.
                    let why = std::error::Error::source(&e)
                        .map(|s| format!("{e}: {s}"))
                        .unwrap_or_else(|| e.to_string());
                    EngineError::Unreachable(why)
                })?;
                Ok(Answer {
                    status: resp.status().as_u16(),
                    body: AnswerBody::Plain(resp.into_body()),
                })
            }
            (Poster::Tls(client), Target::Tls(url)) => {
                let resp = client
                    .post(url.clone())
                    .headers(headers)
                    .header(CONTENT_TYPE, "application/json")
                    .body(body)
                    .send()
                    .await
                    .map_err(|e| unreachable(&e))?;
                Ok(Answer {
                    status: resp.status().as_u16(),
                    body: AnswerBody::Tls(resp),
                })
            }
            _ => Err(EngineError::Protocol(
                "an engine URL parsed for another client".into(),
            )),
        }
    }
}

impl Answer {
    pub(crate) fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The whole body.
    pub(crate) async fn bytes(self) -> Result<Bytes, EngineError> {
        match self.body {
            AnswerBody::Plain(b) => b
                .collect()
                .await
                .map(|c| c.to_bytes())
                .map_err(|e| EngineError::Unreachable(e.to_string())),
            AnswerBody::Tls(r) => r
                .bytes()
                .await
                .map_err(|e| EngineError::Unreachable(e.to_string())),
        }
    }

    /// The body's bytes as they arrive. Dropping the stream drops the connection (it is not
    /// returned to the pool unfinished), which is how the engine learns the client left.
    pub(crate) fn stream(self) -> futures::stream::BoxStream<'static, Result<Bytes, EngineError>> {
        match self.body {
            AnswerBody::Plain(b) => b
                .into_data_stream()
                .map(|r| r.map_err(|e| EngineError::Unreachable(e.to_string())))
                .boxed(),
            AnswerBody::Tls(r) => r
                .bytes_stream()
                .map(|r| r.map_err(|e| EngineError::Unreachable(e.to_string())))
                .boxed(),
        }
    }
}
