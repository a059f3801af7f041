//! `/v1/embeddings` at the HTTP edge: one one-token request per input, each asking for its
//! embedding, answered in OpenAI's shape (floats or base64), with the usage; bad input and an
//! engine without embeddings refused with the reason.

use base64::Engine as _;
use serde_json::json;

use super::*;

#[tokio::test]
async fn each_input_is_a_one_token_request_that_asks_for_its_embedding() {
    let backend = FakeBackend::local(Script::Text {
        text: "x".into(),
        finish: FinishReason::Length,
        hang: false,
    });
    let (app, state) = setup(backend.clone(), config());
    let body = json!({"input": ["hello there", "general kenobi"], "model": "tandem-test"});
    let resp = send(&app, post_json("/v1/embeddings", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let v = body_json(resp).await;
    assert_eq!(v["object"], "list");
    assert_eq!(v["model"], "tandem-test");
    let seen = backend.seen.lock().clone();
    assert_eq!(seen.len(), 2);
    let hello = cl100k().encode("hello there").unwrap();
    let kenobi = cl100k().encode("general kenobi").unwrap();
    assert_eq!(seen[0].prompt_tokens, hello);
    assert_eq!(seen[1].prompt_tokens, kenobi);
    for (i, r) in seen.iter().enumerate() {
        assert!(
            r.embed && r.max_tokens == 1 && r.temperature == 0.0,
            "{r:?}"
        );
        assert_eq!(v["data"][i]["object"], "embedding");
        assert_eq!(v["data"][i]["index"], i);
        let got: Vec<f32> = serde_json::from_value(v["data"][i]["embedding"].clone()).unwrap();
        assert_eq!(got, fake_embedding(&r.prompt_tokens));
    }
    let total = hello.len() + kenobi.len();
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": total, "total_tokens": total})
    );
    // Token lists too, one per input.
    let body = json!({"input": [[1, 2, 3, 4, 5], [6, 7]]});
    let v = body_json(send(&app, post_json("/v1/embeddings", &body)).await).await;
    let seen = backend.seen.lock().clone();
    assert_eq!(seen[2].prompt_tokens, [1, 2, 3, 4, 5]);
    assert_eq!(seen[3].prompt_tokens, [6, 7]);
    assert_eq!(v["usage"]["prompt_tokens"], 7);
    // Counted as embeddings requests.
    let metrics = scrape(&state).await;
    assert!(metrics.contains("endpoint=\"embeddings\""), "{metrics}");
}

#[tokio::test]
async fn base64_is_the_floats_little_endian_bytes() {
    let backend = FakeBackend::text("x");
    let (app, _) = setup(backend, config());
    let body = json!({"input": [1, 2, 3], "encoding_format": "base64"});
    let v = body_json(send(&app, post_json("/v1/embeddings", &body)).await).await;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(v["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let floats: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(floats, fake_embedding(&[1, 2, 3]));
}

#[tokio::test]
async fn bad_input_and_an_engine_without_embeddings_are_refused_with_the_reason() {
    let backend = FakeBackend::text("x");
    let (app, _) = setup(backend.clone(), config());
    for (body, status, param) in [
        (json!({}), 400, "input"),
        (json!({"input": ""}), 400, "input"),
        (json!({"input": []}), 400, "input"),
        (json!({"input": ["a", ""]}), 400, "input"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            400,
            "encoding_format",
        ),
        (json!({"input": "a", "dimensions": 0}), 400, "dimensions"),
        // The fake's embeddings have 16 dimensions: they cannot be made 2.
        (json!({"input": "a", "dimensions": 2}), 400, "dimensions"),
        (json!({"input": 7}), 422, ""),
    ] {
        let resp = send(&app, post_json("/v1/embeddings", &body)).await;
        assert_eq!(resp.status().as_u16(), status, "{body}");
        let v = body_json(resp).await;
        if !param.is_empty() {
            assert_eq!(v["error"]["param"], param, "{body}: {v}");
        }
    }
    let resp = send(
        &app,
        post_json("/v1/embeddings", &json!({"input": "a", "dimensions": 16})),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK, "the model's own size");
    let unknown = json!({"input": "a", "model": "no-such-model"});
    let resp = send(&app, post_json("/v1/embeddings", &unknown)).await;
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    // Nothing was sent for a request refused whole (the second input was empty).
    assert!(
        backend
            .seen
            .lock()
            .iter()
            .all(|r| r.prompt_tokens != cl100k().encode("b").unwrap())
    );
    backend.embeds.store(false, Ordering::SeqCst);
    let resp = send(&app, post_json("/v1/embeddings", &json!({"input": "a"}))).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let v = body_json(resp).await;
    assert_eq!(v["error"]["code"], "embeddings_unsupported", "{v}");
}
