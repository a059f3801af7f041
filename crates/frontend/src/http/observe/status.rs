//! The status page: `GET /` and `GET /status` serve one self-contained HTML file
//! (`status.html`: inline CSS, JavaScript and SVG, no external assets, no build step) that
//! polls `GET /status.json` every second and redraws.
//!
//! `status.json` holds what the edge knows itself — the served model, readiness, draining,
//! requests in flight, and the last minute of TTFT and inter-token latency
//! ([`crate::http::RecentLatency`], fed by `metrics.rs`) — and under `backend` what the
//! [`crate::http::Backend`] tells ([`crate::http::Backend::status`]): for the cluster backend its pools,
//! workers, recent routing decisions with each candidate's cost terms, migrations and
//! rejections; `null` for a backend that tells nothing. Under `groups`, the backend groups
//! (`--groups`): each model's groups in priority order and each endpoint's last minute
//! (sent, ended, failed), requests in flight, cooldown and moving TTFT.
//!
//! Like `/metrics`, these stay open when API keys are configured: they show no prompt or
//! output, only load and routing. The page is served with a Content-Security-Policy that
//! allows nothing from elsewhere, so a page that reached out would fail in the browser.

use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::http::recent::LatencySnapshot;
use crate::http::state::HttpState;

const PAGE: &str = include_str!("status.html");

/// Inline script and style only, `fetch` to this origin only, images only as `data:` URLs.
const CSP: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                   connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; \
                   frame-ancestors 'none'";

#[derive(Serialize)]
struct Status {
    now_unix_ms: u64,
    model: String,
    lora_adapters: Vec<String>,
    ready: bool,
    draining: bool,
    in_flight: i64,
    /// Prompt tokens the engines served from cache over prompt tokens, since start (the
    /// engines' own counts, as the first chunk reports them); None before any prompt.
    engine_hit_rate: Option<f64>,
    latency: LatencySnapshot,
    backend: Option<serde_json::Value>,
    /// The backend groups (`--groups`), when configured.
    groups: Option<serde_json::Value>,
}

/// `GET /`, `GET /status`: the page.
pub(crate) async fn page() -> Response {
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            (
                header::CONTENT_SECURITY_POLICY,
                HeaderValue::from_static(CSP),
            ),
            (
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        ],
        PAGE,
    )
        .into_response()
}

/// `GET /status.json`: what the page shows.
pub(crate) async fn data(State(state): State<HttpState>) -> Response {
    let now_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let config = state.config();
    let status = Status {
        now_unix_ms,
        model: config.served_model_name.clone(),
        lora_adapters: config.lora_adapters.clone(),
        ready: state.backend().ready(),
        draining: state.is_draining(),
        in_flight: state.in_flight(),
        engine_hit_rate: {
            let (prompt, cached) = state.metrics().prompt_and_cached_tokens();
            (prompt > 0).then(|| cached as f64 / prompt as f64)
        },
        latency: state.metrics().recent().snapshot(),
        backend: state.backend().status(),
        groups: state.groups().map(|g| g.status()),
    };
    match serde_json::to_string(&status) {
        Ok(body) => (
            [
                (
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/json"),
                ),
                (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            ],
            body,
        )
            .into_response(),
        Err(e) => crate::http::ServeError::internal(format!("failed to encode the status: {e}"))
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use serde_json::json;

    use crate::http::tests::{
        FakeBackend, body_json, body_text, config, get, header, post_json, send, setup,
    };

    #[tokio::test]
    async fn the_page_is_self_contained_html_on_both_paths() {
        let (_, state) = setup(FakeBackend::text("a b"), config());
        let app = crate::http::admin_app(state);
        for path in ["/", "/status"] {
            let resp = send(&app, get(path)).await;
            assert_eq!(resp.status(), StatusCode::OK, "{path}");
            assert_eq!(
                header(&resp, "content-type"),
                Some("text/html; charset=utf-8")
            );
            let csp = header(&resp, "content-security-policy").unwrap_or_default();
            assert!(csp.starts_with("default-src 'none'"), "{csp}");
            let html = body_text(resp).await;
            assert!(html.starts_with("<!doctype html>"));
            assert!(html.contains("fetch(\"status.json\""));
            // Nothing loaded from elsewhere, and no data written as markup.
            for banned in ["src=", "href=", "@import", "url(", "innerHTML", "outerHTML"] {
                assert!(!html.contains(banned), "the page contains {banned:?}");
            }
        }
    }

    #[tokio::test]
    async fn status_json_shows_the_edge_and_tells_a_backend_without_status_apart() {
        let (app, state) = setup(FakeBackend::text("a b c"), config());
        let admin = crate::http::admin_app(state.clone());
        let s = body_json(send(&admin, get("/status.json")).await).await;
        assert_eq!(s["model"], "tandem-test");
        assert_eq!(s["ready"], true);
        assert_eq!(s["draining"], false);
        assert_eq!(s["in_flight"], 0);
        assert_eq!(s["backend"], serde_json::Value::Null);
        assert_eq!(s["latency"]["ttft"]["count"], 0);
        assert_eq!(s["latency"]["slots"].as_array().map(Vec::len), Some(12));

        let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true});
        body_text(send(&app, post_json("/v1/chat/completions", &body)).await).await;
        state.start_draining();
        let s = body_json(send(&admin, get("/status.json")).await).await;
        assert_eq!(s["draining"], true);
        assert_eq!(s["latency"]["ttft"]["count"], 1, "{s}");
        assert!(s["latency"]["ttft"]["p50_ms"].is_number(), "{s}");
        let last = &s["latency"]["slots"][11];
        assert_eq!(last["age_s"], 0);
        assert_eq!(last["ttft"]["count"], 1, "{s}");
    }
}
