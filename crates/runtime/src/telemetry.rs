//! Logging and tracing setup: `tracing` with an env filter, text or JSON lines on stderr, and,
//! with an OTLP endpoint, every tandem span exported as an OpenTelemetry span over OTLP gRPC.
//!
//! The filter is the configured one, else the `RUST_LOG` environment variable (read by
//! `tracing_subscriber::EnvFilter`: the one place this crate reads the environment), else
//! `info`. Logs go to stderr so that a command's results on stdout stay clean; a log line is
//! an event, never a span's opening or its fields. The filter applies to the log lines only:
//! the spans exported are tandem's own at `info` and above whatever the log level (with
//! warnings and errors inside them as span events).
//!
//! Traces cross processes with W3C trace context (`traceparent`, `tracestate`;
//! <https://www.w3.org/TR/trace-context/>): [`inject_metadata`] / [`extract_metadata`] on
//! gRPC metadata between frontend and workers, [`inject_headers`] / [`extract_headers`] on
//! HTTP (from clients, to external engines). A process follows its parent's sampling
//! decision; a trace begun here is kept with the configured ratio. Every helper here does
//! nothing for a span no layer took (a process that exports no traces).

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider,
};
use tonic::codegen::http::{HeaderMap, HeaderName, HeaderValue};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::FilterExt as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::error::RuntimeError;

/// How to log, and where to send traces.
#[derive(Clone, Debug, Default)]
pub struct TelemetryConfig {
    /// One JSON object per line instead of human-readable text.
    pub json: bool,
    /// An `EnvFilter` directive string (e.g. `info,tandem_router=debug`); overrides `RUST_LOG`.
    pub filter: Option<String>,
    /// Export traces over OTLP gRPC; None: no traces.
    pub otlp: Option<OtlpConfig>,
}

/// Trace export over OTLP gRPC.
#[derive(Clone, Debug)]
pub struct OtlpConfig {
    /// The collector, e.g. `http://otel-collector:4317`.
    pub endpoint: String,
    /// Fraction of the traces begun here that are kept, 0–1 (a request arriving with a
    /// sampled `traceparent` is always kept; one marked not sampled never is).
    pub sampling_ratio: f64,
    /// The `service.name` resource attribute (e.g. `tandem-frontend`).
    pub service_name: String,
    /// The `service.instance.id` resource attribute (e.g. the worker id), when known.
    pub instance_id: Option<String>,
    /// Most time a finished span waits before it is sent.
    pub export_delay: Duration,
}

impl OtlpConfig {
    /// `endpoint` with the defaults: every trace kept, spans sent within a second.
    pub fn new(endpoint: &str, service_name: &str) -> Self {
        OtlpConfig {
            endpoint: endpoint.to_string(),
            sampling_ratio: 1.0,
            service_name: service_name.to_string(),
            instance_id: None,
            export_delay: Duration::from_secs(1),
        }
    }
}

/// Flushes and stops the trace exporter when dropped: keep it until the process ends.
#[derive(Debug, Default)]
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("flushing traces at exit: {e}");
        }
    }
}

static INSTALLED: AtomicBool = AtomicBool::new(false);

