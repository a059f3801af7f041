//! Tools on chat completions, the Responses API and the Anthropic Messages API: shapes,
//! streams, the Responses store, errors in each API's shape, and the same prompt tokens for
//! the same conversation whichever API it comes through.

use serde_json::{Value, json};

use super::templates::load;
use super::*;

const CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

fn tools_chat() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])
}

/// A backend that answers with `text`, on a state with the default template.
fn app(text: &str) -> (Router, Arc<FakeBackend>, HttpState) {
    let backend = FakeBackend::text(text);
    let (app, state) = setup(backend.clone(), config());
    (app, backend, state)
}

fn events(body: &str) -> Vec<(String, Value)> {
    assert!(body.ends_with("\n\n"), "{body:?}");
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let (name, data) = e
                .strip_prefix("event: ")
                .and_then(|e| e.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not a named event: {e:?}"));
            (name.to_string(), serde_json::from_str(data).unwrap())
        })
        .collect()
}

#[tokio::test]
async fn chat_tool_calls_whole_and_streamed() {
    let (app, backend, _) = app(&format!("Checking.\n{CALL}"));
    let body =
        json!({"messages": [{"role": "user", "content": "Weather?"}], "tools": tools_chat()});
    let v = body_json(send(&app, post_json("/v1/chat/completions", &body)).await).await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Checking.\n");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    assert_eq!(call["function"]["arguments"], r#"{"city":"Paris"}"#);
    // The default template showed the tools to the model.
    let prompt = cl100k().decode(&backend.last_request().prompt_tokens);
    assert!(
        prompt.contains("<tools>\n{") && prompt.contains("\"get_weather\""),
        "{prompt}"
    );

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = body_text(send(&app, post_json("/v1/chat/completions", &streamed)).await).await;
    let chunks: Vec<Value> = sse_data(&text)
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let content: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(content, "Checking.\n");
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0][0]["index"], 0);
    assert_eq!(calls[0][0]["function"]["arguments"], r#"{"city":"Paris"}"#);
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    // Without tools in the request, the text is not parsed.
    let plain = json!({"messages": [{"role": "user", "content": "Weather?"}]});
    let v = body_json(send(&app, post_json("/v1/chat/completions", &plain)).await).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .contains("<tool_call>")
    );
}

