//! The HTTP edge's spans: one server span per generation request, named and attributed as
//! the OpenTelemetry GenAI semantic conventions say
//! (<https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/>: span name
//! `{gen_ai.operation.name} {gen_ai.request.model}`, `gen_ai.request.*`, `gen_ai.response.*`,
//! `gen_ai.usage.input_tokens` / `output_tokens`) and the HTTP ones
//! (<https://opentelemetry.io/docs/specs/semconv/http/http-spans/>: `http.request.method`,
//! `http.route`, `http.response.status_code`), a child of the client's `traceparent` when it
//! sent one. tandem's own attributes are under `tandem.`.
//!
//! Its children: `tokenize` here, `queue` and `route` in the cluster backend, the gRPC call
//! to the decode worker (whose own spans continue the trace there), and `stream`, the
//! response body from the first token to the last.

use axum::http::HeaderMap;
use tracing::field::Empty;

use crate::http::backend::{Endpoint, ValidRequest};

/// `gen_ai.operation.name` of an endpoint: the conventions' `chat` for conversations,
/// `text_completion` for the legacy completions API.
fn operation(endpoint: Endpoint) -> &'static str {
    match endpoint {
        Endpoint::Completion => "text_completion",
        Endpoint::Embeddings => "embeddings",
        Endpoint::Chat | Endpoint::Responses | Endpoint::Messages => "chat",
    }
}

/// The server span of a generation request arriving with `headers`.
pub(crate) fn request_span(endpoint: Endpoint, headers: &HeaderMap) -> tracing::Span {
    let op = operation(endpoint);
    let path = match endpoint {
        Endpoint::Chat => "/v1/chat/completions",
        Endpoint::Completion => "/v1/completions",
        Endpoint::Responses => "/v1/responses",
        Endpoint::Messages => "/v1/messages",
        Endpoint::Embeddings => "/v1/embeddings",
    };
    let span = tracing::info_span!(
        "generation",
        otel.name = op,
        otel.kind = "server",
        otel.status_code = Empty,
        http.request.method = "POST",
        http.route = path,
        http.response.status_code = Empty,
        gen_ai.operation.name = op,
        gen_ai.request.model = Empty,
        gen_ai.request.max_tokens = Empty,
        gen_ai.request.temperature = Empty,
        gen_ai.request.top_p = Empty,
        gen_ai.response.id = Empty,
        gen_ai.response.model = Empty,
        gen_ai.usage.input_tokens = Empty,
        gen_ai.usage.output_tokens = Empty,
        gen_ai.server.time_to_first_token = Empty,
        tandem.cached_tokens = Empty,
        tandem.decode_worker = Empty,
        tandem.prefill_worker = Empty,
        tandem.stream = Empty,
    );
    tandem_runtime::telemetry::extract_headers(&span, headers);
    span
}

/// What the request asked for, once validated.
pub(crate) fn record_request(span: &tracing::Span, req: &ValidRequest) {
    let model = req.adapter.as_deref().unwrap_or(&req.model);
    tandem_runtime::telemetry::set_name(span, format_args!("{} {model}", operation(req.endpoint)));
    span.record("gen_ai.request.model", model);
    span.record("gen_ai.response.model", model);
    span.record("gen_ai.request.max_tokens", i64::from(req.max_tokens));
    span.record("gen_ai.request.temperature", f64::from(req.temperature));
    span.record("gen_ai.request.top_p", f64::from(req.top_p));
    span.record("gen_ai.response.id", req.response_id.as_str());
    span.record("tandem.stream", req.stream);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_follow_the_conventions() {
        assert_eq!(operation(Endpoint::Chat), "chat");
        assert_eq!(operation(Endpoint::Messages), "chat");
        assert_eq!(operation(Endpoint::Responses), "chat");
        assert_eq!(operation(Endpoint::Completion), "text_completion");
    }
}
