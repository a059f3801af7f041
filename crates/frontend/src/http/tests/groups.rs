//! Backend groups at the edge, against stand-in endpoints on loopback that answer as a
//! hosted OpenAI-compatible API documents (its 429 with `Retry-After` and error JSON, its
//! 400 `context_length_exceeded`, a streamed completion): priority order, spillover with its
//! headers, the endpoint's model name and key, cooldowns, the pool as a group, and a file
//! that reloads or is refused.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use parking_lot::Mutex;
use serde_json::{Value, json};

use super::*;
use crate::http::{GroupsOptions, HttpState};

/// What a stand-in endpoint answers next.
#[derive(Clone, Debug)]
pub(super) enum Answer {
    /// A completion whose text names the endpoint (streamed when asked).
    Ok,
    /// OpenAI's rate-limit answer, with `Retry-After` in seconds (0: without it).
    RateLimited(u64),
    /// OpenAI's answer to a prompt over the context.
    ContextTooLong,
    /// A client error that must be passed back as is.
    BadRequest,
}

#[derive(Default)]
pub(super) struct Seen {
    pub(super) bodies: Vec<Value>,
    auth: Vec<Option<String>>,
}

#[derive(Clone)]
pub(super) struct StandIn {
    name: &'static str,
    pub(super) answer: Arc<Mutex<Answer>>,
    pub(super) seen: Arc<Mutex<Seen>>,
    /// The log-probability of each of its two answer tokens, when asked for them.
    pub(super) logprob: Arc<Mutex<f64>>,
}

async fn answer(State(s): State<StandIn>, headers: HeaderMap, body: String) -> Response {
    let body: Value = serde_json::from_str(&body).unwrap();
    {
        let mut seen = s.seen.lock();
        seen.auth.push(
            headers
                .get("authorization")
                .map(|v| v.to_str().unwrap().to_string()),
        );
        seen.bodies.push(body.clone());
    }
    let a = s.answer.lock().clone();
    match a {
        Answer::Ok if body["stream"] == true => {
            let events = format!(
                "data: {}\n\ndata: [DONE]\n\n",
                json!({"object": "chat.completion.chunk", "model": body["model"],
                       "choices": [{"index": 0, "delta": {"content": s.name}}]})
            );
            ([("content-type", "text/event-stream")], events).into_response()
        }
        Answer::Ok => {
            let mut choice = json!({"index": 0, "message": {"role": "assistant", "content": s.name},
                                    "finish_reason": "stop"});
            if body["logprobs"] == true {
                let lp = *s.logprob.lock();
                choice["logprobs"] = json!({"content": [
                    {"token": "a", "logprob": lp, "top_logprobs": []},
                    {"token": "b", "logprob": lp, "top_logprobs": []}]});
            }
            axum::Json(json!({
                "id": "chatcmpl-1", "created": 1, "object": "chat.completion",
                "model": body["model"], "choices": [choice],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            }))
            .into_response()
        }
        Answer::RateLimited(secs) => {
            let mut r = (
                StatusCode::TOO_MANY_REQUESTS,
                axum::Json(json!({"error": {"message": "Rate limit reached",
                    "type": "requests", "code": "rate_limit_exceeded"}})),
            )
                .into_response();
            // 0: no Retry-After at all.
            if secs > 0 {
                r.headers_mut()
                    .insert("retry-after", secs.to_string().parse().unwrap());
            }
            r
        }
        Answer::ContextTooLong => (
            StatusCode::BAD_REQUEST,
            axum::Json(
                json!({"error": {"message": "This model's maximum context length is 8192 tokens.",
                                        "type": "invalid_request_error",
                                        "code": "context_length_exceeded"}}),
            ),
        )
            .into_response(),
        Answer::BadRequest => (
            StatusCode::BAD_REQUEST,
            axum::Json(json!({"error": {"message": "temperature must be at most 2",
                                        "type": "invalid_request_error"}})),
        )
            .into_response(),
    }
}

