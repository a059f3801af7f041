//! Request bodies → [`ValidRequest`], in the order the module docs of `http` give: JSON
//! syntax (400) and shape (422), model (404), unsupported parameters and out-of-range values
//! (400), then — after tokenization — the context length (400 `context_length_exceeded`).

use serde::de::DeserializeOwned;
use tandem_router::Priority;

use crate::http::backend::{Endpoint, PromptSource, ValidRequest};
use crate::http::conversation::{Content, Conversation, Message, ToolCall};
use crate::http::error::ServeError;
use crate::http::hints::{HintFields, RoutingHints, SessionField};
use crate::http::models::{ModelChoice, resolve_model};
use crate::http::openai::{
    ChatCompletionRequest, ChatMessage, CompletionRequest, MessageContent, PriorityField, Prompt,
    Stop, StreamOptions,
};
use crate::http::prompt::Prompts;
use crate::http::pyjson::Json;
use crate::http::state::HttpConfig;
use crate::http::tokenizer::Tokenizer;

/// Parses a JSON body: malformed JSON is 400 (`invalid_json`), well-formed JSON of the wrong
/// shape or types is 422. JSON is UTF-8 (RFC 8259 §8.1): the body's is checked once, whole,
/// and the text parsed as a `str` (parsed from bytes, serde_json checks each string on its
/// own, a call per key and value).
pub(crate) fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ServeError> {
    let text = std::str::from_utf8(body).map_err(|e| {
        ServeError::invalid(format!(
            "request body is not valid JSON: it is not UTF-8 ({e})"
        ))
        .with_code("invalid_json")
    })?;
    serde_json::from_str(text).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => ServeError::unprocessable(format!("invalid request body: {e}")),
            Category::Syntax | Category::Eof | Category::Io => {
                ServeError::invalid(format!("request body is not valid JSON: {e}"))
                    .with_code("invalid_json")
            }
        }
    })
}

/// The prompt before tokenization.
#[derive(Debug)]
pub(crate) enum PromptInput {
    /// A completions prompt to tokenize.
    Text(String),
    /// Token ids given by the client, checked against the vocabulary.
    Tokens(Vec<u32>),
    /// A conversation for the chat template (chat completions, Responses, Messages).
    Chat(Conversation),
}

/// Prompts longer than this are tokenized on a blocking thread.
const LARGE_PROMPT_BYTES: usize = 64 * 1024;

