//! One ext_proc stream, i.e. one HTTP request through the gateway: Envoy's messages in, the
//! picker's answers out (envoyproxy/data-plane-api envoy/service/ext_proc/v3/
//! external_processor.proto; GIE docs/proposals/004-endpoint-picker-protocol/README.md).
//!
//! When the answer goes depends on how Envoy sends the request body, which it reports in
//! the first message's `protocol_config.request_body_mode`:
//!
//! - `FULL_DUPLEX_STREAMED` (what GIE's gateways configure; also assumed when Envoy does not
//!   say): Envoy streams the body without waiting, and forwards what the processor sends
//!   back. The headers answer is held until the body's end (or its trailers): then the
//!   headers response carries the destination header and `envoy.lb` metadata, and one body
//!   response hands the whole body back (`streamed_response`).
//! - `BUFFERED` / `BUFFERED_PARTIAL`: Envoy waits for the headers answer before it sends the
//!   body in one message. The headers get an empty answer at once; the body's answer carries
//!   the header mutation (applied to the still-held request headers) and the metadata. A
//!   partial body (no `end_of_stream`) is routed on load alone.
//! - `NONE` / `STREAMED`: the headers leave before any body: the request is routed on load
//!   alone when its headers come, and body chunks get empty answers.
//!
//! A request routed nowhere gets an `immediate_response`: 503 when no endpoint is ready, 429
//! when flow control sheds it, 400/413/404 for bodies the frontend would refuse, each with
//! the frontend's OpenAI-style JSON error body. The response side: the served endpoint is
//! read from `metadata_context` (`envoy.lb` / `x-gateway-destination-endpoint-served`); the
//! first response body chunk ends the request's prefill load; the response's end (last body
//! chunk, trailers, or the stream closing) ends its tracker entry. Response bodies are
//! passed back as they came (`streamed_response` in full-duplex mode).

use std::sync::Arc;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use prost_types::value::Kind;
use prost_types::{Struct, Value};
use tonic::{Status, Streaming};

use super::picker::{Picked, Picker};
use super::proto::envoy::config::core::v3::{
    HeaderValue as PbHeaderValue, HeaderValueOption, header_value_option::HeaderAppendAction,
};
use super::proto::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use super::proto::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpBody,
    HttpHeaders, ImmediateResponse, ProcessingRequest, ProcessingResponse, StreamedBodyResponse,
    TrailersResponse, body_mutation, processing_request, processing_response,
};
use super::proto::envoy::r#type::v3::HttpStatus;
use crate::http::{ServeError, endpoint_of};

/// The `envoy.lb` namespace and its keys (GIE's protocol, "Destination Endpoint" and
/// "Destination Endpoint Served"; pkg/lwepp/metadata/consts.go).
pub(crate) const LB_NAMESPACE: &str = "envoy.lb";
pub(crate) const DESTINATION: &str = "x-gateway-destination-endpoint";
pub(crate) const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The subset hint ("Endpoint Subset"): `envoy.lb.subset_hint` /
/// `x-gateway-destination-endpoint-subset`, a list of `ip:port`.
pub(crate) const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub(crate) const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// GIE's fairness id header: the request's tenant when `x-tandem-tenant` is not set.
const FAIRNESS_ID: &str = "x-gateway-inference-fairness-id";

/// Where an exchange is.
enum Phase {
    /// Reading the request.
    Request,
    /// Routed; the response may come.
    Routed(Box<Picked>),
    /// Answered with an immediate response, or the response ended.
    Done,
}

/// One stream's state.
pub(crate) struct Exchange {
    picker: Arc<Picker>,
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    headers: HeaderMap,
    path: String,
    body: Vec<u8>,
    subset: Option<Vec<String>>,
    phase: Phase,
    first_body_seen: bool,
}

type Out = Vec<ProcessingResponse>;