/// Installs the global subscriber. Idempotent: once a subscriber is installed (by an earlier
/// call or by anyone else, e.g. a test harness), later calls do nothing and return a guard
/// with nothing to flush. An invalid filter or OTLP setting is a [`RuntimeError::Config`].
/// With OTLP, call it inside a Tokio runtime (the exporter's gRPC client runs on it).
pub fn init(config: TelemetryConfig) -> Result<TelemetryGuard, RuntimeError> {
    let filter = match &config.filter {
        Some(directives) => EnvFilter::try_new(directives)
            .map_err(|e| RuntimeError::Config(format!("log filter {directives:?}: {e}")))?,
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
    };
    if let Some(otlp) = &config.otlp
        && !(0.0..=1.0).contains(&otlp.sampling_ratio)
    {
        return Err(RuntimeError::Config(format!(
            "OTLP sampling ratio {} is not within 0..=1",
            otlp.sampling_ratio
        )));
    }
    if INSTALLED.load(Ordering::Acquire) {
        return Ok(TelemetryGuard::default());
    }
    let provider = config.otlp.as_ref().map(provider).transpose()?;
    let otel = provider.as_ref().map(|p| {
        let tracer = p.tracer("tandem");
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.target().starts_with("tandem")
                    && if meta.is_span() {
                        *meta.level() <= tracing::Level::INFO
                    } else {
                        *meta.level() <= tracing::Level::WARN
                    }
            }))
    });
    // Log lines are events only: tandem's spans are for traces, and every event says what it
    // is about in its own fields. A span the log layer took would have its fields formatted
    // when it opens and at each `record`, whether or not a line is ever written in it (about
    // a twentieth of the frontend's CPU per request); without the OTLP layer no one takes a
    // span, and a request's spans cost only the check that says so.
    let events_only = tracing_subscriber::filter::filter_fn(|meta| !meta.is_span());
    let fmt = if config.json {
        tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter.and(events_only))
            .boxed()
    } else {
        // Colours only for a terminal: a log file or a container's pipe gets plain text.
        tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .with_filter(filter.and(events_only))
            .boxed()
    };
    // An error here only means a global subscriber exists already: that is the no-op case.
    // Without OTLP the layer is left out, not added as `None`: an absent `Option` layer
    // declares an interest in every callsite, and the registry would then build every span
    // (a twentieth of the frontend's CPU per request) for no layer to read.
    let installed = match otel {
        Some(otel) => tracing_subscriber::registry()
            .with(fmt)
            .with(otel)
            .try_init(),
        None => tracing_subscriber::registry().with(fmt).try_init(),
    };
    INSTALLED.store(true, Ordering::Release);
    if installed.is_err() {
        return Ok(TelemetryGuard::default());
    }
    Ok(TelemetryGuard { provider })
}

fn provider(c: &OtlpConfig) -> Result<SdkTracerProvider, RuntimeError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(c.endpoint.clone())
        .build()
        .map_err(|e| RuntimeError::Config(format!("OTLP endpoint {:?}: {e}", c.endpoint)))?;
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(c.export_delay)
                .build(),
        )
        .build();
    let mut resource =
        opentelemetry_sdk::Resource::builder().with_service_name(c.service_name.clone());
    if let Some(id) = &c.instance_id {
        resource = resource.with_attribute(opentelemetry::KeyValue::new(
            "service.instance.id",
            id.clone(),
        ));
    }
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            c.sampling_ratio,
        ))))
        .with_resource(resource.build())
        .build())
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct MetadataExtractor<'a>(&'a MetadataMap);

impl Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|k| match k {
                tonic::metadata::KeyRef::Ascii(k) => Some(k.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

struct HeaderInjector<'a>(&'a mut HeaderMap);

impl Injector for HeaderInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

/// Puts `span`'s trace context into gRPC metadata (nothing when it is not traced).
pub fn inject_metadata(span: &tracing::Span, metadata: &mut MetadataMap) {
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut MetadataInjector(metadata));
}

/// Makes the trace context in gRPC metadata, if any, `span`'s parent.
pub fn extract_metadata(span: &tracing::Span, metadata: &MetadataMap) {
    if span.is_disabled() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&MetadataExtractor(metadata));
    set_remote_parent(span, cx);
}

/// Puts `span`'s trace context into HTTP headers (nothing when it is not traced).
pub fn inject_headers(span: &tracing::Span, headers: &mut HeaderMap) {
    if span.is_disabled() {
        return;
    }
    TraceContextPropagator::new().inject_context(&span.context(), &mut HeaderInjector(headers));
}

/// Makes the trace context in HTTP headers, if any, `span`'s parent.
pub fn extract_headers(span: &tracing::Span, headers: &HeaderMap) {
    if span.is_disabled() {
        return;
    }
    let cx = TraceContextPropagator::new().extract(&HeaderExtractor(headers));
    set_remote_parent(span, cx);
}

fn set_remote_parent(span: &tracing::Span, cx: opentelemetry::Context) {
    use opentelemetry::trace::TraceContextExt as _;
    if cx.span().span_context().is_valid() {
        // Fails only for a span already started as an OpenTelemetry span: then it keeps the
        // parent it has.
        let _ = span.set_parent(cx);
    }
}

/// Sets string attributes on `span`'s OpenTelemetry span only: constants such as
/// `rpc.system` that would only lengthen every log line inside the span as `tracing` fields.
pub fn set_attributes(span: &tracing::Span, attributes: &[(&'static str, &'static str)]) {
    if span.is_disabled() {
        return;
    }
    for (k, v) in attributes {
        span.set_attribute(*k, *v);
    }
}

