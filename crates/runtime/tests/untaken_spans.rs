//! Without an OTLP exporter no layer takes a span, so none is built: the request path's spans
//! cost only the check that says so. Its own test binary, since the global subscriber and
//! the callsites' cached interest are per process.

use tandem_runtime::telemetry::{TelemetryConfig, init};

#[test]
fn without_otlp_no_span_is_built_and_events_still_are() {
    let _guard = init(TelemetryConfig {
        json: false,
        filter: Some("info".into()),
        otlp: None,
    })
    .expect("installs");
    let span = tracing::info_span!(target: "tandem_frontend", "request", id = 1);
    assert!(
        span.is_disabled(),
        "a span was built with no layer to take it"
    );
    // The log layer still takes events, at the filter's level.
    assert!(tracing::enabled!(target: "tandem_frontend", tracing::Level::INFO));
    assert!(!tracing::enabled!(target: "tandem_frontend", tracing::Level::DEBUG));
}
