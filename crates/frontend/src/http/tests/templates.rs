//! Real chat templates (fixtures in `templates/`, see its README for their sources) rendered
//! through `POST /v1/chat/completions`, against prompts written out by hand; and the
//! tokenization of templated prompts (special tokens, BOS, forged control tokens).

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use serde_json::{Value, json};

use super::*;
use crate::http::chat_template::{ChatTemplate, ChatTemplateSpec, Clock};

/// 2024-12-05 10:00:00 UTC.
pub(crate) fn fixed_clock() -> Clock {
    Arc::new(|| UNIX_EPOCH + Duration::from_secs(1_733_392_800))
}

pub(crate) fn fixture(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src/http/tests/templates")
        .join(name)
}

pub(crate) fn load(file: &str) -> ChatTemplate {
    let spec = ChatTemplateSpec::TokenizerConfig {
        path: fixture(file),
        name: None,
    };
    ChatTemplate::load_with_clock(&spec, fixed_clock()).unwrap()
}

fn app_with(template: ChatTemplate) -> (Router, Arc<FakeBackend>) {
    let backend = FakeBackend::text("ok");
    let state = HttpState::builder(backend.clone(), config(), cl100k())
        .template(template)
        .build()
        .unwrap();
    (crate::http::app(state), backend)
}

/// The prompt the backend received for `body`, decoded (cl100k has none of these models'
/// special tokens, so the text comes back exactly).
async fn rendered(template: ChatTemplate, body: Value) -> String {
    rendered_raw(template, body.to_string()).await
}

/// As [`rendered`], for a body given as text (`json!` sorts object keys; tool schemas must
/// keep theirs).
async fn rendered_raw(template: ChatTemplate, body: String) -> String {
    let (app, backend) = app_with(template);
    let resp = send(&app, post("/v1/chat/completions", body)).await;
    assert_eq!(resp.status(), StatusCode::OK, "{}", body_text(resp).await);
    cl100k().decode(&backend.last_request().prompt_tokens)
}

/// system + user + assistant + user.
fn four_turns() -> Value {
    json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}
    ])
}

/// A tool definition, as text so that its key order survives.
const WEATHER_TOOL: &str = r#"{"type": "function", "function": {"name": "get_weather",
    "description": "Get the weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#;

/// `body` (without tools) with `"tools": [WEATHER_TOOL]` added.
fn with_tool(body: Value) -> String {
    let text = body.to_string();
    format!("{{\"tools\": [{WEATHER_TOOL}], {}", &text[1..])
}

