//! The Responses and Messages APIs against the official Python SDKs (`openai`,
//! `anthropic`): the frontend's HTTP app on a loopback port, a backend that answers with
//! scripted text (a tool call when asked about the weather), and Python scripts that call
//! `client.responses.create` (whole, streamed, with tools, `previous_response_id`),
//! `client.responses.stream`, `client.messages.create` and `client.messages.stream`,
//! assert on the parsed SDK objects and print JSON that the test checks too
//! (docs/CONVENTIONS.md §13: an independent implementation of the protocol). With API keys, both SDKs'
//! own key headers are accepted and a wrong key raises each SDK's `AuthenticationError`.
//!
//! Needs the `sdk` venv (`target/python/sdk`, which scripts/test.sh makes) with the `openai`
//! and `anthropic` packages: without them the test fails (it never skips).

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use tandem_frontend::http::{
    self, FinishReason, HttpConfig, HttpState, ServeError, Tokenizer, TokenizerSpec, ValidRequest,
};
use tandem_frontend::testing::{Chunks, FnBackend, token_chunks};

const HELLO: &str = "Hello from tandem!";
const RESULT: &str = "It is 21 C in Paris.";
const TOOL_CALL: &str =
    "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";

/// Answers from the prompt: after a tool result the result, when the weather is asked a tool
/// call, else a greeting; one token per chunk. Records every prompt in `prompts`.
fn scripted(
    tokenizer: Arc<Tokenizer>,
    prompts: Arc<Mutex<Vec<Vec<u32>>>>,
) -> impl Fn(&ValidRequest) -> Result<Chunks, ServeError> + Send + Sync + 'static {
    move |req: &ValidRequest| {
        let prompt = tokenizer.decode(&req.prompt_tokens);
        prompts.lock().push(req.prompt_tokens.clone());
        let reply = if prompt.contains("<|im_start|>tool") {
            RESULT
        } else if prompt.contains("Weather") {
            TOOL_CALL
        } else {
            HELLO
        };
        let tokens = tokenizer
            .encode(reply)
            .map_err(|e| ServeError::internal(e.to_string()))?;
        Ok(token_chunks(&tokens, 1, FinishReason::Stop))
    }
}

const OPENAI_SCRIPT: &str = r#"
import json, sys
import openai
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="test", max_retries=0)
out = {}

r = client.responses.create(model="tandem-test", input="Hi", instructions="Be brief.")
assert r.object == "response", r
assert r.status == "completed", r.status
assert r.output_text == "Hello from tandem!", r.output_text
assert r.output[0].type == "message" and r.output[0].role == "assistant"
out["whole"] = {"id": r.id, "text": r.output_text, "input_tokens": r.usage.input_tokens,
                "output_tokens": r.usage.output_tokens, "total_tokens": r.usage.total_tokens,
                "cached": r.usage.input_tokens_details.cached_tokens}

events, text, final = [], "", None
for ev in client.responses.create(model="tandem-test", input="Again", previous_response_id=r.id,
                                  stream=True):
    events.append(ev.type)
    if ev.type == "response.output_text.delta":
        text += ev.delta
    if ev.type == "response.completed":
        final = ev.response
assert final is not None and final.output_text == text, (final, text)
out["stream"] = {"events": events, "text": text, "previous": final.previous_response_id,
                 "output_tokens": final.usage.output_tokens}

with client.responses.stream(model="tandem-test", input="Once more") as stream:
    for _ in stream:
        pass
    helper = stream.get_final_response()
out["helper"] = {"text": helper.output_text, "status": helper.status}

tools = [{"type": "function", "name": "get_weather", "description": "Get the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
r = client.responses.create(model="tandem-test", input="Weather in Paris?", tools=tools)
calls = [o for o in r.output if o.type == "function_call"]
assert len(calls) == 1, r.output
follow = client.responses.create(
    model="tandem-test", previous_response_id=r.id, tools=tools,
    input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "21 C"}])
out["tool"] = {"name": calls[0].name, "arguments": json.loads(calls[0].arguments),
               "call_id": calls[0].call_id, "follow_up": follow.output_text}

streamed_call = None
for ev in client.responses.create(model="tandem-test", input="Weather in Paris?", tools=tools,
                                  stream=True):
    if ev.type == "response.output_item.done" and ev.item.type == "function_call":
        streamed_call = ev.item
out["stream_tool"] = {"name": streamed_call.name, "arguments": json.loads(streamed_call.arguments)}

try:
    client.responses.create(model="tandem-test", input="x", previous_response_id="resp_missing")
    out["error"] = None
except openai.BadRequestError as e:
    out["error"] = {"status": e.status_code, "code": e.code}

print(json.dumps(out))
"#;

const ANTHROPIC_SCRIPT: &str = r#"
import json, sys
import anthropic

client = anthropic.Anthropic(base_url=sys.argv[1], api_key="test", max_retries=0)
out = {}
hi = [{"role": "user", "content": "Hi"}]

