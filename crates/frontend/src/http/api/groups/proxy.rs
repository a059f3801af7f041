//! An endpoint's answer on its way back: the status, content type and `Retry-After` it
//! gave, the groups' headers, and a body stream that reports how the answer ended.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::Response;
use futures::StreamExt;
use tandem_router::groups::{EndpointRef, Outcome};

use super::{GroupGate, Spill};

/// `body` with its `model` set to `model` (unchanged when `None` or not a JSON object).
pub(super) fn with_model(body: &Bytes, model: Option<&str>) -> Bytes {
    let Some(model) = model else {
        return body.clone();
    };
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(body) {
        Ok(mut map) => {
            map.insert("model".into(), model.into());
            serde_json::to_vec(&map).map_or_else(|_| body.clone(), Bytes::from)
        }
        Err(_) => body.clone(),
    }
}

/// At most 64 KiB of an error answer's body.
pub(super) async fn read_limited(answer: reqwest::Response) -> Bytes {
    const LIMIT: usize = 64 * 1024;
    let mut out = Vec::new();
    let mut stream = answer.bytes_stream();
    while let Some(Ok(piece)) = stream.next().await {
        let room = LIMIT - out.len();
        out.extend_from_slice(&piece[..piece.len().min(room)]);
        if out.len() >= LIMIT {
            break;
        }
    }
    Bytes::from(out)
}

/// The endpoint's answer, passed back with its status and content type, and the groups'
/// headers.
pub(super) fn passed_back(
    status: StatusCode,
    headers: &HeaderMap,
    body: impl Into<Body>,
    group: Option<&str>,
    spill: Option<&Spill>,
) -> Response {
    let mut response = Response::new(body.into());
    *response.status_mut() = status;
    // What the client can use of the endpoint's head: the body's type, when to come back,
    // and the ids and routing another tandem (or a hosted API's request id) reports; the
    // groups' own headers are set after.
    for (name, value) in headers {
        let n = name.as_str();
        if name == header::CONTENT_TYPE
            || name == header::RETRY_AFTER
            || n == "x-request-id"
            || n.starts_with("x-tandem-")
        {
            response.headers_mut().append(name, value.clone());
        }
    }
    if let Some(group) = group {
        mark(&mut response, group, spill);
    } else if let Some(s) = spill {
        mark_spill(&mut response, s);
    }
    response
}

pub(super) fn mark(response: &mut Response, group: &str, spill: Option<&Spill>) {
    if let Ok(v) = HeaderValue::from_str(group) {
        response.headers_mut().insert("x-tandem-group", v);
    }
    if let Some(s) = spill {
        mark_spill(response, s);
    }
}

pub(super) fn mark_spill(response: &mut Response, spill: &Spill) {
    for (name, value) in [
        ("x-tandem-spillover-from", &spill.from),
        ("x-tandem-spillover-error", &spill.error),
    ] {
        if let Ok(v) = HeaderValue::from_str(value) {
            response.headers_mut().insert(name, v);
        }
    }
}

/// An endpoint's answer body on its way to the client, telling the groups how it went: its
/// first bytes' latency and success at the end, failure if it breaks, nothing if the client
/// leaves first.
pub(super) struct Reporting {
    pub(super) gate: Arc<GroupGate>,
    pub(super) generation: u64,
    pub(super) endpoint: EndpointRef,
    pub(super) sent: Instant,
    pub(super) first: Option<Duration>,
    pub(super) inner: futures::stream::BoxStream<'static, reqwest::Result<Bytes>>,
    pub(super) done: bool,
    /// The request's bill and its prompt's estimated tokens, settled when the answer ends
    /// (whole, broken or left by the client: what passed was used).
    pub(super) bill: Option<(super::Bill, u64)>,
    pub(super) usage: super::budget::Usage,
}

impl Reporting {
    fn end(&mut self, outcome: Outcome) {
        if !self.done {
            self.done = true;
            self.gate.finished(self.generation, self.endpoint, outcome);
        }
        if let Some((bill, prompt_estimate)) = self.bill.take() {
            let (prompt, completion) = self.usage.tokens(prompt_estimate);
            bill.settle(prompt, completion);
        }
    }
}

impl futures::Stream for Reporting {
    type Item = reqwest::Result<Bytes>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        let item = std::task::ready!(self.inner.poll_next_unpin(cx));
        match &item {
            Some(Ok(piece)) => {
                if self.first.is_none() {
                    self.first = Some(self.sent.elapsed());
                }
                if self.bill.is_some() {
                    self.usage.saw(piece);
                }
            }
            Some(Err(_)) => self.end(Outcome::Failed {
                status: None,
                retry_after_ms: None,
            }),
            None => {
                let ttft_ms = self.first.map(|d| d.as_millis() as u64);
                self.end(Outcome::Ok { ttft_ms, tokens: 0 });
            }
        }
        std::task::Poll::Ready(item)
    }
}

impl Drop for Reporting {
    fn drop(&mut self) {
        self.end(Outcome::Cancelled);
    }
}
