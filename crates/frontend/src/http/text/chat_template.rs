//! Chat templates: [`ChatTemplateSpec`] says where the template comes from, [`ChatTemplate`]
//! is the compiled template, rendered with Hugging Face's semantics.
//!
//! What transformers does (`src/transformers/utils/chat_template_utils.py`,
//! `_compile_jinja_template` and `apply_chat_template`), and what we do:
//!
//! - Environment: `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
//!   `loopcontrols`; its `{% generation %}` tag only marks assistant tokens, so we rewrite it
//!   to `{% if true %}` (same output). Python string, dict and list methods (`.strip()`,
//!   `.items()`, …) come from minijinja-contrib's pycompat.
//! - Globals: `raise_exception(msg)` (here: a 400 to the client with `msg`), `strftime_now(fmt)`
//!   (here in UTC, from an injectable clock), and the `tojson` filter as `json.dumps(x,
//!   ensure_ascii=False, …)` keeping key order (see `pyjson.rs`).
//! - Context: `messages`, `tools` (`None` without tools), `documents=None`,
//!   `add_generation_prompt=True`, and the tokenizer's special tokens map (`bos_token`,
//!   `eos_token`, `unk_token`, `pad_token`, … from `tokenizer_config.json`).
//! - Named templates: `chat_template` may be a list of `{name, template}`; `tool_use` is used
//!   when the request has tools and it exists, else `default`, unless a name is configured.
//! - Content: like vLLM, templates that iterate over `message.content` get the list of text
//!   parts; the others get the parts joined by newlines.
//!
//! The built-in default ([`ChatTemplateSpec::Default`]) is ChatML; without tools its output
//! is byte for byte the pre-template frontend's, and it is tokenized the same way (all text,
//! see `prompt.rs`). With tools it adds a Hermes-style tools block, so that the default setup
//! can call tools too.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;
use std::time::SystemTime;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::Value;
use minijinja::{Environment, Error as JinjaError, ErrorKind as JinjaErrorKind};

use crate::http::conversation::{Content, ContentFormat, Conversation, Message};
use crate::http::error::ServeError;
use crate::http::pyjson::{Json, tojson_filter};
use crate::http::strftime::strftime;

/// Where the chat template comes from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ChatTemplateSpec {
    /// The built-in ChatML template (the mocker's, and the default).
    #[default]
    Default,
    /// A Jinja template file (`--chat-template FILE`). `tokenizer_config`, when given, supplies
    /// `bos_token` / `eos_token` and the other special tokens.
    File {
        path: PathBuf,
        tokenizer_config: Option<PathBuf>,
    },
    /// The `chat_template` of a `tokenizer_config.json` (a string, or a list of `{name,
    /// template}`; `name` picks one of the list, else `default` / `tool_use` as transformers
    /// does). Without a `chat_template` key, a `chat_template.jinja` beside it is used.
    TokenizerConfig { path: PathBuf, name: Option<String> },
    /// The `tokenizer.chat_template` of a GGUF model file, with its BOS and EOS token strings.
    Gguf { path: PathBuf },
}

impl FromStr for ChatTemplateSpec {
    type Err = ChatTemplateError;

    /// `default` / `chatml`: the built-in template; a path ending in `.json`: a
    /// `tokenizer_config.json`; any other path: a template file.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "" => Err(ChatTemplateError::Invalid(
                "empty chat template spec".to_string(),
            )),
            "default" | "chatml" => Ok(ChatTemplateSpec::Default),
            path if path.ends_with(".json") => Ok(ChatTemplateSpec::TokenizerConfig {
                path: PathBuf::from(path),
                name: None,
            }),
            path => Ok(ChatTemplateSpec::File {
                path: PathBuf::from(path),
                tokenizer_config: None,
            }),
        }
    }
}

impl ChatTemplateSpec {
    /// What the CLI flags mean together: `--chat-template` (a template file, or a
    /// `tokenizer_config.json`), `--chat-template-name`, and the model's
    /// `tokenizer_config.json` if one is known (see [`Self::tokenizer_config_beside`]). With
    /// neither, the built-in default.
    pub fn from_flags(
        chat_template: Option<&Path>,
        name: Option<&str>,
        tokenizer_config: Option<&Path>,
    ) -> Self {
        let name = name.map(str::to_string);
        match (chat_template, tokenizer_config) {
            (Some(p), _) if p.extension().is_some_and(|e| e == "json") => {
                ChatTemplateSpec::TokenizerConfig {
                    path: p.to_path_buf(),
                    name,
                }
            }
            (Some(p), config) => ChatTemplateSpec::File {
                path: p.to_path_buf(),
                tokenizer_config: config.map(Path::to_path_buf),
            },
            (None, Some(config)) => ChatTemplateSpec::TokenizerConfig {
                path: config.to_path_buf(),
                name,
            },
            (None, None) => ChatTemplateSpec::Default,
        }
    }