m = client.messages.create(model="tandem-test", max_tokens=64, system="Be brief.", messages=hi)
assert m.type == "message" and m.role == "assistant", m
assert m.content[0].type == "text", m.content
out["whole"] = {"id": m.id, "text": m.content[0].text, "stop_reason": m.stop_reason,
                "input_tokens": m.usage.input_tokens, "output_tokens": m.usage.output_tokens}

with client.messages.stream(model="tandem-test", max_tokens=64, messages=hi) as stream:
    text = "".join(stream.text_stream)
    final = stream.get_final_message()
out["stream"] = {"text": text, "final_text": final.content[0].text,
                 "stop_reason": final.stop_reason, "output_tokens": final.usage.output_tokens}

tools = [{"name": "get_weather", "description": "Get the weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]
ask = [{"role": "user", "content": "Weather in Paris?"}]
m = client.messages.create(model="tandem-test", max_tokens=64, tools=tools, messages=ask)
uses = [b for b in m.content if b.type == "tool_use"]
assert len(uses) == 1, m.content
answer = client.messages.create(
    model="tandem-test", max_tokens=64, tools=tools,
    messages=ask + [{"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": "21 C"}]}])
out["tool"] = {"stop_reason": m.stop_reason, "name": uses[0].name, "input": uses[0].input,
               "id": uses[0].id, "answer": answer.content[0].text}

with client.messages.stream(model="tandem-test", max_tokens=64, tools=tools, messages=ask) as stream:
    final = stream.get_final_message()
use = [b for b in final.content if b.type == "tool_use"][0]
out["stream_tool"] = {"name": use.name, "input": use.input, "stop_reason": final.stop_reason}

try:
    client.messages.create(model="tandem-test", max_tokens=5, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64",
         "media_type": "image/png", "data": "AAAA"}}]}])
    out["error"] = None
except anthropic.BadRequestError as e:
    out["error"] = {"status": e.status_code, "type": e.body["error"]["type"]}

print(json.dumps(out))
"#;

/// API keys through both SDKs: the key they send (`Authorization: Bearer`, `x-api-key`) is
/// accepted, and a wrong one raises each SDK's own `AuthenticationError` with our body.
const KEYS_SCRIPT: &str = r#"
import json, sys
import anthropic, openai

url, key = sys.argv[1], "sk-sdk-0123456789abcdef"
out = {}
hi = [{"role": "user", "content": "Hi"}]
ok = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
out["openai_ok"] = ok.chat.completions.create(model="tandem-test", messages=hi).choices[0].message.content
out["openai_models"] = [m.id for m in ok.models.list()]
try:
    openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0).chat.completions.create(
        model="tandem-test", messages=hi)
    out["openai_wrong"] = None
except openai.AuthenticationError as e:
    out["openai_wrong"] = {"status": e.status_code, "code": e.code, "type": e.type}
ok = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
out["anthropic_ok"] = ok.messages.create(model="tandem-test", max_tokens=64, messages=hi).content[0].text
try:
    anthropic.Anthropic(base_url=url, api_key="sk-wrong", max_retries=0).messages.create(
        model="tandem-test", max_tokens=64, messages=hi)
    out["anthropic_wrong"] = None
except anthropic.AuthenticationError as e:
    out["anthropic_wrong"] = {"status": e.status_code, "type": e.body["error"]["type"]}
print(json.dumps(out))
"#;

/// The interpreter of the `sdk` venv, `target/python/sdk` (scripts/test.sh makes one venv per
/// Python tool: two tools' packages installed together can overwrite each other's files).
fn python() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/python/sdk/bin/python3")
}

/// Runs `script` with the `sdk` venv's Python, the server's base URL as its argument; its
/// stdout as JSON.
async fn run_python(script: &str, base_url: &str) -> Value {
    let mut cmd = tokio::process::Command::new(python());
    cmd.arg("-c")
        .arg(script)
        .arg(base_url)
        // The SDKs go through proxies the environment names; loopback must not.
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("no_proxy", "127.0.0.1,localhost")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let child = cmd.spawn().unwrap_or_else(|e| {
        panic!("this test needs the sdk venv with openai and anthropic (scripts/test.sh): {e}")
    });
    let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .expect("the Python SDK script did not finish within 120 s")
        .expect("waiting for the sdk venv's python3");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python SDK script failed ({}):\n{stderr}\n{stdout}",
        output.status
    );
    serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("the script printed no JSON ({e}):\n{stdout}\n{stderr}"))
}

