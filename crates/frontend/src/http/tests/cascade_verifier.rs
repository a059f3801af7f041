//! A cascade's verifier: a judge model asked whether the small model's answer is right (the
//! conversation, the answer, the verifier's question); "no" escalates to the large model,
//! "yes" lets the small answer stand, and the score is on the response.

use serde_json::json;

use super::groups::{app_with, chat, groups_file, stand_in};
use super::*;

#[tokio::test]
async fn the_verifier_lets_a_judged_right_answer_stand_and_escalates_the_rest() {
    let (small, sa) = stand_in("small").await;
    let (large, la) = stand_in("large").await;
    // Stand-ins answer their own name: these two judges answer "yes" and "no".
    let (yes, ya) = stand_in("yes").await;
    let (_no, na) = stand_in("no").await;
    let model = |name: &str, addr: std::net::SocketAddr| {
        format!(
            "[[model]]\nname = \"{name}\"\n  [[model.group]]\n  name = \"{name}\"\n    \
             [[model.group.endpoint]]\n    url = \"http://{addr}/v1\"\n"
        )
    };
    let text = format!(
        "{}{}{}{}
[[cascade]]
name = \"checked\"
small = \"small\"
large = \"large\"
verifier = \"judge-yes\"

[[cascade]]
name = \"doubted\"
small = \"small\"
large = \"large\"
min_mean_logprob = -0.5
verifier = \"judge-no\"
min_verifier_score = 0.7
",
        model("small", sa),
        model("large", la),
        model("judge-yes", ya),
        model("judge-no", na)
    );
    let (app, _) = app_with(
        groups_file("cascade-verifier", &text),
        FakeBackend::text("x"),
    );

    let r = send(&app, post_json("/v1/chat/completions", &chat("checked"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-cascade"), Some("small"));
    assert_eq!(
        header(&r, "x-tandem-cascade-verifier-score"),
        Some("1.0000")
    );
    assert_eq!(
        body_json(r).await["choices"][0]["message"]["content"],
        "small"
    );
    {
        // The judge saw the conversation, the small answer, then the question.
        let seen = yes.seen.lock();
        let asked = &seen.bodies[0];
        let messages = asked["messages"].as_array().unwrap();
        assert_eq!(messages[0], json!({"role": "user", "content": "hi"}));
        assert_eq!(
            messages[1],
            json!({"role": "assistant", "content": "small"})
        );
        assert!(
            messages[2]["content"]
                .as_str()
                .unwrap()
                .contains("yes or no")
        );
        assert_eq!(
            (asked["max_tokens"].clone(), asked["logprobs"].clone()),
            (json!(1), json!(true))
        );
    }
    assert!(large.seen.lock().bodies.is_empty());

    // Sure enough by its log-probabilities (−0.1), but the judge says no: escalated.
    let r = send(&app, post_json("/v1/chat/completions", &chat("doubted"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(header(&r, "x-tandem-cascade"), Some("escalated"));
    assert_eq!(
        header(&r, "x-tandem-cascade-verifier-score"),
        Some("0.0000")
    );
    assert_eq!(
        body_json(r).await["choices"][0]["message"]["content"],
        "large"
    );
    assert_eq!(small.seen.lock().bodies.len(), 2);
    // Unsure by its log-probabilities: escalated without asking the judge.
    *small.logprob.lock() = -2.0;
    let r = send(&app, post_json("/v1/chat/completions", &chat("doubted"))).await;
    assert_eq!(header(&r, "x-tandem-cascade"), Some("escalated"));
    assert_eq!(header(&r, "x-tandem-cascade-verifier-score"), None);
}

#[test]
fn a_verdict_weighs_yes_against_no_among_the_first_tokens_alternatives() {
    let answer = |alts: serde_json::Value, text: &str| {
        json!({"choices": [{"message": {"content": text},
                            "logprobs": {"content": [{"token": text, "logprob": 0.0,
                                                      "top_logprobs": alts}]}}]})
    };
    let alts = json!([
        {"token": "Yes", "logprob": (0.6f64).ln()},
        {"token": " yes", "logprob": (0.1f64).ln()},
        {"token": "No", "logprob": (0.3f64).ln()},
        {"token": "Maybe", "logprob": (0.05f64).ln()},
    ]);
    let v = crate::http::groups::verdict_of(&answer(alts, "Yes")).unwrap();
    assert!((v - 0.7).abs() < 1e-9, "{v}");
    // No alternatives reported: the text decides.
    assert_eq!(
        crate::http::groups::verdict_of(&answer(json!([]), "Yes.")),
        Some(1.0)
    );
    assert_eq!(
        crate::http::groups::verdict_of(&answer(json!([]), "Nope")),
        Some(0.0)
    );
}
