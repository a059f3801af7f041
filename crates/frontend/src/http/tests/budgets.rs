//! Budgets at the edge, with the groups' stand-in endpoints (their whole answers report
//! `usage`: 10 prompt and 2 completion tokens): a spent budget refuses with 429
//! `budget_exceeded`, the pool's answers count too, a model with a batch group takes the
//! over-budget requests there instead, sessions count apart, and the spend per tenant is
//! priced by the group that answered.

use serde_json::json;

use super::groups::{app_with, chat, groups_file, stand_in};
use super::*;

#[tokio::test]
async fn a_spent_tenant_budget_refuses_with_budget_exceeded_and_the_spend_is_priced() {
    let (reserved, ra) = stand_in("reserved").await;
    let text = format!(
        r#"
[[budget]]
per = "tenant"
tokens = 20

[[model]]
name = "gpt"
  [[model.group]]
  name = "reserved"
  cost = {{ prompt_per_million = 1000.0, completion_per_million = 2000.0 }}
    [[model.group.endpoint]]
    url = "http://{ra}/v1"
"#
    );
    let (app, state) = app_with(
        groups_file("budget-tenant", &text),
        FakeBackend::text("pool"),
    );
    // 12 tokens, then 24: the third request finds the budget spent.
    for _ in 0..2 {
        let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
        assert_eq!(r.status(), 200);
        assert_eq!(header(&r, "x-tandem-budget"), None);
        body_json(r).await;
    }
    let r = send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await;
    assert_eq!(r.status(), 429);
    assert_eq!(
        header(&r, "retry-after"),
        None,
        "a total does not start again"
    );
    let v = body_json(r).await;
    assert_eq!(v["error"]["code"], "budget_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tenant budget of 20 tokens"),
        "{v}"
    );
    assert_eq!(
        reserved.seen.lock().bodies.len(),
        2,
        "the refused one was not sent"
    );
    // The budget is the tenant's, whatever serves it: the pool is refused too.
    let r = send(
        &app,
        post_json("/v1/chat/completions", &chat("tandem-test")),
    )
    .await;
    assert_eq!(r.status(), 429);
    let m = scrape(&state).await;
    for series in [
        r#"tandem_tenant_budget_tokens_total{tenant="anonymous",kind="prompt"} 20"#,
        r#"tandem_tenant_budget_tokens_total{tenant="anonymous",kind="completion"} 4"#,
        // (20 × 1000 + 4 × 2000) / 1e6
        r#"tandem_tenant_spend_total{tenant="anonymous"} 0.028"#,
        r#"tandem_budget_refusals_total{per="tenant",outcome="refused"} 2"#,
    ] {
        assert!(m.contains(series), "{series} in\n{m}");
    }
}

#[tokio::test]
async fn the_pools_own_answers_are_charged_to_the_budget() {
    let (_, ha) = stand_in("hosted").await;
    let text = format!(
        r#"
[[budget]]
per = "session"
tokens = 1
window_seconds = 600

[[model]]
name = "gpt"
  [[model.group]]
  name = "hosted"
    [[model.group.endpoint]]
    url = "http://{ha}/v1"
"#
    );
    let (app, _) = app_with(groups_file("budget-pool", &text), FakeBackend::text("pool"));
    let mut req = chat("tandem-test");
    req["user"] = json!("alice");
    let r = send(&app, post_json("/v1/chat/completions", &req)).await;
    assert_eq!(r.status(), 200);
    body_json(r).await;
    // The session (OpenAI's `user`) spent its token: refused until its window ends.
    let r = send(&app, post_json("/v1/chat/completions", &req)).await;
    assert_eq!(r.status(), 429);
    let after: u64 = header(&r, "retry-after").unwrap().parse().unwrap();
    assert!((590..=600).contains(&after), "{after}");
    // Another session, and a request with none, are not counted by a session rule.
    req["user"] = json!("bob");
    assert_eq!(
        send(&app, post_json("/v1/chat/completions", &req))
            .await
            .status(),
        200
    );
    let mut none = chat("tandem-test");
    none["max_tokens"] = json!(3);
    for _ in 0..2 {
        assert_eq!(
            send(&app, post_json("/v1/chat/completions", &none))
                .await
                .status(),
            200
        );
    }
}