#[tokio::test]
async fn responses_whole_stream_store_and_errors() {
    let (app, backend, state) = app("Hello there!");
    let body = json!({"input": "Hi", "instructions": "Be brief.", "metadata": {"k": "v"}});
    let resp = send(&app, post_json("/v1/responses", &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let v = body_json(resp).await;
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(v["instructions"], "Be brief.");
    assert_eq!(v["metadata"], json!({"k": "v"}));
    assert_eq!(v["output"].as_array().unwrap().len(), 1);
    let message = &v["output"][0];
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "assistant");
    assert_eq!(message["content"][0]["type"], "output_text");
    assert_eq!(message["content"][0]["text"], "Hello there!");
    let usage = &v["usage"];
    let prompt = backend.last_request().prompt_tokens.len() as u64;
    assert_eq!(usage["input_tokens"], prompt);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], CACHED);
    let out = cl100k().encode("Hello there!").unwrap().len() as u64;
    assert_eq!(usage["output_tokens"], out);
    assert_eq!(usage["total_tokens"], prompt + out);
    assert_eq!(
        cl100k().decode(&backend.last_request().prompt_tokens),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n"
    );

    // previous_response_id: the stored turn goes first; instructions are not carried over.
    let first = v["id"].as_str().unwrap().to_string();
    let next = json!({"input": "Again", "previous_response_id": first, "stream": true});
    let resp = send(&app, post_json("/v1/responses", &next)).await;
    assert_eq!(header(&resp, "content-type"), Some("text/event-stream"));
    let evs = events(&body_text(resp).await);
    assert_eq!(
        cl100k().decode(&backend.last_request().prompt_tokens),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello there!<|im_end|>\n\
         <|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n"
    );
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    let deltas = names
        .iter()
        .filter(|n| **n == "response.output_text.delta")
        .count();
    assert!(deltas >= 2, "{names:?}");
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, want);
    for (i, (name, data)) in evs.iter().enumerate() {
        assert_eq!(data["type"], name.as_str());
        assert_eq!(data["sequence_number"], i as u64);
    }
    let completed = &evs.last().unwrap().1["response"];
    assert_eq!(completed["output"][0]["content"][0]["text"], "Hello there!");
    assert_eq!(completed["previous_response_id"], first);
    assert!(completed["usage"]["output_tokens"].as_u64().unwrap() > 0);

    // Unknown, and not stored.
    let unknown = json!({"input": "x", "previous_response_id": "resp_nope"});
    let resp = send(&app, post_json("/v1/responses", &unknown)).await;
    assert_error(
        resp,
        StatusCode::BAD_REQUEST,
        Some("previous_response_not_found"),
        Some("previous_response_id"),
    )
    .await;
    let unstored = json!({"input": "x", "store": false});
    let id = body_json(send(&app, post_json("/v1/responses", &unstored)).await).await["id"].clone();
    let resp = send(
        &app,
        post_json(
            "/v1/responses",
            &json!({"input": "y", "previous_response_id": id}),
        ),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        state
            .responses_store()
            .get(id.as_str().unwrap())
            .map(|_| ()),
        None
    );

    // max_output_tokens cuts it: incomplete.
    let short = json!({"input": "x", "max_output_tokens": 1});
    let v = body_json(send(&app, post_json("/v1/responses", &short)).await).await;
    assert_eq!(v["status"], "incomplete");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["output"][0]["status"], "incomplete");

    // Bad input, in OpenAI's shape.
    for (body, param) in [
        (json!({}), "input"),
        (
            json!({"input": [{"type": "input_image", "image_url": "x"}]}),
            "input[0].type",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
            "input[0].content[0]",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0]",
        ),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (
            json!({"input": "x", "text": {"format": {"type": "json_object"}}}),
            "text.format",
        ),
    ] {
        let resp = send(&app, post_json("/v1/responses", &body)).await;
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST, "{body}");
        let v = body_json(resp).await;
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