impl Exchange {
    pub fn new(picker: Arc<Picker>) -> Self {
        Exchange {
            picker,
            request_mode: BodySendMode::FullDuplexStreamed,
            response_mode: BodySendMode::FullDuplexStreamed,
            headers: HeaderMap::new(),
            path: String::new(),
            body: Vec::new(),
            subset: None,
            phase: Phase::Request,
            first_body_seen: false,
        }
    }

    /// Serves the stream until Envoy closes it, sending answers with `send`.
    pub async fn run(
        mut self,
        mut inbound: Streaming<ProcessingRequest>,
        tx: tokio::sync::mpsc::Sender<Result<ProcessingResponse, Status>>,
    ) {
        let mut first = true;
        loop {
            let msg = match inbound.message().await {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(status) => {
                    tracing::debug!(%status, "ext_proc stream ended");
                    return;
                }
            };
            if first {
                first = false;
                if let Some(c) = &msg.protocol_config {
                    self.request_mode = c.request_body_mode();
                    self.response_mode = c.response_body_mode();
                }
            }
            for out in self.on_message(msg).await {
                if tx.send(Ok(out)).await.is_err() {
                    return;
                }
            }
        }
    }

    async fn on_message(&mut self, msg: ProcessingRequest) -> Out {
        let metadata = msg.metadata_context.as_ref().map(|m| &m.filter_metadata);
        if let Some(md) = metadata {
            if matches!(self.phase, Phase::Request) {
                self.subset = subset_hint(md);
            }
            if let (Phase::Routed(p), Some(served)) = (&mut self.phase, served_endpoint(md)) {
                let prepared = p.prepared.clone();
                p.lease.served(&served, &prepared);
            }
        }
        use processing_request::Request as R;
        match msg.request {
            Some(R::RequestHeaders(h)) => self.on_request_headers(h).await,
            Some(R::RequestBody(b)) => self.on_request_body(b).await,
            Some(R::RequestTrailers(_)) => self.on_request_trailers().await,
            Some(R::ResponseHeaders(h)) => {
                if h.end_of_stream || self.response_mode == BodySendMode::None {
                    self.first_token();
                }
                if h.end_of_stream {
                    self.phase = Phase::Done;
                }
                vec![response(
                    processing_response::Response::ResponseHeaders(HeadersResponse::default()),
                    None,
                )]
            }
            Some(R::ResponseBody(b)) => {
                self.first_token();
                if b.end_of_stream {
                    self.phase = Phase::Done;
                }
                let common = if self.response_mode == BodySendMode::FullDuplexStreamed {
                    streamed(b.body, b.end_of_stream)
                } else {
                    CommonResponse::default()
                };
                vec![response(
                    processing_response::Response::ResponseBody(BodyResponse {
                        response: Some(common),
                    }),
                    None,
                )]
            }
            Some(R::ResponseTrailers(_)) => {
                self.phase = Phase::Done;
                vec![response(
                    processing_response::Response::ResponseTrailers(TrailersResponse::default()),
                    None,
                )]
            }
            None => Vec::new(),
        }
    }

    fn first_token(&mut self) {
        if let Phase::Routed(p) = &mut self.phase
            && !self.first_body_seen
        {
            self.first_body_seen = true;
            p.lease.first_token();
        }
    }