    /// The `tokenizer_config.json` next to a Hugging Face `tokenizer.json`, if there is one.
    pub fn tokenizer_config_beside(tokenizer_json: &Path) -> Option<PathBuf> {
        let candidate = tokenizer_json.parent()?.join("tokenizer_config.json");
        candidate.is_file().then_some(candidate)
    }
}

/// Why a chat template could not be loaded; fails startup.
#[derive(Debug, thiserror::Error)]
pub enum ChatTemplateError {
    #[error("failed to read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("{path} is not a valid tokenizer_config.json: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path} has no chat_template (and no chat_template.jinja beside it)")]
    NoTemplate { path: PathBuf },
    #[error("no chat template named {name:?} in {path}; it has: {available}")]
    NoSuchName {
        path: PathBuf,
        name: String,
        available: String,
    },
    #[error("the chat template from {origin} does not compile: {message}")]
    Compile { origin: String, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// The clock `strftime_now` reads.
pub type Clock = Arc<dyn Fn() -> SystemTime + Send + Sync>;

/// A compiled chat template and the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The template used without tools (or always, when a name was configured).
    main: String,
    /// transformers' `tool_use` template, used when a request has tools.
    tool_use: Option<String>,
    /// `bos_token`, `eos_token`, … as the template sees them.
    special: Vec<(String, Value)>,
    bos_token: Option<String>,
    content_format: ContentFormat,
    builtin: bool,
    mentions_tool_call: bool,
    origin: String,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("origin", &self.origin)
            .field("main", &self.main)
            .field("tool_use", &self.tool_use)
            .field("content_format", &self.content_format)
            .finish_non_exhaustive()
    }
}