#[tokio::test]
async fn responses_function_calls_stream_as_items() {
    let (app, _, _) = app(&format!("One moment.{CALL}"));
    let tools =
        json!([{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]);
    let body = json!({"input": "Weather?", "tools": tools});
    let v = body_json(send(&app, post_json("/v1/responses", &body)).await).await;
    let output = v["output"].as_array().unwrap();
    assert_eq!(output.len(), 2, "{v}");
    assert_eq!(output[0]["content"][0]["text"], "One moment.");
    assert_eq!(output[1]["type"], "function_call");
    assert_eq!(output[1]["name"], "get_weather");
    assert_eq!(output[1]["arguments"], r#"{"city":"Paris"}"#);
    assert!(output[1]["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(v["tools"], tools);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let evs = events(&body_text(send(&app, post_json("/v1/responses", &streamed)).await).await);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    let at = names
        .iter()
        .position(|n| *n == "response.function_call_arguments.delta")
        .unwrap();
    assert_eq!(names[at - 1], "response.output_item.added");
    assert_eq!(evs[at - 1].1["output_index"], 1);
    assert_eq!(names[at + 1], "response.function_call_arguments.done");
    assert_eq!(names[at + 2], "response.output_item.done");
    assert_eq!(evs[at + 2].1["item"]["arguments"], r#"{"city":"Paris"}"#);
    // The message item was closed before the call's item opened.
    assert_eq!(names[at - 2], "response.output_item.done");
    assert_eq!(*names.last().unwrap(), "response.completed");
}

#[tokio::test]
async fn messages_whole_stream_stop_sequences_and_anthropic_errors() {
    let (app, backend, _) = app("Paris is lovely. END more");
    let body = json!({"model": "tandem-test", "max_tokens": 50, "system": "Be brief.",
                      "messages": [{"role": "user", "content": "Hi"}], "stop_sequences": ["END"]});
    let v = body_json(send(&app, post_json("/v1/messages", &body)).await).await;
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "Paris is lovely. "}])
    );
    assert_eq!(v["stop_reason"], "stop_sequence");
    assert_eq!(v["stop_sequence"], "END");
    let prompt = backend.last_request().prompt_tokens.len() as u64;
    assert_eq!(v["usage"]["input_tokens"], prompt - u64::from(CACHED));
    assert_eq!(v["usage"]["cache_read_input_tokens"], CACHED);
    assert_eq!(backend.last_request().max_tokens, 50);

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stop_sequences"] = json!([]);
    let evs = events(&body_text(send(&app, post_json("/v1/messages", &streamed)).await).await);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        &names[..3],
        ["message_start", "ping", "content_block_start"]
    );
    assert_eq!(
        &names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let text: String = evs
        .iter()
        .filter(|(n, _)| n == "content_block_delta")
        .map(|(_, d)| d["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, "Paris is lovely. END more");
    let delta = &evs[names.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert!(delta["usage"]["output_tokens"].as_u64().unwrap() > 0);
    for (name, data) in &evs {
        assert_eq!(data["type"], name.as_str());
    }

    // Anthropic's error shape.
    async fn anthropic_error(app: &Router, body: Value, status: u16, kind: &str) {
        let resp = send(app, post_json("/v1/messages", &body)).await;
        assert_eq!(resp.status().as_u16(), status, "{body}");
        let v = body_json(resp).await;
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    let hi = json!([{"role": "user", "content": "Hi"}]);
    anthropic_error(&app, json!({"messages": hi}), 400, "invalid_request_error").await;
    anthropic_error(
        &app,
        json!({"model": "other", "max_tokens": 5, "messages": hi}),
        404,
        "not_found_error",
    )
    .await;
    anthropic_error(
        &app,
        json!({"max_tokens": 5, "messages": hi, "temperature": 1.5}),
        400,
        "invalid_request_error",
    )
    .await;
    anthropic_error(
        &app,
        json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
        400,
        "invalid_request_error",
    )
    .await;
    anthropic_error(
        &app,
        json!({"max_tokens": "x", "messages": hi}),
        400,
        "invalid_request_error",
    )
    .await;
    let resp = send(&app, post("/v1/messages", "{not json")).await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        body_json(resp).await["error"]["type"],
        "invalid_request_error"
    );
    backend.set_script(Script::FailGenerate(ServeError::overloaded(
        "busy",
        Duration::from_secs(2),
    )));
    let resp = send(
        &app,
        post_json("/v1/messages", &json!({"max_tokens": 5, "messages": hi})),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 529);
    assert_eq!(header(&resp, "retry-after"), Some("2"));
    assert_eq!(body_json(resp).await["error"]["type"], "overloaded_error");
}

#[tokio::test]
async fn messages_tool_use_whole_and_streamed() {
    let (app, _, _) = app(CALL);
    let tools = json!([{"name": "get_weather", "description": "Get the weather",
                        "input_schema": {"type": "object"}}]);
    let body = json!({"max_tokens": 100, "tools": tools,
                      "messages": [{"role": "user", "content": "Weather?"}]});
    let v = body_json(send(&app, post_json("/v1/messages", &body)).await).await;
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(v["content"].as_array().unwrap().len(), 1, "{v}");
    let block = &v["content"][0];
    assert_eq!(block["type"], "tool_use");
    assert!(block["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(block["input"], json!({"city": "Paris"}));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let evs = events(&body_text(send(&app, post_json("/v1/messages", &streamed)).await).await);
    let start = evs
        .iter()
        .find(|(n, _)| n == "content_block_start")
        .unwrap();
    assert_eq!(start.1["content_block"]["type"], "tool_use");
    let delta = evs
        .iter()
        .find(|(n, _)| n == "content_block_delta")
        .unwrap();
    assert_eq!(delta.1["delta"]["partial_json"], r#"{"city":"Paris"}"#);
}

/// The same conversation through the three chat APIs, as raw JSON (`json!` would sort the
/// keys of the tool schemas, which the templates print in order).
fn same_conversation() -> [(&'static str, &'static str); 3] {
    let chat = r#"{
        "tools": [{"type": "function", "function": {"name": "get_weather",
                   "description": "Get the weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "call_1",
             "type": "function", "function": {"name": "get_weather",
             "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}
        ]
    }"#;
    let responses = r#"{
        "instructions": "Be brief.",
        "tools": [{"type": "function", "name": "get_weather", "description": "Get the weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Let me check."}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "21 C"}
        ]
    }"#;
    let messages = r#"{
        "max_tokens": 64,
        "system": "Be brief.",
        "tools": [{"name": "get_weather", "description": "Get the weather",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
             {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
             "content": "21 C"}]}
        ]
    }"#;
    [
        ("/v1/chat/completions", chat),
        ("/v1/responses", responses),
        ("/v1/messages", messages),
    ]
}

#[tokio::test]
async fn one_conversation_gives_the_same_prompt_tokens_through_every_api() {
    for template in [
        None,
        Some("Qwen2.5-7B-Instruct.tokenizer_config.json"),
        Some("Meta-Llama-3.1-8B-Instruct.tokenizer_config.json"),
    ] {
        let backend = FakeBackend::text("ok");
        let state = match template {
            None => HttpState::new(backend.clone(), config(), cl100k()),
            Some(file) => HttpState::builder(backend.clone(), config(), cl100k())
                .template(load(file))
                .build()
                .unwrap(),
        };
        let app = crate::http::app(state);
        let mut prompts = Vec::new();
        for (path, body) in same_conversation() {
            let resp = send(&app, post(path, body)).await;
            assert_eq!(
                resp.status(),
                StatusCode::OK,
                "{path}: {}",
                body_text(resp).await
            );
            prompts.push(backend.last_request().prompt_tokens);
        }
        assert_eq!(prompts[0], prompts[1], "chat vs responses, {template:?}");
        assert_eq!(prompts[0], prompts[2], "chat vs messages, {template:?}");
        let text = cl100k().decode(&prompts[0]);
        assert!(
            text.contains("21 C") && text.contains("get_weather"),
            "{text}"
        );
    }
}

#[tokio::test]
async fn backend_errors_mid_stream_end_each_api_with_its_error_event() {
    let backend = FakeBackend::new(Script::FailAfter(
        "partial answer".into(),
        ServeError::unavailable("worker lost"),
    ));
    let (app, _) = setup(backend, config());
    let body = json!({"input": "Hi", "stream": true});
    let evs = events(&body_text(send(&app, post_json("/v1/responses", &body)).await).await);
    let n = evs.len();
    assert_eq!(evs[n - 2].0, "error");
    assert_eq!(evs[n - 2].1["message"], "worker lost");
    assert_eq!(evs[n - 1].0, "response.failed");
    assert_eq!(evs[n - 1].1["response"]["status"], "failed");
    assert_eq!(evs[n - 1].1["sequence_number"], (n - 1) as u64);

    let body =
        json!({"max_tokens": 20, "stream": true, "messages": [{"role": "user", "content": "Hi"}]});
    let evs = events(&body_text(send(&app, post_json("/v1/messages", &body)).await).await);
    let (name, data) = evs.last().unwrap();
    assert_eq!(name, "error");
    assert_eq!(data["type"], "error");
    assert_eq!(data["error"]["type"], "api_error");

    // Wrong types: 422 on OpenAI's APIs, 400 on Anthropic's.
    let resp = send(&app, post_json("/v1/responses", &json!({"input": 5}))).await;
    assert_eq!(resp.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let resp = send(
        &app,
        post_json("/v1/messages", &json!({"max_tokens": 5, "messages": "x"})),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(
        body_json(resp).await["error"]["type"],
        "invalid_request_error"
    );
}
