//! The server span of a worker's `tandem.v1.Worker` call, named and attributed as the
//! OpenTelemetry RPC conventions say (<https://opentelemetry.io/docs/specs/semconv/rpc/>:
//! span name `{rpc.service}/{rpc.method}`, `rpc.system`, `rpc.service`, `rpc.method`), a
//! child of the caller's W3C trace context in the call's metadata.

use tonic::metadata::MetadataMap;
use tracing::field::Empty;

/// A worker call's method.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Generate,
    Prefill,
}

/// The server span of a call to `method` arriving with `metadata`.
pub fn server_span(method: Method, metadata: &MetadataMap) -> tracing::Span {
    macro_rules! span {
        ($name:literal) => {
            tracing::info_span!(
                $name,
                otel.kind = "server",
                otel.status_code = Empty,
                tandem.request_id = Empty,
                tandem.prompt_tokens = Empty,
                tandem.prefill = Empty,
            )
        };
    }
    let (span, name) = match method {
        Method::Generate => (span!("tandem.v1.Worker/Generate"), "Generate"),
        Method::Prefill => (span!("tandem.v1.Worker/Prefill"), "Prefill"),
    };
    tandem_runtime::telemetry::set_attributes(
        &span,
        &[
            ("rpc.system", "grpc"),
            ("rpc.service", "tandem.v1.Worker"),
            ("rpc.method", name),
        ],
    );
    tandem_runtime::telemetry::extract_metadata(&span, metadata);
    span
}

/// The request a call's server span is about: its id and prompt length.
pub fn record_request(span: &tracing::Span, request_id: u64, prompt_tokens: usize) {
    span.record(
        "tandem.request_id",
        tandem_runtime::telemetry::int(request_id),
    );
    span.record(
        "tandem.prompt_tokens",
        tandem_runtime::telemetry::int(prompt_tokens as u64),
    );
}