    async fn on_request_headers(&mut self, h: HttpHeaders) -> Out {
        for hv in h.headers.map(|m| m.headers).unwrap_or_default() {
            let value = if hv.raw_value.is_empty() {
                hv.value.into_bytes()
            } else {
                hv.raw_value
            };
            if hv.key == ":path" {
                self.path = String::from_utf8_lossy(&value).into_owned();
            }
            if hv.key.starts_with(':') {
                continue;
            }
            if let (Ok(k), Ok(v)) = (
                HeaderName::from_bytes(hv.key.as_bytes()),
                HeaderValue::from_bytes(&value),
            ) {
                self.headers.append(k, v);
            }
        }
        if !self.headers.contains_key("x-tandem-tenant")
            && let Some(f) = self.headers.get(FAIRNESS_ID).cloned()
        {
            self.headers.insert("x-tandem-tenant", f);
        }
        let headers_answer = |common| {
            response(
                processing_response::Response::RequestHeaders(HeadersResponse {
                    response: Some(common),
                }),
                None,
            )
        };
        if h.end_of_stream {
            return self.route(false, Place::Headers).await;
        }
        match self.request_mode {
            BodySendMode::FullDuplexStreamed => Vec::new(),
            BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                vec![headers_answer(CommonResponse::default())]
            }
            _ => self.route(false, Place::Headers).await,
        }
    }

    async fn on_request_body(&mut self, b: HttpBody) -> Out {
        if !matches!(self.phase, Phase::Request) {
            // Routed at the headers (NONE / STREAMED modes): pass the body on.
            return vec![body_answer(CommonResponse::default(), None)];
        }
        let limit = self.picker.body.config().max_body_bytes;
        if self.body.len() + b.body.len() > limit {
            return self.immediate(ServeError::payload_too_large(limit));
        }
        self.body.extend_from_slice(&b.body);
        match self.request_mode {
            BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                // A partial body cannot be parsed: routed on load alone.
                self.route(b.end_of_stream, Place::Body).await
            }
            _ if b.end_of_stream => self.route(true, Place::HeadersThenBody { eos: true }).await,
            _ => Vec::new(),
        }
    }

    async fn on_request_trailers(&mut self) -> Out {
        let trailers = response(
            processing_response::Response::RequestTrailers(TrailersResponse::default()),
            None,
        );
        if !matches!(self.phase, Phase::Request) {
            return vec![trailers];
        }
        // Full duplex with trailers: the body ended without end_of_stream.
        let mut out = self
            .route(true, Place::HeadersThenBody { eos: false })
            .await;
        if matches!(self.phase, Phase::Routed(_)) {
            out.push(trailers);
        }
        out
    }

    /// Routes the request (reading the body when `read_body`) and answers at `place`.
    async fn route(&mut self, read_body: bool, place: Place) -> Out {
        let endpoint = if read_body {
            endpoint_of(&self.path)
        } else {
            None
        };
        let body = std::mem::take(&mut self.body);
        let picked = self
            .picker
            .pick(endpoint, &body, &self.headers, self.subset.take())
            .await;
        let picked = match picked {
            Ok(p) => p,
            Err(e) => return self.immediate(e),
        };
        let destination = picked.lease.endpoints.join(",");
        tracing::debug!(
            worker = picked.lease.worker().0,
            %destination,
            path = %self.path,
            "picked"
        );
        self.phase = Phase::Routed(Box::new(picked));
        let common = CommonResponse {
            header_mutation: Some(destination_header(&destination)),
            clear_route_cache: true,
            ..Default::default()
        };
        let metadata = Some(destination_metadata(&destination));
        match place {
            Place::Headers => vec![response(
                processing_response::Response::RequestHeaders(HeadersResponse {
                    response: Some(common),
                }),
                metadata,
            )],
            Place::Body => vec![body_answer(common, metadata)],
            Place::HeadersThenBody { eos } => vec![
                response(
                    processing_response::Response::RequestHeaders(HeadersResponse {
                        response: Some(common),
                    }),
                    metadata,
                ),
                body_answer(streamed(body, eos), None),
            ],
        }
    }

    fn immediate(&mut self, e: ServeError) -> Out {
        self.phase = Phase::Done;
        tracing::debug!(status = e.status().as_u16(), error = %e.message(), "answered at once");
        let mut set_headers = vec![header("content-type", "application/json")];
        if let Some(retry) = e.retry_after() {
            set_headers.push(header("retry-after", &retry.as_secs().max(1).to_string()));
        }
        vec![response(
            processing_response::Response::ImmediateResponse(ImmediateResponse {
                status: Some(HttpStatus {
                    code: i32::from(e.status().as_u16()),
                }),
                headers: Some(HeaderMutation {
                    set_headers,
                    remove_headers: Vec::new(),
                }),
                body: e.to_json().into_bytes(),
                details: e.message().to_string(),
            }),
            None,
        )]
    }
}