/// A request whose fields are checked, waiting for tokenization and the context check.
#[derive(Debug)]
pub(crate) struct Checked {
    pub endpoint: Endpoint,
    pub model: String,
    /// The LoRA adapter `model` named, if any.
    pub adapter: Option<String>,
    pub prompt: PromptInput,
    /// The field the prompt came from, for error messages.
    prompt_param: &'static str,
    /// `Some((value, field))` when the client set it (already `>= 1`).
    max_tokens: Option<(u32, &'static str)>,
    temperature: f32,
    top_p: f32,
    top_k: u32,
    min_p: f32,
    logprobs: Option<u8>,
    seed: Option<u64>,
    pub stop: Vec<String>,
    ignore_eos: bool,
    pub stream: bool,
    include_usage: bool,
    cache_salt: Option<String>,
    priority: Priority,
    routing: RoutingHints,
    /// Seconds the client allows, as asked (capped by the server's request timeout).
    timeout: Option<f64>,
    /// The request has tools and lets the model call them: parse tool calls out of the
    /// output (when the server's parser is on).
    pub wants_tool_calls: bool,
}

/// Fields all endpoints share, as sent.
pub(crate) struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<(i64, &'static str)>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    /// Logprobs asked for, checked by the endpoint: the alternatives per token.
    pub logprobs: Option<u8>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub cache_salt: Option<String>,
    pub priority: Option<PriorityField>,
    pub service_tier: Option<String>,
    pub timeout: Option<f64>,
    pub hints: HintFields,
}

impl Common {
    /// Only the model and the generation length set; the rest defaults.
    pub(crate) fn new(model: Option<String>, max_tokens: Option<(i64, &'static str)>) -> Self {
        Common {
            model,
            max_tokens,
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: None,
            logprobs: None,
            seed: None,
            stop: None,
            ignore_eos: None,
            stream: None,
            stream_options: None,
            n: None,
            cache_salt: None,
            priority: None,
            service_tier: None,
            timeout: None,
            hints: HintFields::default(),
        }
    }
}

pub(crate) fn check_chat(
    req: ChatCompletionRequest,
    config: &HttpConfig,
) -> Result<Checked, ServeError> {
    // max_completion_tokens (the newer name) wins over max_tokens.
    let max_tokens = match (req.max_completion_tokens, req.max_tokens) {
        (Some(v), _) => Some((v, "max_completion_tokens")),
        (None, Some(v)) => Some((v, "max_tokens")),
        (None, None) => None,
    };
    let common = Common {
        model: req.model,
        max_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        logprobs: chat_logprobs(req.logprobs, req.top_logprobs)?,
        seed: req.seed,
        stop: req.stop,
        ignore_eos: req.ignore_eos,
        stream: req.stream,
        stream_options: req.stream_options,
        n: req.n,
        cache_salt: req.cache_salt,
        priority: req.priority,
        service_tier: req.service_tier,
        timeout: req.timeout,
        hints: HintFields {
            tandem: req.tandem,
            reasoning_effort: req.reasoning_effort,
            session_field: req.user,
        },
    };
    let model = resolve_model(common.model.as_deref(), config)?;
    if let Some(format) = &req.response_format {
        let kind = format.get("type").and_then(|t| t.as_str());
        if kind != Some("text") {
            return Err(unsupported(
                "response_format",
                "only response_format {\"type\": \"text\"} is supported",
            ));
        }
    }
    let tools = check_chat_tools(req.tools, "tools")?;
    let tool_choice_none = check_tool_choice(req.tool_choice.as_ref())?;
    let messages = req.messages.filter(|m| !m.is_empty()).ok_or_else(|| {
        ServeError::invalid("messages must be a non-empty array").with_param("messages")
    })?;
    let mut conversation = Conversation {
        messages: Vec::with_capacity(messages.len()),
        tools,
    };
    for (i, m) in messages.into_iter().enumerate() {
        conversation.messages.push(chat_message(i, m)?);
    }
    let wants_tool_calls = conversation.tools.is_some() && !tool_choice_none;
    let mut checked = finish_common(
        common,
        model,
        Endpoint::Chat,
        PromptInput::Chat(conversation),
        "messages",
        config,
    )?;
    checked.wants_tool_calls = wants_tool_calls;
    Ok(checked)
}

/// Most alternatives per token a chat request may ask for (OpenAI's limit).
const MAX_TOP_LOGPROBS: i64 = 20;
/// Most alternatives per token a completions request may ask for (OpenAI's limit).
const MAX_COMPLETION_LOGPROBS: i64 = 5;

/// Chat's `logprobs` (a flag) and `top_logprobs` (0..=20, only with the flag, as OpenAI
/// requires) → the alternatives per token, `None` when not asked.
fn chat_logprobs(logprobs: Option<bool>, top: Option<i64>) -> Result<Option<u8>, ServeError> {
    match (logprobs.unwrap_or(false), top) {
        (false, None) => Ok(None),
        (false, Some(_)) => Err(ServeError::invalid(
            "top_logprobs requires logprobs to be set to true",
        )
        .with_param("top_logprobs")),
        (true, top) => logprobs_count(top.unwrap_or(0), MAX_TOP_LOGPROBS, "top_logprobs").map(Some),
    }
}

/// A number of alternatives per token in `0..=max`.
fn logprobs_count(n: i64, max: i64, param: &'static str) -> Result<u8, ServeError> {
    if !(0..=max).contains(&n) {
        return Err(
            ServeError::invalid(format!("{param} must be between 0 and {max}, got {n}"))
                .with_param(param),
        );
    }
    Ok(n as u8)
}

/// A chat message → a conversation message.
fn chat_message(i: usize, m: ChatMessage) -> Result<Message, ServeError> {
    let role = match m.role.as_str() {
        // OpenAI's newer name for the system role.
        "system" | "developer" => "system",
        "user" => "user",
        "assistant" => "assistant",
        "tool" => "tool",
        other => {
            return Err(ServeError::invalid(format!(
                "unknown role {other:?}: expected system, developer, user, assistant or tool"
            ))
            .with_param(format!("messages[{i}].role")));
        }
    };
    let content = match m.content {
        None => Content::Text(String::new()),
        Some(MessageContent::Text(t)) => Content::Text(t),
        Some(MessageContent::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.into_iter().enumerate() {
                match (part.kind.as_str(), part.text) {
                    ("text", Some(t)) => texts.push(t),
                    _ => {
                        return Err(ServeError::invalid(
                            "only content parts {\"type\": \"text\", \"text\": ...} are \
                             supported",
                        )
                        .with_param(format!("messages[{i}].content[{j}]")));
                    }
                }
            }
            Content::Parts(texts)
        }
    };
    let tool_calls = match m.tool_calls {
        Some(calls) if role == "assistant" => Some(
            calls
                .into_iter()
                .enumerate()
                .map(|(j, c)| {
                    let id = c.id.unwrap_or_else(|| format!("call_{i}_{j}"));
                    match c.function.arguments {
                        None => ToolCall::from_text(id, c.function.name, "{}"),
                        Some(Json::Str(text)) => ToolCall::from_text(id, c.function.name, &text),
                        Some(args) => ToolCall {
                            id,
                            name: c.function.name,
                            arguments: args,
                        },
                    }
                })
                .collect(),
        ),
        _ => None,
    };
    Ok(Message {
        role,
        content,
        name: m.name,
        tool_calls,
        tool_call_id: if role == "tool" { m.tool_call_id } else { None },
    })
}

/// Tool definitions of chat completions: `{"type": "function", "function": {"name", …}}`
/// each; an empty list is no tools.
pub(crate) fn check_chat_tools(
    tools: Option<Vec<Json>>,
    param: &str,
) -> Result<Option<Vec<Json>>, ServeError> {
    let Some(tools) = tools.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    for (i, tool) in tools.iter().enumerate() {
        let kind = tool.get("type").and_then(Json::as_str);
        let name = tool
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Json::as_str);
        if kind != Some("function") || name.is_none_or(str::is_empty) {
            return Err(ServeError::invalid(
                "each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., \
                 \"parameters\": ...}}",
            )
            .with_param(format!("{param}[{i}]")));
        }
    }
    Ok(Some(tools))
}

/// `tool_choice`: `auto` (the default) and `none` are served; forcing a call is not.
/// Returns whether it is `none`.
pub(crate) fn check_tool_choice(choice: Option<&Json>) -> Result<bool, ServeError> {
    match choice {
        None | Some(Json::Null) => Ok(false),
        Some(Json::Str(s)) if s == "auto" => Ok(false),
        Some(Json::Str(s)) if s == "none" => Ok(true),
        Some(Json::Object(_))
            if choice.and_then(|c| c.get("type")).and_then(Json::as_str) == Some("auto") =>
        {
            Ok(false)
        }
        Some(Json::Object(_))
            if choice.and_then(|c| c.get("type")).and_then(Json::as_str) == Some("none") =>
        {
            Ok(true)
        }
        Some(_) => Err(unsupported(
            "tool_choice",
            "only tool_choice \"auto\" and \"none\" are supported",
        )),
    }
}

pub(crate) fn check_completion(
    req: CompletionRequest,
    config: &HttpConfig,
) -> Result<Checked, ServeError> {
    let common = Common {
        model: req.model,
        max_tokens: req.max_tokens.map(|v| (v, "max_tokens")),
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        min_p: req.min_p,
        logprobs: req
            .logprobs
            .map(|n| logprobs_count(n, MAX_COMPLETION_LOGPROBS, "logprobs"))
            .transpose()?,
        seed: req.seed,
        stop: req.stop,
        ignore_eos: req.ignore_eos,
        stream: req.stream,
        stream_options: req.stream_options,
        n: req.n,
        cache_salt: req.cache_salt,
        priority: req.priority,
        service_tier: req.service_tier,
        timeout: req.timeout,
        hints: HintFields {
            tandem: req.tandem,
            reasoning_effort: None,
            session_field: req.user,
        },
    };
    let model = resolve_model(common.model.as_deref(), config)?;
    if req.echo == Some(true) {
        return Err(unsupported("echo", "echo is not supported"));
    }
    if req.best_of.is_some_and(|n| n != 1) {
        return Err(unsupported("best_of", "best_of must be 1"));
    }
    if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix", "suffix is not supported"));
    }
    let one = |what: &str| {
        ServeError::invalid(format!("{what}: only one prompt per request is supported"))
            .with_param("prompt")
    };
    let prompt = match req.prompt {
        None => return Err(ServeError::invalid("prompt is required").with_param("prompt")),
        Some(Prompt::Text(t)) => PromptInput::Text(t),
        Some(Prompt::Tokens(t)) => PromptInput::Tokens(t),
        Some(Prompt::Texts(mut v)) if v.len() == 1 => PromptInput::Text(v.remove(0)),
        Some(Prompt::TokenLists(mut v)) if v.len() == 1 => PromptInput::Tokens(v.remove(0)),
        Some(Prompt::Texts(_)) => return Err(one("a list of prompts")),
        Some(Prompt::TokenLists(_)) => return Err(one("a list of token lists")),
    };
    let empty = match &prompt {
        PromptInput::Text(t) => t.is_empty(),
        PromptInput::Tokens(t) => t.is_empty(),
        PromptInput::Chat(c) => c.messages.is_empty(),
    };
    if empty {
        return Err(ServeError::invalid("prompt must not be empty").with_param("prompt"));
    }
    finish_common(
        common,
        model,
        Endpoint::Completion,
        prompt,
        "prompt",
        config,
    )
}