pub(super) async fn stand_in(name: &'static str) -> (StandIn, SocketAddr) {
    let s = StandIn {
        name,
        answer: Arc::new(Mutex::new(Answer::Ok)),
        seen: Arc::default(),
        logprob: Arc::new(Mutex::new(-0.1)),
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(answer))
        .with_state(s.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (s, addr)
}

thread_local! {
    /// The directories of the groups files the test on this thread wrote: removed when the
    /// thread ends, with its test (the test harness runs each test on a thread of its own).
    static GROUPS_DIRS: std::cell::RefCell<Vec<tandem_test_support::TestDir>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

pub(super) fn groups_file(tag: &str, text: &str) -> std::path::PathBuf {
    let dir = tandem_test_support::temp_dir(&format!("groups-{tag}"));
    let path = dir.join("groups.toml");
    std::fs::write(&path, text).unwrap();
    GROUPS_DIRS.with_borrow_mut(|dirs| dirs.push(dir));
    path
}

pub(super) fn options(file: std::path::PathBuf) -> GroupsOptions {
    let env: crate::http::EnvLookup =
        Arc::new(|k: &str| (k == "HOSTED_KEY").then(|| "sk-hosted".to_string()));
    let mut o = GroupsOptions::new(file, env);
    o.reload_interval = Duration::from_millis(20);
    o
}

pub(super) fn app_with(file: std::path::PathBuf, backend: Arc<FakeBackend>) -> (Router, HttpState) {
    let state = HttpState::builder(backend, config(), cl100k())
        .groups(options(file))
        .build()
        .unwrap();
    (crate::http::app(state.clone()), state)
}

pub(super) fn chat(model: &str) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
}

const TWO_GROUPS: &str = r#"
[[model]]
name = "gpt"

  [[model.group]]
  name = "reserved"
    [[model.group.endpoint]]
    url = "http://@RESERVED@/v1"
    model = "gpt-reserved"

  [[model.group]]
  name = "hosted"
    [[model.group.endpoint]]
    url = "http://@HOSTED@/v1"
    api_key_env = "HOSTED_KEY"
"#;

async fn two_groups(tag: &str) -> (Router, HttpState, StandIn, StandIn) {
    let (reserved, ra) = stand_in("reserved").await;
    let (hosted, ha) = stand_in("hosted").await;
    let text = TWO_GROUPS
        .replace("@RESERVED@", &ra.to_string())
        .replace("@HOSTED@", &ha.to_string());
    let (app, state) = app_with(groups_file(tag, &text), FakeBackend::text("pool"));
    (app, state, reserved, hosted)
}

#[tokio::test]
async fn the_first_group_answers_under_its_own_model_name_and_key() {
    let (app, _, reserved, hosted) = two_groups("first").await;
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-group"), Some("reserved"));
    assert_eq!(header(&r, "x-tandem-spillover-from"), None);
    let v = body_json(r).await;
    assert_eq!(v["choices"][0]["message"]["content"], "reserved");
    assert_eq!(reserved.seen.lock().bodies[0]["model"], "gpt-reserved");
    assert_eq!(reserved.seen.lock().auth[0], None);
    assert!(hosted.seen.lock().bodies.is_empty());
}

#[tokio::test]
async fn a_429_spills_to_the_next_group_with_the_headers_and_cools_the_endpoint() {
    let (app, state, reserved, hosted) = two_groups("spill").await;
    *reserved.answer.lock() = Answer::RateLimited(30);
    let mut streamed = chat("gpt");
    streamed["stream"] = json!(true);
    let r = send(&app, post_json("/v1/chat/completions", &streamed)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-group"), Some("hosted"));
    assert_eq!(header(&r, "x-tandem-spillover-from"), Some("reserved"));
    assert_eq!(header(&r, "x-tandem-spillover-error"), Some("429"));
    let text = body_text(r).await;
    assert!(text.contains("\"content\":\"hosted\""), "{text}");
    {
        let seen = hosted.seen.lock();
        assert_eq!(seen.bodies[0]["model"], "gpt", "no model set: the client's");
        assert_eq!(seen.auth[0].as_deref(), Some("Bearer sk-hosted"));
    }
    // The reserved endpoint cools down for its Retry-After: the next request goes straight
    // to the hosted group, passing the reserved one over as unavailable.
    *reserved.answer.lock() = Answer::Ok;
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(header(&r, "x-tandem-group"), Some("hosted"));
    assert_eq!(header(&r, "x-tandem-spillover-error"), Some("unavailable"));
    assert_eq!(reserved.seen.lock().bodies.len(), 1);
    // The status page shows the cooldown and each endpoint's minute.
    let status =
        body_json(send(&crate::http::admin_app(state.clone()), get("/status.json")).await).await;
    let groups = &status["groups"]["models"][0]["groups"];
    assert_eq!(groups[0]["name"], "reserved");
    let reserved_state = &groups[0]["endpoints"][0]["state"];
    assert!(
        reserved_state["cooling_ms"].as_u64().unwrap() > 25_000,
        "{status}"
    );
    assert_eq!(reserved_state["failed_last_minute"], 1);
    assert_eq!(groups[1]["endpoints"][0]["state"]["sent_last_minute"], 2);
    assert_eq!(
        groups[1]["endpoints"][0]["state"]["cooling_ms"],
        Value::Null
    );
    let metrics = scrape(&state).await;
    assert!(
        metrics.contains(
            r#"tandem_group_requests_total{model="gpt",group="reserved",outcome="spilled"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"tandem_group_spillovers_total{model="gpt",from="reserved",to="hosted"} 2"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_context_error_spills_and_a_clients_own_error_is_passed_back() {
    let (app, _, reserved, hosted) = two_groups("errors").await;
    *reserved.answer.lock() = Answer::ContextTooLong;
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(header(&r, "x-tandem-group"), Some("hosted"));
    assert_eq!(header(&r, "x-tandem-spillover-error"), Some("400"));
    *reserved.answer.lock() = Answer::BadRequest;
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(r.status(), 400);
    assert_eq!(header(&r, "x-tandem-group"), Some("reserved"));
    let v = body_json(r).await;
    assert_eq!(v["error"]["message"], "temperature must be at most 2");
    assert_eq!(
        hosted.seen.lock().bodies.len(),
        1,
        "the client's error did not spill"
    );
}

#[tokio::test]
async fn a_tripped_group_takes_requests_again_once_its_cooldown_ends() {
    let (reserved, ra) = stand_in("reserved").await;
    let (_hosted, ha) = stand_in("hosted").await;
    let text = format!(
        "[cooldown]\nseconds = 1.0\n{}",
        TWO_GROUPS
            .replace("@RESERVED@", &ra.to_string())
            .replace("@HOSTED@", &ha.to_string())
    );
    let (app, _) = app_with(groups_file("recover", &text), FakeBackend::text("pool"));
    *reserved.answer.lock() = Answer::RateLimited(0);
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(header(&r, "x-tandem-group"), Some("hosted"));
    *reserved.answer.lock() = Answer::Ok;
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(
        header(&r, "x-tandem-group"),
        Some("hosted"),
        "still cooling down"
    );
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(
        header(&r, "x-tandem-group"),
        Some("reserved"),
        "the cooldown is over"
    );
    assert_eq!(header(&r, "x-tandem-spillover-from"), None);
}

#[tokio::test]
async fn a_spill_draws_on_the_backends_retry_budget() {
    let (reserved, ra) = stand_in("reserved").await;
    let (hosted, ha) = stand_in("hosted").await;
    let text = TWO_GROUPS
        .replace("@RESERVED@", &ra.to_string())
        .replace("@HOSTED@", &ha.to_string());
    let backend = FakeBackend::text("pool");
    backend.set_retry_budget(1);
    let (app, _) = app_with(groups_file("budget", &text), backend);
    *reserved.answer.lock() = Answer::ContextTooLong;
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(
        header(&r, "x-tandem-group"),
        Some("hosted"),
        "the one retry"
    );
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(r.status(), 400, "the budget is spent: the error comes back");
    assert_eq!(header(&r, "x-tandem-group"), Some("reserved"));
    assert_eq!(hosted.seen.lock().bodies.len(), 1);
}

#[tokio::test]
async fn when_every_group_refuses_the_client_gets_the_last_refusal() {
    let (app, _, reserved, hosted) = two_groups("exhausted").await;
    *reserved.answer.lock() = Answer::RateLimited(5);
    *hosted.answer.lock() = Answer::RateLimited(7);
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(r.status(), 429);
    assert_eq!(header(&r, "retry-after"), Some("7"));
    assert_eq!(header(&r, "x-tandem-spillover-from"), Some("reserved"));
    // Both cool down now: the groups answer for themselves, with when to come back.
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(r.status(), 429);
    let retry: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((4..=5).contains(&retry), "{retry}");
    assert_eq!(body_json(r).await["error"]["code"], "groups_exhausted");
}

#[tokio::test]
async fn the_pool_group_serves_through_the_usual_path_and_spills_when_it_has_no_workers() {
    let (hosted, ha) = stand_in("hosted").await;
    let text = format!(
        r#"
[[model]]
name = "mixed"
  [[model.group]]
  name = "own"
  pool = true
  [[model.group]]
  name = "hosted"
    [[model.group.endpoint]]
    url = "http://{ha}/v1"
"#
    );
    let backend = FakeBackend::text("from the pool");
    let (app, _) = app_with(groups_file("pool", &text), backend.clone());
    let r = send(&app, post_json("/v1/chat/completions", &chat("mixed"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-group"), Some("own"));
    let v = body_json(r).await;
    assert_eq!(v["choices"][0]["message"]["content"], "from the pool");
    assert_eq!(
        v["model"], "tandem-test",
        "the pool serves under its own name"
    );
    backend.set_ready(false);
    let r = send(&app, post_json("/v1/chat/completions", &chat("mixed"))).await;
    assert_eq!(header(&r, "x-tandem-group"), Some("hosted"));
    assert_eq!(header(&r, "x-tandem-spillover-from"), Some("own"));
    assert_eq!(hosted.seen.lock().bodies.len(), 1);
    // A model the groups do not name is the pool's as before.
    backend.set_ready(true);
    let r = send(
        &app,
        post_json("/v1/chat/completions", &chat("tandem-test")),
    )
    .await;
    assert_eq!(
        (r.status().as_u16(), header(&r, "x-tandem-group")),
        (200, None)
    );
}

#[tokio::test]
async fn a_pool_that_sheds_spills_to_the_next_group_and_its_other_errors_come_back() {
    let (hosted, ha) = stand_in("hosted").await;
    let text = format!(
        "[[model]]\nname = \"mixed\"\n[[model.group]]\nname = \"own\"\npool = true\n\
         [[model.group]]\nname = \"hosted\"\n[[model.group.endpoint]]\nurl = \"http://{ha}/v1\"\n"
    );
    let backend = FakeBackend::new(Script::FailGenerate(ServeError::overloaded(
        "the queue is full",
        Duration::from_secs(1),
    )));
    let (app, state) = app_with(groups_file("shed", &text), backend.clone());
    let r = send(&app, post_json("/v1/chat/completions", &chat("mixed"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-group"), Some("hosted"));
    assert_eq!(header(&r, "x-tandem-spillover-from"), Some("own"));
    assert_eq!(header(&r, "x-tandem-spillover-error"), Some("429"));
    assert_eq!(
        hosted.seen.lock().bodies[0]["model"],
        "mixed",
        "the client's body, unchanged"
    );
    // A refusal that is the client's own is the pool's answer.
    backend.set_script(Script::FailGenerate(ServeError::invalid("bad stop")));
    let r = send(&app, post_json("/v1/chat/completions", &chat("mixed"))).await;
    assert_eq!(r.status(), 400);
    assert_eq!(hosted.seen.lock().bodies.len(), 1);
    let metrics = scrape(&state).await;
    assert!(
        metrics.contains(
            r#"tandem_group_requests_total{model="mixed",group="own",outcome="spilled"} 1"#
        ),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_changed_file_reloads_and_a_bad_one_keeps_the_groups_in_force() {
    let (a, aa) = stand_in("a").await;
    let (b, ba) = stand_in("b").await;
    let one = |addr: SocketAddr| {
        format!(
            "[[model]]\nname = \"m\"\n[[model.group]]\nname = \"g\"\n[[model.group.endpoint]]\nurl = \"http://{addr}/v1\"\n"
        )
    };
    let file = groups_file("reload", &one(aa));
    let (app, state) = app_with(file.clone(), FakeBackend::text("pool"));
    let ask = || send(&app, post_json("/v1/chat/completions", &chat("m")));
    let content = |v: Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(content(body_json(ask().await).await), "a");
    // A file that does not validate: refused (once), the old groups answer.
    std::fs::write(&file, "[[model]]\nname = \"m\"\ngroup = []\n").unwrap();
    let gate = state.groups().unwrap();
    let refused = gate.reload_if_changed().unwrap().unwrap_err().to_string();
    assert!(refused.contains("no group"), "{refused}");
    assert!(
        gate.reload_if_changed().is_none(),
        "the same refusal is reported once"
    );
    assert_eq!(content(body_json(ask().await).await), "a");
    // A good one replaces them, through the watch.
    let stop = tokio_util::sync::CancellationToken::new();
    let watch = tokio::spawn(crate::http::watch_groups(state.clone(), stop.clone()));
    std::fs::write(&file, one(ba)).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut answered = content(body_json(ask().await).await);
    while answered != "b" && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
        answered = content(body_json(ask().await).await);
    }
    assert_eq!(answered, "b");
    assert!(!b.seen.lock().bodies.is_empty() && !a.seen.lock().bodies.is_empty());
    stop.cancel();
    watch.await.unwrap();
}

#[test]
fn a_file_that_cannot_be_used_stops_the_start_with_the_reason() {
    let cases = [
        ("[[model]]\nname = \"m\"\n", "group"),
        (
            "[[model]]\nname = \"m\"\n[[model.group]]\nname = \"g\"\n",
            "no endpoint",
        ),
        (
            "[[model]]\nname = \"m\"\n[[model.group]]\nname = \"g\"\n[[model.group.endpoint]]\nurl = \"http://x/v1\"\napi_key_env = \"MISSING\"\n",
            "MISSING is not set",
        ),
        ("not toml at all [", "not valid TOML"),
    ];
    for (i, (text, says)) in cases.into_iter().enumerate() {
        let file = groups_file(&format!("bad-{i}"), text);
        let err = HttpState::builder(FakeBackend::text("x"), config(), cl100k())
            .groups(options(file))
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{text}: {err}");
    }
}

const CASCADE: &str = r#"
[[model]]
name = "small"
  [[model.group]]
  name = "small"
    [[model.group.endpoint]]
    url = "http://@SMALL@/v1"
    model = "tiny-1b"

[[model]]
name = "large"
  [[model.group]]
  name = "large"
    [[model.group.endpoint]]
    url = "http://@LARGE@/v1"
    model = "huge-70b"

[[cascade]]
name = "auto"
small = "small"
large = "large"
min_mean_logprob = -0.5
"#;

async fn cascade(tag: &str) -> (Router, HttpState, StandIn, StandIn) {
    let (small, sa) = stand_in("small").await;
    let (large, la) = stand_in("large").await;
    let text = CASCADE
        .replace("@SMALL@", &sa.to_string())
        .replace("@LARGE@", &la.to_string());
    let (app, state) = app_with(groups_file(tag, &text), FakeBackend::text("pool"));
    (app, state, small, large)
}

#[tokio::test]
async fn a_sure_small_model_answers_and_an_unsure_one_is_escalated_unchanged() {
    let (app, state, small, large) = cascade("cascade").await;
    let r = send(&app, post_json("/v1/chat/completions", &chat("auto"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-cascade"), Some("small"));
    assert_eq!(header(&r, "x-tandem-cascade-confidence"), Some("-0.1000"));
    assert_eq!(header(&r, "x-tandem-group"), Some("small"));
    let v = body_json(r).await;
    assert_eq!(v["choices"][0]["message"]["content"], "small");
    assert_eq!(
        v["choices"][0].get("logprobs"),
        None,
        "not asked for: removed"
    );
    {
        let seen = small.seen.lock();
        assert_eq!(seen.bodies[0]["model"], "tiny-1b");
        assert_eq!(seen.bodies[0]["logprobs"], true);
        assert_eq!(seen.bodies[0]["stream"], false);
    }
    assert!(large.seen.lock().bodies.is_empty());

    // Unsure: the conversation goes to the large model as the client sent it.
    *small.logprob.lock() = -2.0;
    let r = send(&app, post_json("/v1/chat/completions", &chat("auto"))).await;
    assert_eq!(header(&r, "x-tandem-cascade"), Some("escalated"));
    assert_eq!(header(&r, "x-tandem-cascade-confidence"), Some("-2.0000"));
    assert_eq!(header(&r, "x-tandem-group"), Some("large"));
    assert_eq!(
        body_json(r).await["choices"][0]["message"]["content"],
        "large"
    );
    let sent = large.seen.lock().bodies[0].clone();
    assert_eq!(sent["model"], "huge-70b");
    assert_eq!(sent["messages"], chat("auto")["messages"]);
    assert_eq!(sent.get("logprobs"), None);

    // A small model that fails is escalated too; a client may ask for the large one.
    *small.answer.lock() = Answer::BadRequest;
    let r = send(&app, post_json("/v1/chat/completions", &chat("auto"))).await;
    assert_eq!(header(&r, "x-tandem-cascade"), Some("escalated"));
    let asked = Request::post("/v1/chat/completions")
        .header("content-type", "application/json")
        .header("x-tandem-escalate", "1")
        .body(Body::from(chat("auto").to_string()))
        .unwrap();
    let before = small.seen.lock().bodies.len();
    let r = send(&app, asked).await;
    assert_eq!(header(&r, "x-tandem-cascade"), Some("asked"));
    assert_eq!(small.seen.lock().bodies.len(), before);
    let metrics = scrape(&state).await;
    for line in [
        r#"tandem_cascade_requests_total{cascade="auto",outcome="small"} 1"#,
        r#"tandem_cascade_requests_total{cascade="auto",outcome="escalated"} 2"#,
        r#"tandem_cascade_requests_total{cascade="auto",outcome="asked"} 1"#,
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

#[tokio::test]
async fn a_streamed_request_gets_the_small_answer_as_a_stream() {
    let (app, _, _, large) = cascade("cascade-stream").await;
    let mut asked = chat("auto");
    asked["stream"] = json!(true);
    asked["logprobs"] = json!(true);
    let r = send(&app, post_json("/v1/chat/completions", &asked)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "content-type"), Some("text/event-stream"));
    let events = sse_data(&body_text(r).await);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunk: Value = serde_json::from_str(&events[0]).unwrap();
    assert_eq!(chunk["object"], "chat.completion.chunk");
    assert_eq!(chunk["choices"][0]["delta"]["content"], "small");
    assert!(large.seen.lock().bodies.is_empty());
}

#[test]
fn a_cascade_over_a_pool_or_an_unknown_model_is_refused() {
    let pooled = "[[model]]\nname = \"p\"\n[[model.group]]\nname = \"own\"\npool = true\n\
                  [[model]]\nname = \"e\"\n[[model.group]]\nname = \"g\"\n[[model.group.endpoint]]\nurl = \"http://x/v1\"\n";
    for (extra, says) in [
        ("small = \"p\"\nlarge = \"e\"", "has a pool group"),
        ("small = \"e\"\nlarge = \"nope\"", "is not a [[model]]"),
        ("small = \"e\"\nlarge = \"e\"", "the same model"),
    ] {
        let text = format!("{pooled}[[cascade]]\nname = \"c\"\n{extra}\nmin_mean_logprob = -1.0\n");
        let file = groups_file(&format!("cascade-bad-{}", says.len()), &text);
        let err = HttpState::builder(FakeBackend::text("x"), config(), cl100k())
            .groups(options(file))
            .build()
            .unwrap_err()
            .to_string();
        assert!(err.contains(says), "{extra}: {err}");
    }
}