#[tokio::test]
async fn over_budget_requests_go_to_the_batch_group_and_others_never_do() {
    let (reserved, ra) = stand_in("reserved").await;
    let (batch, ba) = stand_in("batch").await;
    let text = format!(
        r#"
[[budget]]
per = "task"
tokens = 12

[[model]]
name = "gpt"
  [[model.group]]
  name = "reserved"
    [[model.group.endpoint]]
    url = "http://{ra}/v1"
  [[model.group]]
  name = "offline"
  batch = true
    [[model.group.endpoint]]
    url = "http://{ba}/v1"
"#
    );
    let (app, state) = app_with(
        groups_file("budget-batch", &text),
        FakeBackend::text("pool"),
    );
    let task = |id: &str| {
        let mut r = post_json("/v1/chat/completions", &chat("gpt"));
        r.headers_mut().insert("x-tandem-task", id.parse().unwrap());
        r
    };
    let r = send(&app, task("nightly-eval")).await;
    assert_eq!(header(&r, "x-tandem-group"), Some("reserved"));
    body_json(r).await;
    // The task's 12 tokens are spent: it goes on, to the batch group.
    let r = send(&app, task("nightly-eval")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-group"), Some("offline"));
    assert_eq!(header(&r, "x-tandem-budget"), Some("demoted"));
    assert_eq!(
        body_json(r).await["choices"][0]["message"]["content"],
        "batch"
    );
    // Another task, and requests of no task, are served as usual, never by the batch group.
    for r in [
        send(&app, task("chat")).await,
        send(&app, post_json("/v1/chat/completions", &chat("gpt"))).await,
    ] {
        assert_eq!(header(&r, "x-tandem-group"), Some("reserved"));
    }
    assert_eq!(batch.seen.lock().bodies.len(), 1);
    assert_eq!(reserved.seen.lock().bodies.len(), 3);
    let m = scrape(&state).await;
    assert!(
        m.contains(r#"tandem_budget_refusals_total{per="task",outcome="demoted"} 1"#),
        "{m}"
    );
}

#[tokio::test]
async fn two_tenants_with_the_same_prompt_and_session_count_apart() {
    let (_, ra) = stand_in("reserved").await;
    let text = format!(
        r#"
[[budget]]
per = "session"
tokens = 12

[[model]]
name = "gpt"
  [[model.group]]
  name = "reserved"
  cost = {{ prompt_per_million = 1000.0 }}
    [[model.group.endpoint]]
    url = "http://{ra}/v1"
"#
    );
    let access = crate::http::auth::AccessConfig {
        api_keys: vec![
            ("sk-a".to_string(), "acme".to_string()),
            ("sk-b".to_string(), "beta".to_string()),
        ],
        ..Default::default()
    };
    let state = HttpState::builder(
        FakeBackend::text("pool"),
        crate::http::HttpConfig { access, ..config() },
        cl100k(),
    )
    .groups(super::groups::options(groups_file("budget-tenants", &text)))
    .build()
    .unwrap();
    let app = crate::http::app(state.clone());
    let ask = |key: &str| {
        let mut r = post_json("/v1/chat/completions", &chat("gpt"));
        let h = r.headers_mut();
        h.insert("authorization", format!("Bearer {key}").parse().unwrap());
        h.insert("x-session-id", "same".parse().unwrap());
        r
    };
    assert_eq!(send(&app, ask("sk-a")).await.status(), 200);
    // acme's session "same" is spent; beta's session of that name is its own.
    assert_eq!(send(&app, ask("sk-a")).await.status(), 429);
    assert_eq!(send(&app, ask("sk-b")).await.status(), 200);
    assert_eq!(send(&app, ask("sk-b")).await.status(), 429);
    let m = scrape(&state).await;
    for series in [
        r#"tandem_tenant_spend_total{tenant="acme"} 0.01"#,
        r#"tandem_tenant_spend_total{tenant="beta"} 0.01"#,
        r#"tandem_budget_refusals_total{per="session",outcome="refused"} 2"#,
    ] {
        assert!(m.contains(series), "{series} in\n{m}");
    }
}

/// The README's groups files (its TOML blocks with a `[[model]]`) parse and validate.
#[test]
fn the_readmes_groups_files_are_valid() {
    let readme = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"),
    )
    .unwrap();
    let blocks: Vec<&str> = readme
        .split("```toml\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .filter(|b| b.lines().any(|l| l.trim() == "[[model]]"))
        .collect();
    assert!(blocks.len() >= 2, "{} blocks", blocks.len());
    for b in blocks {
        let cfg: tandem_router::groups::GroupsConfig =
            toml::from_str(b).unwrap_or_else(|e| panic!("{e}\n{b}"));
        cfg.validate().unwrap_or_else(|e| panic!("{e}\n{b}"));
    }
}