pub(crate) fn unsupported(param: &'static str, message: &str) -> ServeError {
    ServeError::invalid(message)
        .with_param(param)
        .with_code("unsupported_parameter")
}

pub(crate) fn finish_common(
    c: Common,
    model: ModelChoice,
    endpoint: Endpoint,
    prompt: PromptInput,
    prompt_param: &'static str,
    config: &HttpConfig,
) -> Result<Checked, ServeError> {
    if let Some(n) = c.n.filter(|&n| n != 1) {
        return Err(ServeError::invalid(format!(
            "n must be 1 (one choice per request is supported), got {n}"
        ))
        .with_param("n")
        .with_code("unsupported_parameter"));
    }
    let max_tokens = match c.max_tokens {
        None => None,
        Some((v, param)) if v < 1 => {
            return Err(
                ServeError::invalid(format!("{param} must be at least 1, got {v}"))
                    .with_param(param),
            );
        }
        // Anything over u32::MAX is over any context length; the context check reports it.
        Some((v, param)) => Some((u32::try_from(v).unwrap_or(u32::MAX), param)),
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ServeError::invalid(format!(
            "temperature must be between 0 and 2, got {temperature}"
        ))
        .with_param("temperature"));
    }
    let top_p = c.top_p.unwrap_or(1.0);
    if !(0.0..=1.0).contains(&top_p) {
        return Err(
            ServeError::invalid(format!("top_p must be between 0 and 1, got {top_p}"))
                .with_param("top_p"),
        );
    }
    // vLLM's convention: -1 (or 0) keeps every token.
    let top_k = match c.top_k {
        None | Some(-1 | 0) => 0,
        Some(k) if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
        Some(k) => {
            return Err(ServeError::invalid(format!(
                "top_k must be -1 (off) or at least 1, got {k}"
            ))
            .with_param("top_k"));
        }
    };
    let min_p = c.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(
            ServeError::invalid(format!("min_p must be between 0 and 1, got {min_p}"))
                .with_param("min_p"),
        );
    }
    let stop: Vec<String> = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    // Empty stop strings would match at once; they are ignored, as an empty list is.
    let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
    if stop.len() > config.max_stop_sequences {
        return Err(ServeError::invalid(format!(
            "at most {} stop sequences are supported, got {}",
            config.max_stop_sequences,
            stop.len()
        ))
        .with_param("stop"));
    }
    if stop.iter().any(|s| s.len() > config.max_stop_bytes) {
        return Err(ServeError::invalid(format!(
            "a stop sequence may be at most {} bytes long",
            config.max_stop_bytes
        ))
        .with_param("stop"));
    }
    let priority = match (&c.priority, c.service_tier.as_deref()) {
        (Some(PriorityField::Name(name)), _) => Priority::parse(name).ok_or_else(|| {
            ServeError::invalid(format!(
                "unknown priority {name:?}; use interactive, standard or batch (or an integer, \
                 lower first)"
            ))
            .with_param("priority")
        })?,
        (Some(PriorityField::Int(p)), _) => Priority::from_int(*p),
        (None, Some(tier)) => Priority::from_service_tier(tier),
        (None, None) => Priority::Standard,
    };
    let timeout = match c.timeout {
        Some(t) if !(t.is_finite() && t > 0.0) => {
            return Err(ServeError::invalid(format!(
                "timeout must be a number of seconds > 0, got {t}"
            ))
            .with_param("timeout"));
        }
        t => t,
    };
    let mut hints = c.hints;
    if config.session_field != SessionField::User {
        // Another field (read from the body by the caller) or none names the session.
        hints.session_field = None;
    }
    let routing = hints.check()?;
    let stream = c.stream.unwrap_or(false);
    // stream_options only matter when streaming; elsewhere they are ignored.
    let include_usage = stream
        && c.stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
    Ok(Checked {
        endpoint,
        model: model.model,
        adapter: model.adapter,
        prompt,
        prompt_param,
        max_tokens,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        min_p: min_p as f32,
        logprobs: c.logprobs,
        // Any 64-bit seed is accepted; negative ones are taken as their two's complement.
        seed: c.seed.map(|s| s as u64),
        stop,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        stream,
        include_usage,
        cache_salt: c.cache_salt.filter(|s| !s.is_empty()),
        priority,
        routing,
        timeout,
        wants_tool_calls: false,
    })
}