/// Fails (never skips) when the SDKs are missing.
async fn require_sdks() {
    let out = tokio::process::Command::new(python())
        .args(["-c", "import openai, anthropic"])
        .output()
        .await
        .unwrap_or_else(|e| panic!("this test needs the sdk venv (scripts/test.sh makes it): {e}"));
    assert!(
        out.status.success(),
        "this test needs the Python packages openai and anthropic in the sdk venv \
         (scripts/test.sh installs them): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

struct Server {
    url: String,
    tokenizer: Arc<Tokenizer>,
    /// Every prompt the backend was asked, in order.
    prompts: Arc<Mutex<Vec<Vec<u32>>>>,
    stop: CancellationToken,
}

async fn start() -> Server {
    start_with(HttpConfig::default()).await
}

async fn start_with(config: HttpConfig) -> Server {
    let tokenizer = Arc::new(Tokenizer::load(&TokenizerSpec::default()).unwrap());
    let prompts = Arc::new(Mutex::new(Vec::new()));
    let backend = Arc::new(FnBackend::new(scripted(tokenizer.clone(), prompts.clone())));
    let config = HttpConfig {
        served_model_name: "tandem-test".to_string(),
        ..config
    };
    let state = HttpState::builder(backend, config, tokenizer.clone())
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let stop = CancellationToken::new();
    tokio::spawn(http::serve(
        listener,
        http::Front::public(state),
        stop.clone(),
    ));
    Server {
        url,
        tokenizer,
        prompts,
        stop,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_sdk_responses() {
    require_sdks().await;
    let server = start().await;
    let out = run_python(OPENAI_SCRIPT, &server.url).await;
    let prompts = server.prompts.lock().clone();

    let whole = &out["whole"];
    assert_eq!(whole["text"], HELLO);
    assert!(whole["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(whole["input_tokens"], prompts[0].len() as u64);
    let hello_tokens = server.tokenizer.encode(HELLO).unwrap().len() as u64;
    assert_eq!(whole["output_tokens"], hello_tokens);
    assert_eq!(
        whole["total_tokens"],
        prompts[0].len() as u64 + hello_tokens
    );

    let stream = &out["stream"];
    assert_eq!(stream["text"], HELLO);
    assert_eq!(stream["previous"], whole["id"]);
    let events: Vec<&str> = stream["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e.as_str().unwrap())
        .collect();
    assert_eq!(
        events[..4],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added"
        ]
    );
    assert_eq!(
        events[events.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed"
        ]
    );
    // previous_response_id: the first turn is in the second prompt.
    let second = server.tokenizer.decode(&prompts[1]);
    assert!(second.contains("Hi") && second.contains(HELLO), "{second}");

    assert_eq!(out["helper"]["text"], HELLO);
    assert_eq!(out["helper"]["status"], "completed");
    assert_eq!(out["tool"]["name"], "get_weather");
    assert_eq!(
        out["tool"]["arguments"],
        serde_json::json!({"city": "Paris"})
    );
    assert_eq!(out["tool"]["follow_up"], RESULT);
    assert_eq!(
        out["stream_tool"]["arguments"],
        serde_json::json!({"city": "Paris"})
    );
    assert_eq!(out["error"]["status"], 400);
    assert_eq!(out["error"]["code"], "previous_response_not_found");
    server.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_sdk_messages() {
    require_sdks().await;
    let server = start().await;
    let out = run_python(ANTHROPIC_SCRIPT, &server.url).await;
    let prompts = server.prompts.lock().clone();

    let whole = &out["whole"];
    assert_eq!(whole["text"], HELLO);
    assert_eq!(whole["stop_reason"], "end_turn");
    assert!(whole["id"].as_str().unwrap().starts_with("msg_"));
    // Nothing cached here: input_tokens is the whole prompt.
    assert_eq!(whole["input_tokens"], prompts[0].len() as u64);
    let first = server.tokenizer.decode(&prompts[0]);
    assert_eq!(
        first,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\n"
    );

    assert_eq!(out["stream"]["text"], HELLO);
    assert_eq!(out["stream"]["final_text"], HELLO);
    assert_eq!(out["stream"]["stop_reason"], "end_turn");
    assert!(out["stream"]["output_tokens"].as_u64().unwrap() > 0);

    let tool = &out["tool"];
    assert_eq!(tool["stop_reason"], "tool_use");
    assert_eq!(tool["name"], "get_weather");
    assert_eq!(tool["input"], serde_json::json!({"city": "Paris"}));
    assert!(tool["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(tool["answer"], RESULT);
    assert_eq!(
        out["stream_tool"]["input"],
        serde_json::json!({"city": "Paris"})
    );
    assert_eq!(out["stream_tool"]["stop_reason"], "tool_use");
    assert_eq!(out["error"]["status"], 400);
    assert_eq!(out["error"]["type"], "invalid_request_error");
    server.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_api_keys() {
    require_sdks().await;
    let config = HttpConfig {
        access: http::AccessConfig {
            api_keys: vec![("sk-sdk-0123456789abcdef".into(), "sdk".into())],
            ..Default::default()
        },
        ..HttpConfig::default()
    };
    let server = start_with(config).await;
    let out = run_python(KEYS_SCRIPT, &server.url).await;
    assert_eq!(out["openai_ok"], HELLO);
    assert_eq!(out["openai_models"], serde_json::json!(["tandem-test"]));
    assert_eq!(
        out["openai_wrong"],
        serde_json::json!({"status": 401, "code": "invalid_api_key", "type": "invalid_request_error"})
    );
    assert_eq!(out["anthropic_ok"], HELLO);
    assert_eq!(
        out["anthropic_wrong"],
        serde_json::json!({"status": 401, "type": "authentication_error"})
    );
    server.stop.cancel();
}