/// The built-in default: ChatML, plus a Hermes-style tools block when tools are given.
/// Without tools it renders exactly `<|im_start|>{role}\n{content}<|im_end|>\n` per message
/// and then `<|im_start|>assistant\n`.
pub const DEFAULT_TEMPLATE: &str = r#"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (tools and loop.first and message.role == 'system') %}
{{- '<|im_start|>' + message.role + '\n' + message.content }}
{%- for call in message.tool_calls or [] %}
{%- if message.content or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

/// Marks an error raised by the template's `raise_exception`, to tell it from other failures.
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

impl ChatTemplate {
    /// Loads and compiles the template `spec` names, with the system clock.
    pub fn load(spec: &ChatTemplateSpec) -> Result<ChatTemplate, ChatTemplateError> {
        Self::load_with_clock(spec, Arc::new(SystemTime::now))
    }

    /// [`Self::load`] with the clock `strftime_now` reads (tests pin it).
    pub fn load_with_clock(
        spec: &ChatTemplateSpec,
        clock: Clock,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        match spec {
            ChatTemplateSpec::Default => {
                let mut t = Self::compile(
                    vec![("default".to_string(), DEFAULT_TEMPLATE.to_string())],
                    None,
                    Vec::new(),
                    "the built-in default".to_string(),
                    clock,
                )?;
                t.builtin = true;
                Ok(t)
            }
            ChatTemplateSpec::File {
                path,
                tokenizer_config,
            } => {
                let source = read(path)?;
                let special = match tokenizer_config {
                    Some(config) => special_tokens(&parse_config(config)?),
                    None => Vec::new(),
                };
                Self::single(source, special, path, clock)
            }
            ChatTemplateSpec::Gguf { path } => {
                let invalid = |message: String| ChatTemplateError::Config {
                    path: path.clone(),
                    message,
                };
                let file =
                    tandem_native::GgufFile::read(path).map_err(|e| invalid(e.to_string()))?;
                let info =
                    tandem_native::tokenizer::info(&file).map_err(|e| invalid(e.to_string()))?;
                let source = info
                    .chat_template
                    .clone()
                    .ok_or_else(|| ChatTemplateError::NoTemplate { path: path.clone() })?;
                let tokens = file
                    .get_str_array("tokenizer.ggml.tokens")
                    .unwrap_or_default();
                let name_of = |id: Option<u32>| id.and_then(|i| tokens.get(i as usize)).cloned();
                let special = [
                    ("bos_token", name_of(info.bos)),
                    ("eos_token", name_of(info.eos)),
                ]
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_string(), Value::from(v?))))
                .collect();
                Self::single(source, special, path, clock)
            }
            ChatTemplateSpec::TokenizerConfig { path, name } => {
                let config = parse_config(path)?;
                let templates = templates_of(path, &config)?;
                Self::compile(
                    templates,
                    name.as_deref(),
                    special_tokens(&config),
                    path.display().to_string(),
                    clock,
                )
            }
        }
    }

    /// Compiles `source` with the given special tokens (`("bos_token", "<s>")`, …).
    pub fn from_source(
        source: &str,
        special: &[(&str, &str)],
        clock: Clock,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let special = special
            .iter()
            .map(|(k, v)| (k.to_string(), Value::from(*v)))
            .collect();
        Self::compile(
            vec![("default".to_string(), source.to_string())],
            None,
            special,
            "a template string".to_string(),
            clock,
        )
    }

    /// One template, `default`, from the file at `path`.
    fn single(
        source: String,
        special: Vec<(String, Value)>,
        path: &Path,
        clock: Clock,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        Self::compile(
            vec![("default".to_string(), source)],
            None,
            special,
            path.display().to_string(),
            clock,
        )
    }

    fn compile(
        templates: Vec<(String, String)>,
        name: Option<&str>,
        special: Vec<(String, Value)>,
        origin: String,
        clock: Clock,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let available = || {
            templates
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let has = |n: &str| templates.iter().any(|(t, _)| t == n);
        let (main, tool_use) = match name {
            Some(n) if has(n) => (n.to_string(), None),
            Some(n) => {
                return Err(ChatTemplateError::NoSuchName {
                    path: PathBuf::from(&origin),
                    name: n.to_string(),
                    available: available(),
                });
            }
            None if has("default") => (
                "default".to_string(),
                has("tool_use").then(|| "tool_use".to_string()),
            ),
            None => {
                return Err(ChatTemplateError::NoSuchName {
                    path: PathBuf::from(&origin),
                    name: "default".to_string(),
                    available: available(),
                });
            }
        };
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatTemplateError::Invalid(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: String| {
            strftime(&format, clock())
        });
        let mut content_format = ContentFormat::String;
        let mut mentions_tool_call = false;
        for (n, source) in &templates {
            if *n != main && Some(n) != tool_use.as_ref() {
                continue;
            }
            if iterates_over_content(source) {
                content_format = ContentFormat::Parts;
            }
            mentions_tool_call |= source.contains("<tool_call>");
            env.add_template_owned(n.clone(), rewrite_generation_tags(source))
                .map_err(|e| ChatTemplateError::Compile {
                    origin: origin.clone(),
                    message: format!("{e:#}"),
                })?;
        }
        let bos_token = special
            .iter()
            .find(|(k, _)| k == "bos_token")
            .and_then(|(_, v)| v.as_str().map(str::to_string));
        Ok(ChatTemplate {
            env,
            main,
            tool_use,
            special,
            bos_token,
            content_format,
            builtin: false,
            mentions_tool_call,
            origin,
        })
    }

    /// Whether this is the built-in default (its prompts are tokenized as plain text, as
    /// before templates existed).
    pub fn is_builtin(&self) -> bool {
        self.builtin
    }

    /// Whether the template mentions `<tool_call>` (Hermes / Qwen tool calling): the
    /// `auto` tool-call parser then parses such blocks out of the output.
    pub fn mentions_tool_call(&self) -> bool {
        self.mentions_tool_call
    }

    /// The `bos_token` the template sees, if the tokenizer config names one.
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// Where the template came from (for logs).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Renders `conv` with `add_generation_prompt=True`. `text` is applied to every string of
    /// the request. A `raise_exception` becomes a 400 with its message; any other failure
    /// a 400 that says the template failed.
    pub(crate) fn render(
        &self,
        conv: &Conversation,
        text: &dyn Fn(&str) -> String,
    ) -> Result<String, ServeError> {
        if self.builtin
            && let Some(rendered) = chatml(conv, text)
        {
            return Ok(rendered);
        }
        self.render_jinja(conv, text)
    }

    /// [`Self::render`] through the compiled template, always.
    pub(crate) fn render_jinja(
        &self,
        conv: &Conversation,
        text: &dyn Fn(&str) -> String,
    ) -> Result<String, ServeError> {
        let name = match (&conv.tools, &self.tool_use) {
            (Some(_), Some(tool_use)) => tool_use.as_str(),
            _ => self.main.as_str(),
        };
        let template = self
            .env
            .get_template(name)
            .map_err(|e| ServeError::internal(format!("chat template {name} is missing: {e}")))?;
        let mut context = vec![
            (
                "messages".to_string(),
                conv.messages_value(self.content_format, text),
            ),
            ("tools".to_string(), conv.tools_value(text)),
            ("documents".to_string(), Value::from(())),
            ("add_generation_prompt".to_string(), Value::from(true)),
        ];
        context.extend(self.special.iter().cloned());
        let context = Value::from_pairs(context);
        template.render(context).map_err(|e| render_error(&e))
    }
}