impl Checked {
    /// Tokenizes the prompt (and checks given ids against the vocabulary); a conversation
    /// goes through the chat template first.
    pub(crate) fn tokenize(
        &self,
        tokenizer: &Tokenizer,
        prompts: &Prompts,
    ) -> Result<Vec<u32>, ServeError> {
        match &self.prompt {
            PromptInput::Text(text) => tokenizer.encode(text).map_err(|e| {
                ServeError::invalid(format!("failed to tokenize the prompt: {e}"))
                    .with_param(self.prompt_param)
            }),
            PromptInput::Tokens(ids) => match ids.iter().find(|&&id| !tokenizer.is_valid_token(id))
            {
                Some(bad) => Err(ServeError::invalid(format!(
                    "token id {bad} is not in the vocabulary of {}",
                    tokenizer.name()
                ))
                .with_param(self.prompt_param)),
                None => Ok(ids.clone()),
            },
            PromptInput::Chat(conv) => prompts.encode(conv),
        }
    }

    /// Whether tokenizing may take long enough to move it off the async threads.
    pub(crate) fn is_large(&self) -> bool {
        match &self.prompt {
            PromptInput::Text(t) => t.len() > LARGE_PROMPT_BYTES,
            PromptInput::Tokens(_) => false,
            PromptInput::Chat(c) => {
                let bytes: usize = c
                    .messages
                    .iter()
                    .map(|m| match &m.content {
                        Content::Text(t) => t.len(),
                        Content::Parts(p) => p.iter().map(String::len).sum(),
                    })
                    .sum();
                bytes > LARGE_PROMPT_BYTES || c.tools.is_some()
            }
        }
    }