/// Where the routing answer goes (see the module docs).
#[derive(Clone, Copy)]
enum Place {
    Headers,
    Body,
    HeadersThenBody { eos: bool },
}

fn response(
    r: processing_response::Response,
    dynamic_metadata: Option<Struct>,
) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(r),
        dynamic_metadata,
    }
}

fn body_answer(common: CommonResponse, metadata: Option<Struct>) -> ProcessingResponse {
    response(
        processing_response::Response::RequestBody(BodyResponse {
            response: Some(common),
        }),
        metadata,
    )
}

/// A body handed back whole in full-duplex mode.
fn streamed(body: Vec<u8>, end_of_stream: bool) -> CommonResponse {
    CommonResponse {
        body_mutation: Some(BodyMutation {
            mutation: Some(body_mutation::Mutation::StreamedResponse(
                StreamedBodyResponse {
                    body,
                    end_of_stream,
                },
            )),
        }),
        ..Default::default()
    }
}

/// A header set (replacing any value), as `raw_value` (Envoy's ext_proc reads header values
/// from `raw_value`).
fn header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(PbHeaderValue {
            key: key.to_string(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        keep_empty_value: false,
    }
}

fn destination_header(destination: &str) -> HeaderMutation {
    HeaderMutation {
        set_headers: vec![header(DESTINATION, destination)],
        remove_headers: Vec::new(),
    }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": "<ip:port>[,<ip:port>…]"}}`: the same
/// value as the header (the protocol forbids them to differ).
fn destination_metadata(destination: &str) -> Struct {
    let inner = Struct {
        fields: [(DESTINATION.to_string(), string(destination))].into(),
    };
    Struct {
        fields: [(
            LB_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(inner)),
            },
        )]
        .into(),
    }
}

fn string(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.to_string())),
    }
}

type FilterMetadata = std::collections::HashMap<String, Struct>;

/// The gateway's subset hint, when it gives one (an empty list stays empty: nothing may be
/// picked, and the answer is 503, as the protocol says).
fn subset_hint(md: &FilterMetadata) -> Option<Vec<String>> {
    let value = md.get(SUBSET_NAMESPACE)?.fields.get(SUBSET)?;
    let list = match &value.kind {
        Some(Kind::ListValue(l)) => l
            .values
            .iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.trim().to_string()),
                _ => None,
            })
            .collect(),
        Some(Kind::StringValue(s)) => s.split(',').map(|e| e.trim().to_string()).collect(),
        _ => return None,
    };
    Some(list)
}

/// The endpoint that served the response, when the gateway reports it (the first, if it
/// names several).
fn served_endpoint(md: &FilterMetadata) -> Option<String> {
    match &md.get(LB_NAMESPACE)?.fields.get(SERVED)?.kind {
        Some(Kind::StringValue(s)) => s.split(',').next().map(|e| e.trim().to_string()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_keys_are_read_where_the_protocol_puts_them() {
        let list = Value {
            kind: Some(Kind::ListValue(prost_types::ListValue {
                values: vec![string("10.0.0.1:8000"), string("10.0.0.2:8000")],
            })),
        };
        let md: FilterMetadata = [
            (
                SUBSET_NAMESPACE.to_string(),
                Struct {
                    fields: [(SUBSET.to_string(), list)].into(),
                },
            ),
            (
                LB_NAMESPACE.to_string(),
                Struct {
                    fields: [(SERVED.to_string(), string("10.0.0.2:8000"))].into(),
                },
            ),
        ]
        .into();
        assert_eq!(
            subset_hint(&md),
            Some(vec![
                "10.0.0.1:8000".to_string(),
                "10.0.0.2:8000".to_string()
            ])
        );
        assert_eq!(served_endpoint(&md).as_deref(), Some("10.0.0.2:8000"));
        let m = destination_metadata("a:1,b:2");
        let Some(Kind::StructValue(inner)) = &m.fields[LB_NAMESPACE].kind else {
            panic!("envoy.lb is not a struct");
        };
        assert_eq!(inner.fields[DESTINATION], string("a:1,b:2"));
    }
}