/// Sets a string-array attribute (as the GenAI conventions' `gen_ai.response.finish_reasons`),
/// which `tracing` fields cannot carry.
pub fn set_string_array(span: &tracing::Span, key: &'static str, values: &[&str]) {
    if span.is_disabled() {
        return;
    }
    let values: Vec<opentelemetry::StringValue> =
        values.iter().map(|v| v.to_string().into()).collect();
    span.set_attribute(key, opentelemetry::Value::Array(values.into()));
}

/// A count or id as an OpenTelemetry integer attribute: `tracing` hands a `u64` field to the
/// exporter as text, an `i64` as a number.
pub fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Renames `span` once it is known what it is (as the GenAI conventions' `chat {model}`,
/// after the request is parsed); `otel.name` only names a span before it starts. The name is
/// written out only for a span that is traced.
pub fn set_name(span: &tracing::Span, name: std::fmt::Arguments<'_>) {
    use opentelemetry::trace::TraceContextExt as _;
    if span.is_disabled() {
        return;
    }
    span.context().span().update_name(name.to_string());
}

/// The W3C `traceparent` of `span`, when it is traced (for tests and logs).
pub fn traceparent(span: &tracing::Span) -> Option<String> {
    let mut headers = HeaderMap::new();
    inject_headers(span, &mut headers);
    headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_is_idempotent_and_checks_the_filter() {
        let bad = TelemetryConfig {
            filter: Some("info,[".into()),
            ..Default::default()
        };
        assert!(init(bad).is_err());
        let bad_ratio = TelemetryConfig {
            otlp: Some(OtlpConfig {
                sampling_ratio: 1.5,
                ..OtlpConfig::new("http://127.0.0.1:4317", "t")
            }),
            ..Default::default()
        };
        assert!(init(bad_ratio).is_err());
        let config = TelemetryConfig {
            json: true,
            filter: Some("warn".into()),
            otlp: None,
        };
        assert!(init(config.clone()).is_ok());
        assert!(init(config).is_ok());
        assert!(init(TelemetryConfig::default()).is_ok());
        tracing::info!("telemetry test line");
    }

    /// A remote parent in gRPC metadata becomes the span's parent: the same trace id, the
    /// parent's span id replaced by the span's own, the sampled flag kept; and the span's
    /// context goes out on HTTP headers as it came in.
    #[test]
    fn trace_context_crosses_metadata_and_headers() {
        let provider = SdkTracerProvider::builder().build();
        let subscriber = tracing_subscriber::registry()
            .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("test")));
        tracing::subscriber::with_default(subscriber, || {
            let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
            let mut md = MetadataMap::new();
            md.insert("traceparent", MetadataValue::from_static(parent));
            let span = tracing::info_span!("child");
            extract_metadata(&span, &md);
            let ours = traceparent(&span).expect("traced");
            let parts: Vec<&str> = ours.split('-').collect();
            assert_eq!(parts.len(), 4, "{ours}");
            assert_eq!(parts[1], "4bf92f3577b34da6a3ce929d0e0e4736");
            assert_ne!(parts[2], "00f067aa0ba902b7");
            assert_eq!(parts[3], "01");
            let mut out = MetadataMap::new();
            inject_metadata(&span, &mut out);
            assert_eq!(
                out.get("traceparent").and_then(|v| v.to_str().ok()),
                Some(ours.as_str())
            );
            // A child span in the process shares the trace.
            let inner = span.in_scope(|| tracing::info_span!("inner"));
            let inner_tp = traceparent(&inner).expect("traced");
            assert!(inner_tp.contains("4bf92f3577b34da6a3ce929d0e0e4736"));
        });
    }

    #[test]
    fn untraced_spans_inject_nothing_and_garbage_is_not_a_parent() {
        let span = tracing::info_span!("untraced");
        let mut md = MetadataMap::new();
        inject_metadata(&span, &mut md);
        assert!(md.is_empty());
        md.insert(
            "traceparent",
            MetadataValue::from_static("00-zz-not-a-trace-01"),
        );
        extract_metadata(&span, &md);
        assert_eq!(traceparent(&span), None);
    }
}