    /// Checks the context length and picks `max_tokens`; the last step to a [`ValidRequest`].
    pub(crate) fn into_valid(
        self,
        prompt_tokens: Vec<u32>,
        config: &HttpConfig,
        (id, response_id): (u64, String),
        (created, arrived): (u64, std::time::Instant),
    ) -> Result<ValidRequest, ServeError> {
        let context = config.context_length;
        let n = u32::try_from(prompt_tokens.len()).unwrap_or(u32::MAX);
        if n == 0 {
            return Err(
                ServeError::invalid("the prompt is empty after tokenization")
                    .with_param(self.prompt_param),
            );
        }
        if n >= context {
            return Err(ServeError::invalid(format!(
                "This model's maximum context length is {context} tokens. However, your \
                 prompt has {n} tokens, which leaves no room for the completion."
            ))
            .with_param(self.prompt_param)
            .with_code("context_length_exceeded"));
        }
        let room = context - n;
        let max_tokens = match self.max_tokens {
            Some((m, param)) if m > room => {
                return Err(ServeError::invalid(format!(
                    "This model's maximum context length is {context} tokens. However, you \
                     requested {} tokens ({n} in the prompt, {m} for the completion). Please \
                     reduce the prompt or {param}.",
                    u64::from(n) + u64::from(m)
                ))
                .with_param(param)
                .with_code("context_length_exceeded"));
            }
            Some((m, _)) => m,
            None => config.default_max_tokens.clamp(1, room),
        };
        Ok(ValidRequest {
            id,
            response_id,
            embed: self.endpoint == Endpoint::Embeddings,
            endpoint: self.endpoint,
            model: self.model,
            adapter: self.adapter,
            prompt_tokens,
            source: match self.prompt {
                PromptInput::Text(text) => Some(PromptSource::completion(text)),
                PromptInput::Chat(conversation) => Some(PromptSource::chat(conversation)),
                PromptInput::Tokens(_) => None,
            },
            max_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            logprobs: self.logprobs,
            seed: self.seed,
            stop: self.stop,
            ignore_eos: self.ignore_eos,
            stream: self.stream,
            include_usage: self.include_usage,
            cache_salt: self.cache_salt,
            created,
            engine: Default::default(),
            tenant: None,
            priority: self.priority,
            routing: self.routing,
            deadline: arrived + config.timeout_for(self.timeout),
        })
    }
}

