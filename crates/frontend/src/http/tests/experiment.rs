//! A/B routing at the edge: sessions keep their arm, each arm's requests reach the router
//! with the arm's knobs (a request's own knob wins), and the arms are counted side by side on
//! `/metrics` and the status page.

use serde_json::json;

use super::groups::{app_with, chat, groups_file};
use super::*;

#[tokio::test]
async fn sessions_keep_their_arm_and_each_arm_routes_with_its_knobs_and_is_counted() {
    let text = r#"
[experiment]
name = "temp"
b_share = 0.5
ttft_slo_ms = 60000
  [experiment.b]
  temperature = 0.25
"#;
    let backend = FakeBackend::text("pool");
    let (app, state) = app_with(groups_file("experiment", text), backend.clone());
    let ask = |session: &str, body: &Value| {
        let mut r = post_json("/v1/chat/completions", body);
        r.headers_mut()
            .insert("x-session-id", session.parse().unwrap());
        r
    };
    let (mut a, mut b) = (0, 0);
    for i in 0..30 {
        let session = format!("s{i}");
        let mut arms = Vec::new();
        for _ in 0..2 {
            let r = send(&app, ask(&session, &chat("tandem-test"))).await;
            assert_eq!(r.status(), 200);
            arms.push(header(&r, "x-tandem-experiment").unwrap().to_string());
            body_json(r).await;
            let temperature = backend.last_request().routing.overrides.temperature;
            let want = if arms.last().unwrap() == "temp/b" {
                Some(0.25)
            } else {
                None
            };
            assert_eq!(temperature, want, "{session}");
        }
        assert_eq!(arms[0], arms[1], "{session} changed arms");
        if arms[0] == "temp/a" {
            a += 1;
        } else {
            b += 1;
        }
    }
    assert!(a >= 5 && b >= 5, "a {a}, b {b}");
    // A request's own knob wins over its arm's.
    let b_session = (0..30)
        .map(|i| format!("s{i}"))
        .find(|s| {
            let e: tandem_router::groups::ExperimentConfig =
                toml::from_str::<tandem_router::groups::GroupsConfig>(text)
                    .unwrap()
                    .experiment
                    .unwrap();
            e.arm_of(Some(s), &[]) == tandem_router::groups::Arm::B
        })
        .unwrap();
    let mut own = chat("tandem-test");
    own["tandem"] = json!({"temperature": 0.9});
    let r = send(&app, ask(&b_session, &own)).await;
    assert_eq!(header(&r, "x-tandem-experiment"), Some("temp/b"));
    body_json(r).await;
    assert_eq!(
        backend.last_request().routing.overrides.temperature,
        Some(0.9)
    );

    let m = scrape(&state).await;
    for series in [
        format!(
            r#"tandem_experiment_requests_total{{experiment="temp",arm="a",outcome="ok"}} {}"#,
            2 * a
        ),
        format!(
            r#"tandem_experiment_requests_total{{experiment="temp",arm="b",outcome="ok"}} {}"#,
            2 * b + 1
        ),
        format!(
            r#"tandem_experiment_goodput_total{{experiment="temp",arm="a"}} {}"#,
            2 * a
        ),
        format!(
            r#"tandem_experiment_ttft_seconds_count{{experiment="temp",arm="b"}} {}"#,
            2 * b + 1
        ),
    ] {
        assert!(m.contains(&series), "{series} in\n{m}");
    }
    assert!(
        m.contains(r#"tandem_experiment_tokens_total{experiment="temp",arm="a",kind="prompt"}"#),
        "{m}"
    );
    let status =
        body_json(send(&crate::http::admin_app(state.clone()), get("/status.json")).await).await;
    let rows = status["groups"]["experiment"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{status}");
    for row in rows {
        let want = if row["arm"] == "a" { 2 * a } else { 2 * b + 1 };
        assert_eq!(row["requests"], want, "{row}");
        assert!(row["mean_ttft_ms"].as_f64().unwrap() >= 0.0, "{row}");
    }
}

/// Without a session, requests whose prompts start alike share an arm.
#[tokio::test]
async fn without_a_session_the_prompts_start_places_the_request() {
    let text = r#"
[experiment]
name = "prefix"
b_share = 0.5
prefix_tokens = 4
"#;
    let (app, _) = app_with(
        groups_file("experiment-prefix", text),
        FakeBackend::text("pool"),
    );
    let arm_of = |content: String| {
        let app = app.clone();
        async move {
            let body = json!({"model": "tandem-test", "max_tokens": 2,
                              "prompt": content});
            let r = send(&app, post_json("/v1/completions", &body)).await;
            header(&r, "x-tandem-experiment").unwrap().to_string()
        }
    };
    let mut seen = std::collections::HashSet::new();
    for i in 0..12 {
        let start = format!("Document {i} begins with these words");
        let first = arm_of(format!("{start}, then one ending.")).await;
        let second = arm_of(format!("{start}, then another ending entirely.")).await;
        assert_eq!(first, second, "{start}");
        seen.insert(first);
    }
    assert_eq!(seen.len(), 2, "both arms drawn: {seen:?}");
}