/// What [`DEFAULT_TEMPLATE`] renders for a conversation without tools or tool calls, written
/// directly (minijinja's evaluation was ~8 % of a proxied request's CPU): `None` for a
/// conversation that needs the template's tools branches. Tests compare the two on random
/// conversations (`http/tests/templates.rs`).
fn chatml(conv: &Conversation, text: &dyn Fn(&str) -> String) -> Option<String> {
    // An empty list is false in Jinja: `tools` and `message.tool_calls or []` do nothing then.
    let calls = |m: &Message| m.tool_calls.as_ref().is_some_and(|c| !c.is_empty());
    if conv.tools.as_ref().is_some_and(|t| !t.is_empty()) || conv.messages.iter().any(calls) {
        return None;
    }
    let mut out = String::with_capacity(
        conv.messages
            .iter()
            .map(|m| 32 + content_len(&m.content))
            .sum::<usize>()
            + 32,
    );
    for m in &conv.messages {
        out.push_str("<|im_start|>");
        out.push_str(m.role);
        out.push('\n');
        match &m.content {
            Content::Text(t) => out.push_str(&text(t)),
            Content::Parts(_) => out.push_str(&text(&m.content.joined())),
        }
        out.push_str("<|im_end|>\n");
    }
    out.push_str("<|im_start|>assistant\n");
    Some(out)
}

/// Whether [`chatml`] renders `conv` itself (for tests).
#[cfg(test)]
pub(crate) fn tests_chatml(conv: &Conversation) -> bool {
    chatml(conv, &|t| t.to_string()).is_some()
}

fn content_len(content: &Content) -> usize {
    match content {
        Content::Text(t) => t.len(),
        Content::Parts(p) => p.iter().map(|t| t.len() + 1).sum(),
    }
}

fn raise_exception(message: String) -> Result<Value, JinjaError> {
    Err(
        JinjaError::new(JinjaErrorKind::InvalidOperation, message.clone())
            .with_source(Raised(message)),
    )
}

/// A render failure as the client sees it: 400 either way (vLLM answers template errors with
/// 400 too); a `raise_exception` keeps its own message.
fn render_error(e: &JinjaError) -> ServeError {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = source {
        if let Some(raised) = err.downcast_ref::<Raised>() {
            return ServeError::invalid(raised.0.clone()).with_code("chat_template_error");
        }
        source = err.source();
    }
    ServeError::invalid(format!(
        "the chat template failed to render this conversation: {e:#}"
    ))
    .with_code("chat_template_error")
}

