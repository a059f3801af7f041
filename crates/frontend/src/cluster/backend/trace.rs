//! The cluster backend's `route` spans: one per decision, with the chosen workers and the
//! cost terms as attributes (README, Operating: Traces).

/// The `route` span of one decision, under the request's span.
pub(super) fn route_span(parent: &tracing::Span) -> tracing::Span {
    use tracing::field::Empty;
    tracing::info_span!(
        parent: parent,
        "route",
        tandem.route.decode_worker = Empty,
        tandem.route.prefill_worker = Empty,
        tandem.route.rule = Empty,
        tandem.route.disagg = Empty,
        tandem.route.candidates = Empty,
        tandem.route.excluded = Empty,
        tandem.route.overlap_blocks = Empty,
        tandem.route.prefill_blocks = Empty,
        tandem.route.decode_blocks = Empty,
        tandem.route.active_requests = Empty,
        tandem.route.transfer = Empty,
        tandem.route.adapter = Empty,
        tandem.route.cost = Empty,
    )
}

/// The decision's outcome and the chosen decode worker's cost terms on its `route` span.
pub(super) fn record_decision(
    span: &tracing::Span,
    d: &tandem_router::DisaggDecision,
    excluded: usize,
) {
    if span.is_disabled() {
        return;
    }
    span.record(
        "tandem.route.decode_worker",
        tandem_runtime::telemetry::int(d.decode_worker().0),
    );
    if let Some(p) = d.prefill_worker() {
        span.record(
            "tandem.route.prefill_worker",
            tandem_runtime::telemetry::int(p.0),
        );
    }
    span.record("tandem.route.rule", format!("{:?}", d.decode.rule).as_str());
    span.record("tandem.route.disagg", format!("{:?}", d.why).as_str());
    span.record(
        "tandem.route.candidates",
        tandem_runtime::telemetry::int(d.decode.explain.len() as u64),
    );
    span.record(
        "tandem.route.excluded",
        tandem_runtime::telemetry::int(excluded as u64),
    );
    if let Some(t) = d.decode.chosen_terms() {
        span.record("tandem.route.overlap_blocks", i64::from(t.overlap.total()));
        span.record("tandem.route.prefill_blocks", t.prefill_blocks);
        span.record(
            "tandem.route.decode_blocks",
            tandem_runtime::telemetry::int(t.decode_blocks),
        );
        span.record(
            "tandem.route.active_requests",
            tandem_runtime::telemetry::int(t.active_requests),
        );
        span.record("tandem.route.transfer", t.transfer);
        span.record("tandem.route.adapter", t.adapter);
        span.record("tandem.route.cost", t.cost);
    }
}