/// The scheduling headers, which win over the body's fields: `x-tandem-priority` (a band name
/// or an integer, as the `priority` field) and `x-tandem-timeout` (seconds, capped by the
/// server's request timeout). `arrived` is when the request came in.
pub(crate) fn apply_scheduling_headers(
    req: &mut ValidRequest,
    headers: &axum::http::HeaderMap,
    config: &HttpConfig,
    arrived: std::time::Instant,
) -> Result<(), ServeError> {
    let text = |name: &'static str| -> Result<Option<&str>, ServeError> {
        match headers.get(name) {
            None => Ok(None),
            Some(v) => v.to_str().map(|s| Some(s.trim())).map_err(|_| {
                ServeError::invalid(format!("header {name} is not visible ASCII")).with_param(name)
            }),
        }
    };
    if let Some(p) = text("x-tandem-priority")? {
        req.priority = match p.parse::<i64>() {
            Ok(i) => Priority::from_int(i),
            Err(_) => Priority::parse(p).ok_or_else(|| {
                ServeError::invalid(format!(
                    "unknown priority {p:?} in x-tandem-priority; use interactive, standard or \
                     batch (or an integer, lower first)"
                ))
                .with_param("x-tandem-priority")
            })?,
        };
    }
    if let Some(t) = text("x-tandem-timeout")? {
        let secs = t
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .ok_or_else(|| {
                ServeError::invalid(format!(
                    "x-tandem-timeout must be a number of seconds > 0, got {t:?}"
                ))
                .with_param("x-tandem-timeout")
            })?;
        req.deadline = arrived + config.timeout_for(Some(secs));
    }
    Ok(())
}