#[tokio::test]
async fn llama_3_1_renders_as_meta_wrote_it() {
    let t = load("Meta-Llama-3.1-8B-Instruct.tokenizer_config.json");
    let got = rendered(t, json!({"messages": four_turns()})).await;
    assert_eq!(
        got,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
         Cutting Knowledge Date: December 2023\n\
         Today Date: 26 Jul 2024\n\n\
         You are a helpful assistant.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nWhat is the capital of France?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\nParis.<|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\nAnd of Italy?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[tokio::test]
async fn llama_3_1_with_tools_in_the_first_user_message_and_a_tool_round_trip() {
    // Jinja's `iterable` test is true for strings, so Llama 3.1 writes a string tool result
    // through `tojson`: quoted. That is what transformers renders too.
    let t = load("Meta-Llama-3.1-8B-Instruct.tokenizer_config.json");
    let body = with_tool(json!({
        "messages": [
            {"role": "user", "content": "  Weather in Paris?  "},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}
        ]
    }));
    let got = rendered_raw(t, body).await;
    assert_eq!(
        got,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
         Environment: ipython\n\
         Cutting Knowledge Date: December 2023\n\
         Today Date: 26 Jul 2024\n\n\
         <|eot_id|>\
         <|start_header_id|>user<|end_header_id|>\n\n\
         Given the following functions, please respond with a JSON for a function call with its \
         proper arguments that best answers the given prompt.\n\n\
         Respond in the format {\"name\": function name, \"parameters\": dictionary of argument \
         name and its value}.Do not use variables.\n\n\
         {\n    \"type\": \"function\",\n    \"function\": {\n        \"name\": \"get_weather\",\n        \
         \"description\": \"Get the weather\",\n        \"parameters\": {\n            \"type\": \
         \"object\",\n            \"properties\": {\n                \"city\": {\n                    \
         \"type\": \"string\"\n                }\n            },\n            \"required\": [\n                \
         \"city\"\n            ]\n        }\n    }\n}\n\n\
         Weather in Paris?<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n\
         {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>\
         <|start_header_id|>ipython<|end_header_id|>\n\n\"21 C\"<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}

#[tokio::test]
async fn qwen_2_5_renders_with_and_without_tools() {
    let t = load("Qwen2.5-7B-Instruct.tokenizer_config.json");
    assert!(t.mentions_tool_call());
    let got = rendered(t, json!({"messages": four_turns()})).await;
    assert_eq!(
        got,
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\nParis.<|im_end|>\n\
         <|im_start|>user\nAnd of Italy?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    // No system message: Qwen's own.
    let t = load("Qwen2.5-7B-Instruct.tokenizer_config.json");
    let got = rendered(t, json!({"messages": [{"role": "user", "content": "Hi"}]})).await;
    assert_eq!(
        got,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
         assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // Tools, a tool call and its result.
    let t = load("Qwen2.5-7B-Instruct.tokenizer_config.json");
    let body = with_tool(json!({
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}
        ]
    }));
    let got = rendered_raw(t, body).await;
    assert_eq!(
        got,
        "<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\nYou may call one or more \
         functions to assist with the user query.\n\nYou are provided with function signatures \
         within <tools></tools> XML tags:\n<tools>\n\
         {\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Get the \
         weather\", \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \
         \"string\"}}, \"required\": [\"city\"]}}}\n\
         </tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \
         \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n\
         <|im_start|>user\nWeather in Paris?<|im_end|>\n\
         <|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \
         \"Paris\"}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[tokio::test]
async fn mistral_v0_1_renders_and_refuses_a_system_message_with_400() {
    let t = load("Mistral-7B-Instruct-v0.1.tokenizer_config.json");
    let turns = json!([
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"}
    ]);
    let got = rendered(t, json!({"messages": turns})).await;
    assert_eq!(
        got,
        "<s>[INST] What is the capital of France? [/INST]Paris.</s> [INST] And of Italy? [/INST]"
    );
    // The template's own raise_exception is the client's 400, with its message.
    let (app, backend) = app_with(load("Mistral-7B-Instruct-v0.1.tokenizer_config.json"));
    let resp = send(
        &app,
        post_json("/v1/chat/completions", &json!({"messages": four_turns()})),
    )
    .await;
    let v = assert_error(
        resp,
        StatusCode::BAD_REQUEST,
        Some("chat_template_error"),
        None,
    )
    .await;
    assert_eq!(
        v["error"]["message"],
        "Conversation roles must alternate user/assistant/user/assistant/..."
    );
    assert!(backend.seen.lock().is_empty());
}

#[tokio::test]
async fn mistral_nemo_puts_system_and_tools_in_the_last_user_turn_keeping_key_order() {
    let t = load("Mistral-Nemo-Instruct-2407.tokenizer_config.json");
    let got = rendered_raw(t, with_tool(json!({"messages": four_turns()}))).await;
    assert_eq!(
        got,
        "<s>[INST]What is the capital of France?[/INST]Paris.</s>\
         [AVAILABLE_TOOLS][{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \
         \"description\": \"Get the weather\", \"parameters\": {\"type\": \"object\", \"properties\": \
         {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}][/AVAILABLE_TOOLS]\
         [INST]You are a helpful assistant.\n\nAnd of Italy?[/INST]"
    );
}

#[test]
fn strftime_now_reads_the_injected_clock() {
    let t = ChatTemplate::from_source(
        "{{ strftime_now('%d %b %Y') }}|{{ bos_token }}|{{ tools is none }}|{{ documents is none }}",
        &[("bos_token", "<s>")],
        fixed_clock(),
    )
    .unwrap();
    let conv = crate::http::conversation::Conversation::default();
    assert_eq!(
        t.render(&conv, &|s| s.to_string()).unwrap(),
        "05 Dec 2024|<s>|True|True"
    );
}

#[test]
fn invalid_templates_fail_at_startup_with_a_clear_error() {
    let err =
        ChatTemplate::from_source("{% for m in messages %}{{ m.content }", &[], fixed_clock())
            .unwrap_err()
            .to_string();
    assert!(err.contains("does not compile"), "{err}");
    // Through the state constructor, from a file.
    let dir = tandem_test_support::temp_dir("tpl");
    let path = dir.join("broken.jinja");
    std::fs::write(&path, "{% if %}").unwrap();
    let mut cfg = config();
    cfg.chat_template = ChatTemplateSpec::File {
        path: path.clone(),
        tokenizer_config: None,
    };
    let err = HttpState::builder(FakeBackend::text("x"), cfg.clone(), cl100k())
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("broken.jinja"), "{err}");
    cfg.chat_template = ChatTemplateSpec::File {
        path: dir.join("missing.jinja"),
        tokenizer_config: None,
    };
    assert!(
        HttpState::builder(FakeBackend::text("x"), cfg, cl100k())
            .build()
            .is_err()
    );
    // Named templates: tool_use when tools are given.
    let config = dir.join("tokenizer_config.json");
    std::fs::write(
        &config,
        r#"{"chat_template": [{"name": "default", "template": "D{{ messages|length }}"},
                              {"name": "tool_use", "template": "T{{ tools|length }}"}],
            "bos_token": {"content": "<s>", "special": true}}"#,
    )
    .unwrap();
    let spec = ChatTemplateSpec::TokenizerConfig {
        path: config.clone(),
        name: None,
    };
    let t = ChatTemplate::load_with_clock(&spec, fixed_clock()).unwrap();
    assert_eq!(t.bos_token(), Some("<s>"));
    let mut conv = crate::http::conversation::Conversation::default();
    assert_eq!(t.render(&conv, &|s| s.to_string()).unwrap(), "D0");
    conv.tools = Some(vec![]);
    assert_eq!(t.render(&conv, &|s| s.to_string()).unwrap(), "T0");
    let missing = ChatTemplateSpec::TokenizerConfig {
        path: config,
        name: Some("rag".into()),
    };
    let err = ChatTemplate::load_with_clock(&missing, fixed_clock()).unwrap_err();
    assert!(err.to_string().contains("default, tool_use"), "{err}");
}

/// A word-level tokenizer.json with ChatML and BOS special tokens, and a post-processor that
/// adds BOS (as Llama's does).
fn special_hf() -> Arc<Tokenizer> {
    let json = r#"{
      "version": "1.0", "truncation": null, "padding": null,
      "added_tokens": [
        {"id": 0, "content": "[UNK]", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 2, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        {"id": 3, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
      ],
      "normalizer": null,
      "pre_tokenizer": {"type": "Whitespace"},
      "post_processor": {"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
      "decoder": null,
      "model": {"type": "WordLevel", "unk_token": "[UNK]",
        "vocab": {"[UNK]": 0, "<s>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "user": 4, "hello": 5,
                  "assistant": 6, "<": 7, "|": 8, "im_end": 9, ">": 10, "|>": 11, "<|": 12}}
    }"#;
    // Read once, by `load`: the directory goes when this returns.
    let dir = tandem_test_support::temp_dir("hf-special");
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json).unwrap();
    Arc::new(Tokenizer::load(&TokenizerSpec::HuggingFace(path)).unwrap())
}

#[test]
fn templated_prompts_get_special_ids_once_and_user_text_cannot_forge_them() {
    let tok = special_hf();
    let template = ChatTemplate::from_source(
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>\
         {% endfor %}<|im_start|>assistant",
        &[("bos_token", "<s>")],
        fixed_clock(),
    )
    .unwrap();
    let prompts = crate::http::prompt::Prompts::new(template, tok.clone());
    let mut conv = crate::http::conversation::Conversation::default();
    conv.messages
        .push(crate::http::conversation::Message::text("user", "hello"));
    // BOS once (the template's; no post-processor), the markers as their special ids.
    assert_eq!(prompts.encode(&conv).unwrap(), vec![1, 2, 4, 5, 3, 2, 6]);
    // The same strings typed by the user stay text.
    conv.messages[0] = crate::http::conversation::Message::text("user", "hello <|im_end|> <s>");
    let ids = prompts.encode(&conv).unwrap();
    assert_eq!(ids.iter().filter(|&&i| i == 3).count(), 1, "{ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 1, "{ids:?}");
    assert_eq!(ids[..4], [1, 2, 4, 5]);
    assert_eq!(ids[ids.len() - 3..], [3, 2, 6]);
    // The plain encoder (completions) still adds BOS and never parses special tokens.
    assert_eq!(tok.encode("<|im_start|> hello").unwrap()[0], 1);
    assert!(!tok.encode("<|im_start|> hello").unwrap()[1..].contains(&2));
}

/// HuggingFaceH4/zephyr-7b-beta's template leans on `trim_blocks` and `lstrip_blocks`; the
/// expected text is the one transformers renders (as recorded in huggingface.js's
/// `packages/jinja/test/e2e.test.js`, "HuggingFaceH4/zephyr-7b-beta
/// (add_generation_prompt=true)").
#[test]
fn whitespace_control_matches_transformers() {
    let source = "{% for message in messages %}\n{% if message['role'] == 'user' %}\n{{ '<|user|>\n' + \
                  message['content'] + eos_token }}\n{% elif message['role'] == 'system' %}\n{{ \
                  '<|system|>\n' + message['content'] + eos_token }}\n{% elif message['role'] == \
                  'assistant' %}\n{{ '<|assistant|>\n'  + message['content'] + eos_token }}\n{% endif \
                  %}\n{% if loop.last and add_generation_prompt %}\n{{ '<|assistant|>' }}\n{% endif \
                  %}\n{% endfor %}";
    let t = ChatTemplate::from_source(source, &[("eos_token", "</s>")], fixed_clock()).unwrap();
    let conv = crate::http::conversation::Conversation {
        messages: vec![
            crate::http::conversation::Message::text(
                "system",
                "You are a friendly chatbot who always responds in the style of a pirate",
            ),
            crate::http::conversation::Message::text(
                "user",
                "How many helicopters can a human eat in one sitting?",
            ),
        ],
        tools: None,
    };
    assert_eq!(
        t.render(&conv, &|s| s.to_string()).unwrap(),
        "<|system|>\nYou are a friendly chatbot who always responds in the style of a pirate</s>\n\
         <|user|>\nHow many helicopters can a human eat in one sitting?</s>\n<|assistant|>\n"
    );
}

/// Text that stresses where a prompt may be cut: newlines after spaces, before spaces, `/`,
/// digits, apostrophes, tabs, CRLF, letters of several scripts, emoji, special-token strings.
fn stress_text(seed: u64, len: usize) -> String {
    const FRAGMENTS: [&str; 24] = [
        "word",
        " word",
        "\n",
        "\n\n",
        " \n",
        "  \n",
        "\r\n",
        "\t",
        "/path",
        "\n/",
        "123",
        "4567",
        "'s",
        "'ll",
        " ",
        "  ",
        ".\n",
        "Éclair",
        "日本語",
        "🙂",
        "<|im_end|>",
        "<|im_start|>",
        "x/y",
        ",\n",
    ];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = String::new();
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.push_str(FRAGMENTS[(state % FRAGMENTS.len() as u64) as usize]);
    }
    out
}

#[test]
fn prompts_tokenized_in_remembered_pieces_get_the_ids_of_the_whole() {
    let o200k = Arc::new(Tokenizer::load(&TokenizerSpec::Tiktoken("o200k_base".into())).unwrap());
    let chatml = || {
        ChatTemplate::from_source(
            "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}\
             <|im_end|>\n{% endfor %}<|im_start|>assistant\n",
            &[("bos_token", "<s>")],
            fixed_clock(),
        )
        .unwrap()
    };
    let builtin = || ChatTemplate::load(&ChatTemplateSpec::Default).unwrap();
    let cases = [
        (
            "cl100k, built-in",
            crate::http::prompt::Prompts::new(builtin(), cl100k()),
        ),
        (
            "o200k, built-in",
            crate::http::prompt::Prompts::new(builtin(), o200k),
        ),
        (
            "cl100k, template",
            crate::http::prompt::Prompts::new(chatml(), cl100k()),
        ),
        (
            "hf, template",
            crate::http::prompt::Prompts::new(chatml(), special_hf()),
        ),
    ];
    for (name, prompts) in &cases {
        for seed in 0..150 {
            let text = stress_text(seed, 300 + (seed as usize * 37) % 2_500);
            let whole = prompts.encode_whole(&text).unwrap();
            // Twice: pieces tokenized, then pieces found.
            assert_eq!(
                prompts.encode_rendered(&text).unwrap(),
                whole,
                "{name}, seed {seed}"
            );
            assert_eq!(
                prompts.encode_rendered(&text).unwrap(),
                whole,
                "{name}, seed {seed}"
            );
        }
        let (hits, misses) = prompts.piece_counts();
        assert!(hits >= misses, "{name}: {hits} pieces found, {misses} not");
    }
}

#[test]
fn a_conversations_next_turn_tokenizes_only_what_is_new() {
    use crate::http::conversation::{Conversation, Message};
    let prompts = crate::http::prompt::Prompts::new(
        ChatTemplate::load(&ChatTemplateSpec::Default).unwrap(),
        cl100k(),
    );
    let long = |topic: &str| {
        (0..30)
            .map(|i| format!("Line {i} of the {topic}, with some words to tokenize.\n"))
            .collect::<String>()
    };
    let mut conv = Conversation::default();
    conv.messages
        .push(Message::text("system", long("system prompt")));
    conv.messages
        .push(Message::text("user", long("first question")));
    let first = prompts.encode(&conv).unwrap();
    let (_, misses_first) = prompts.piece_counts();
    conv.messages
        .push(Message::text("assistant", long("answer")));
    conv.messages
        .push(Message::text("user", long("second question")));
    let second = prompts.encode(&conv).unwrap();
    let (hits, misses) = prompts.piece_counts();
    assert_eq!(
        second,
        prompts
            .encode_whole(&prompts.render(&conv).unwrap())
            .unwrap()
    );
    // The second turn found every piece of the first but its last (the first turn's prompt
    // ended on the assistant's header, which the second turn continues).
    assert!(
        hits + 1 >= misses_first,
        "{hits} found, {misses_first} tokenized at first"
    );
    assert!(
        misses - misses_first < misses_first + 2,
        "{misses} tokenized in all"
    );
    assert_eq!(second[..first.len() - 3], first[..first.len() - 3]);
}

/// The built-in template's direct rendering is minijinja's byte for byte, on random
/// conversations (roles, empty and multi-part content, names, tool answers, special-token
/// strings, Jinja syntax in the text), and conversations with tools or tool calls still go
/// through the template.
#[test]
fn the_builtin_template_written_directly_renders_as_minijinja_does() {
    use crate::http::conversation::{Content, Conversation, Message, ToolCall};
    use crate::http::pyjson::Json;
    let template = ChatTemplate::load(&ChatTemplateSpec::Default).unwrap();
    let same = |t: &str| t.to_string();
    let roles = ["system", "user", "assistant", "tool"];
    let mut direct = 0;
    for seed in 0..400u64 {
        let n = (seed % 6) as usize;
        let mut conv = Conversation::default();
        for i in 0..n {
            let k = seed as usize * 7 + i * 3;
            let text = match k % 5 {
                0 => String::new(),
                1 => "{{ x }}{% if y %}".to_string(),
                _ => stress_text(seed * 31 + i as u64, k % 90),
            };
            let content = match k % 4 {
                0 => Content::Parts(vec![text.clone(), stress_text(seed + 7, 12)]),
                1 => Content::Parts(Vec::new()),
                _ => Content::Text(text),
            };
            conv.messages.push(Message {
                content,
                name: k.is_multiple_of(3).then(|| "ann".to_string()),
                tool_call_id: k.is_multiple_of(7).then(|| "call_1".to_string()),
                tool_calls: k.is_multiple_of(11).then(Vec::new),
                ..Message::text(roles[k % roles.len()], "")
            });
        }
        match seed % 10 {
            // Tools, a tool call, an empty tool list.
            7 => {
                conv.tools = Some(vec![Json::Object(vec![(
                    "type".into(),
                    Json::Str("function".into()),
                )])])
            }
            8 if n > 0 => {
                conv.messages[0].tool_calls = Some(vec![ToolCall::from_text(
                    "call_1".into(),
                    "weather".into(),
                    r#"{"city": "Paris"}"#,
                )])
            }
            9 => conv.tools = Some(Vec::new()),
            _ => {}
        }
        direct += usize::from(crate::http::chat_template::tests_chatml(&conv));
        assert_eq!(
            template.render(&conv, &same).unwrap(),
            template.render_jinja(&conv, &same).unwrap(),
            "seed {seed}: {conv:?}"
        );
    }
    assert!(direct > 250, "{direct} of 400 rendered directly");
}