fn read(path: &Path) -> Result<String, ChatTemplateError> {
    std::fs::read_to_string(path).map_err(|e| ChatTemplateError::Read {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

fn parse_config(path: &Path) -> Result<Json, ChatTemplateError> {
    let text = read(path)?;
    let config = Json::parse(&text).map_err(|e| ChatTemplateError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if !config.is_object() {
        return Err(ChatTemplateError::Config {
            path: path.to_path_buf(),
            message: "not a JSON object".to_string(),
        });
    }
    Ok(config)
}

/// The named templates of a tokenizer config: a string is `default`; a list is `{name,
/// template}` items; neither: `chat_template.jinja` beside the file.
fn templates_of(path: &Path, config: &Json) -> Result<Vec<(String, String)>, ChatTemplateError> {
    let bad = |message: &str| ChatTemplateError::Config {
        path: path.to_path_buf(),
        message: message.to_string(),
    };
    match config.get("chat_template") {
        Some(Json::Str(s)) => Ok(vec![("default".to_string(), s.clone())]),
        Some(Json::Array(items)) => items
            .iter()
            .map(|item| {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => Ok((n.to_string(), t.to_string())),
                    _ => Err(bad(
                        "chat_template list items need a name and a template string",
                    )),
                }
            })
            .collect(),
        Some(Json::Null) | None => {
            let beside = path.with_file_name("chat_template.jinja");
            if beside.is_file() {
                Ok(vec![("default".to_string(), read(&beside)?)])
            } else {
                Err(ChatTemplateError::NoTemplate {
                    path: path.to_path_buf(),
                })
            }
        }
        Some(_) => Err(bad(
            "chat_template must be a string or a list of {name, template}",
        )),
    }
}

/// transformers' `special_tokens_map`: the special tokens that are set, as strings (a
/// config spells them as a string or as `{"content": ...}`).
fn special_tokens(config: &Json) -> Vec<(String, Value)> {
    fn token(v: &Json) -> Option<String> {
        match v {
            Json::Str(s) => Some(s.clone()),
            Json::Object(_) => v.get("content").and_then(Json::as_str).map(str::to_string),
            _ => None,
        }
    }
    let mut out = Vec::new();
    for key in [
        "bos_token",
        "eos_token",
        "unk_token",
        "sep_token",
        "pad_token",
        "cls_token",
        "mask_token",
    ] {
        if let Some(t) = config.get(key).and_then(token) {
            out.push((key.to_string(), Value::from(t)));
        }
    }
    if let Some(Json::Array(items)) = config.get("additional_special_tokens") {
        let tokens: Vec<Value> = items.iter().filter_map(token).map(Value::from).collect();
        out.push(("additional_special_tokens".to_string(), Value::from(tokens)));
    }
    out
}

/// `{% generation %}` … `{% endgeneration %}` (transformers' `AssistantTracker`) only records
/// where assistant text is; as `{% if true %}` … `{% endif %}` it renders the same, whitespace
/// control marks kept.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let tag = &rest[start..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let trimmed = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match trimmed {
            "generation" => Some(inner.replacen("generation", "if true", 1)),
            "endgeneration" => Some(inner.replacen("endgeneration", "endif", 1)),
            _ => None,
        };
        match replacement {
            Some(inner) => {
                out.push_str("{%");
                out.push_str(&inner);
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

/// vLLM's content-format detection, on the text: a `{% for x in <…>['content'] %}` (or
/// `.content`) means the template wants content as a list of parts.
fn iterates_over_content(source: &str) -> bool {
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let tag = &rest[start + 2..];
        let end = tag.find("%}").unwrap_or(tag.len());
        let inner = tag[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        if let Some(for_clause) = inner.strip_prefix("for ")
            && let Some((_, iterated)) = for_clause.split_once(" in ")
        {
            let iterated = iterated.split(" if ").next().unwrap_or(iterated);
            let iterated = iterated
                .split(" recursive")
                .next()
                .unwrap_or(iterated)
                .trim();
            let iterated = iterated.trim_end_matches(|c: char| c == ')' || c.is_whitespace());
            if iterated.ends_with("['content']")
                || iterated.ends_with("[\"content\"]")
                || iterated.ends_with(".content")
            {
                return true;
            }
        }
        rest = &tag[end..];
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generation_tags_are_rewritten_and_content_iteration_detected() {
        assert_eq!(
            rewrite_generation_tags("a{%- generation -%}b{% endgeneration %}c{% if x %}"),
            "a{%- if true -%}b{% endif %}c{% if x %}"
        );
        assert!(iterates_over_content(
            "{% for part in message['content'] %}{{ part.text }}{% endfor %}"
        ));
        assert!(iterates_over_content(
            "{%- for c in m.content if c.type == 'text' -%}"
        ));
        assert!(!iterates_over_content(
            "{% for message in messages %}{{ message.content }}{% endfor %}"
        ));
    }

    #[test]
    fn spec_parsing_and_flags() {
        assert_eq!(
            "default".parse::<ChatTemplateSpec>().unwrap(),
            ChatTemplateSpec::Default
        );
        assert_eq!(
            "/m/tokenizer_config.json"
                .parse::<ChatTemplateSpec>()
                .unwrap(),
            ChatTemplateSpec::TokenizerConfig {
                path: "/m/tokenizer_config.json".into(),
                name: None
            }
        );
        assert_eq!(
            "/t/llama.jinja".parse::<ChatTemplateSpec>().unwrap(),
            ChatTemplateSpec::File {
                path: "/t/llama.jinja".into(),
                tokenizer_config: None
            }
        );
        assert_eq!(
            ChatTemplateSpec::from_flags(
                Some(Path::new("/t/x.jinja")),
                None,
                Some(Path::new("/m/tokenizer_config.json"))
            ),
            ChatTemplateSpec::File {
                path: "/t/x.jinja".into(),
                tokenizer_config: Some("/m/tokenizer_config.json".into())
            }
        );
        assert_eq!(
            ChatTemplateSpec::from_flags(None, Some("tool_use"), Some(Path::new("/m/c.json"))),
            ChatTemplateSpec::TokenizerConfig {
                path: "/m/c.json".into(),
                name: Some("tool_use".into())
            }
        );
        assert_eq!(
            ChatTemplateSpec::from_flags(None, None, None),
            ChatTemplateSpec::Default
        );
    }
}
