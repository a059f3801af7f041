//! The HTTP client of the generation calls, the one request every token passes through.
//!
//! An `http://` engine is posted to over hyper's own HTTP/1.1 connections, pooled here
//! (`pool.rs`): reqwest, on top of hyper-util's pooled client, parsed the URL twice more per
//! request for its redirect policy, matched it against the proxy rules and wrapped the call
//! in its own futures — about a tenth of `tandem frontend --backend-url`'s CPU per request
//! (BENCHMARKS.md); the pooled client itself another 8 %. Engines are not redirected
//! and not proxied here. An `https://` engine (a hosted API) keeps reqwest, for its TLS.
//!
//! Each serving thread (`tandem_runtime::serving`) has its own pool: a pooled connection's
//! task runs on the runtime that opened it, so a request served on one thread that took a
//! connection opened on another would wake that thread twice per call.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use futures::StreamExt;
use http::uri::Authority;
use http_body_util::Full;
use reqwest::header::{CONTENT_TYPE, HOST, HeaderMap, HeaderValue};

use super::EngineError;
use super::pool::{LeasedBody, Pool};

/// Pools of one engine: one for code off the serving threads, and one per serving thread
/// (threads past this share them, modulo).
const POOLS: usize = 65;

/// Posts JSON to one engine.
#[derive(Clone, Debug)]
pub(crate) enum Poster {
    /// The engine's authority, and a pool per serving thread, made when that thread first
    /// posts.
    Plain(Authority, Arc<[OnceLock<Arc<Pool>>]>),
    Tls(reqwest::Client),
}

/// Where a post goes: parsed once, for the client that posts it.
#[derive(Clone, Debug)]
pub(crate) enum Target {
    Plain(PlainTarget),
    Tls(reqwest::Url),
}

/// A plain engine's URL, and what its requests carry of it.
#[derive(Clone, Debug)]
pub(crate) struct PlainTarget {
    uri: http::Uri,
    /// The request line's origin form (path and query).
    path: http::Uri,
    host: HeaderValue,
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Plain(t) => t.uri.fmt(f),
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
    Plain(LeasedBody),
    Tls(reqwest::Response),
}

impl Poster {
    /// The client for an engine under `base` (`http://…` or `https://…`), with `tls` the
    /// reqwest client an `https://` engine is called with.
    pub(crate) fn for_base(base: &str, tls: &reqwest::Client) -> Poster {
        let plain = base.strip_prefix("http://").and_then(|rest| {
            let authority = rest.split('/').next().unwrap_or_default();
            authority.parse::<Authority>().ok()
        });
        match plain {
            Some(authority) => {
                Poster::Plain(authority, (0..POOLS).map(|_| OnceLock::new()).collect())
            }
            // Not a plain URL hyper parses: reqwest's client, which says what is wrong with it.
            None => Poster::Tls(tls.clone()),
        }
    }

    /// `url` parsed for this client.
    pub(crate) fn target(&self, url: &str) -> Result<Target, EngineError> {
        let bad = |e: String| EngineError::Protocol(format!("--engine-url {url:?}: {e}"));
        match self {
            Poster::Plain(authority, _) => {
                let uri: http::Uri = url.parse().map_err(|e| bad(format!("{e}")))?;
                if uri.scheme_str() != Some("http") || uri.authority() != Some(authority) {
                    return Err(bad(format!("not under http://{authority}")));
                }
                let path = match uri.path_and_query() {
                    Some(p) => p.as_str().parse().map_err(|e| bad(format!("{e}")))?,
                    None => http::Uri::from_static("/"),
                };
                // Host and port: never the user information an authority may carry.
                let host = match authority.port() {
                    Some(port) => format!("{}:{port}", authority.host()),
                    None => authority.host().to_string(),
                };
                let host = HeaderValue::from_str(&host).map_err(|e| bad(format!("{e}")))?;
                Ok(Target::Plain(PlainTarget { uri, path, host }))
            }
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
            (Poster::Plain(authority, pools), Target::Plain(t)) => {
                let pool = tandem_runtime::serving::serving_index() % pools.len();
                let pool = pools[pool].get_or_init(Default::default);
                let mut req = http::Request::post(t.path.clone())
                    .body(Full::new(Bytes::from(body)))
                    .map_err(|e| unreachable(&e))?;
                // The caller's map becomes the request's: one map, its entries not hashed
                // again.
                let mut headers = headers;
                headers.insert(HOST, t.host.clone());
                headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                *req.headers_mut() = headers;
                let (resp, lease) = pool.send(authority, req).await?;
                let status = resp.status().as_u16();
                Ok(Answer {
                    status,
                    body: AnswerBody::Plain(LeasedBody::new(resp.into_body(), lease)),
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
                .map_err(|e| EngineError::Unreachable(e.to_string())),
            AnswerBody::Tls(r) => r
                .bytes()
                .await
                .map_err(|e| EngineError::Unreachable(e.to_string())),
        }
    }

    /// The body's bytes as they arrive. Dropping the stream before its end drops the
    /// connection (it is not returned to the pool unfinished), which is how the engine learns
    /// the client left.
    pub(crate) fn stream(self) -> futures::stream::BoxStream<'static, Result<Bytes, EngineError>> {
        match self.body {
            AnswerBody::Plain(b) => b
                .map(|r| r.map_err(|e| EngineError::Unreachable(e.to_string())))
                .boxed(),
            AnswerBody::Tls(r) => r
                .bytes_stream()
                .map(|r| r.map_err(|e| EngineError::Unreachable(e.to_string())))
                .boxed(),
        }
    }
}
