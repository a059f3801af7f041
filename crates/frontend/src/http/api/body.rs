//! [`BodyCheck`]: a request seen outside the HTTP server — its path, headers and body, as
//! the endpoint picker (`crate::epp`) gets them over Envoy's ext_proc — turned into a
//! [`ValidRequest`] by the same steps as the HTTP edge's admission (`generate.rs`):
//! validation, the chat template and tokenizer, the scheduling and session headers, the
//! tenant (`x-tandem-tenant`, no API keys: the gateway authenticates) and its cache salt. The
//! picker routes on the result; it never generates, so what only shapes a response (tool-call
//! parsing, the Responses store) is not needed here.

use std::sync::Arc;

use axum::http::HeaderMap;

use crate::http::auth::{self, Access};
use crate::http::backend::{Endpoint, ValidRequest};
use crate::http::chat_template::ChatTemplate;
use crate::http::error::ServeError;
use crate::http::hints;
use crate::http::ids::unix_now;
use crate::http::messages;
use crate::http::prompt::Prompts;
use crate::http::state::{HttpConfig, StateError};
use crate::http::tokenizer::Tokenizer;
use crate::http::validate::{self, Checked};

/// The API a request path names, when it is one whose prompt the picker can read: chat
/// completions, completions, Anthropic messages. (The Responses API's `previous_response_id`
/// needs the frontend's store: those requests are routed on load alone.)
pub fn endpoint_of(path: &str) -> Option<Endpoint> {
    let path = path.split(['?', '#']).next().unwrap_or_default();
    let path = path.trim_end_matches('/');
    if path.ends_with("/v1/chat/completions") {
        Some(Endpoint::Chat)
    } else if path.ends_with("/v1/completions") {
        Some(Endpoint::Completion)
    } else if path.ends_with("/v1/messages") {
        Some(Endpoint::Messages)
    } else {
        None
    }
}

/// Checks and tokenizes request bodies as the HTTP edge does. Cheap to share by `Arc`.
pub struct BodyCheck {
    config: HttpConfig,
    tokenizer: Arc<Tokenizer>,
    prompts: Prompts,
    access: Access,
}

impl std::fmt::Debug for BodyCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BodyCheck")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl BodyCheck {
    /// Loads the chat template `config` names.
    pub fn new(config: HttpConfig, tokenizer: Arc<Tokenizer>) -> Result<Self, StateError> {
        crate::http::state::check_adapters(&config)?;
        let template = ChatTemplate::load(&config.chat_template)?;
        let access = Access::load(&config.access)?;
        Ok(BodyCheck {
            prompts: Prompts::new(template, tokenizer.clone()),
            tokenizer,
            config,
            access,
        })
    }

    pub fn config(&self) -> &HttpConfig {
        &self.config
    }

    /// The request `body` of `endpoint` with its `headers`, validated and tokenized; `id`
    /// names it in logs. Long prompts are tokenized on a blocking thread.
    pub async fn check(
        self: &Arc<Self>,
        endpoint: Endpoint,
        body: &[u8],
        headers: &HeaderMap,
        id: u64,
    ) -> Result<ValidRequest, ServeError> {
        let arrived = std::time::Instant::now();
        let tenant = self.access.authenticate(headers)?;
        if body.len() > self.config.max_body_bytes {
            return Err(ServeError::payload_too_large(self.config.max_body_bytes));
        }
        let config = &self.config;
        let checked = match endpoint {
            Endpoint::Chat => validate::check_chat(validate::parse_json(body)?, config)?,
            Endpoint::Completion => {
                validate::check_completion(validate::parse_json(body)?, config)?
            }
            Endpoint::Messages => messages::check(validate::parse_json(body)?, config)?,
            Endpoint::Responses => {
                return Err(ServeError::invalid(
                    "the endpoint picker reads no Responses API prompts",
                ));
            }
            Endpoint::Embeddings => {
                return Err(ServeError::invalid(
                    "the endpoint picker reads no embeddings requests",
                ));
            }
        };
        let custom_session = match &config.session_field {
            crate::http::SessionField::Field(name) => hints::session_from_body(body, name),
            _ => None,
        };
        let (checked, tokens) = self.tokenize(checked).await?;
        let mut req =
            checked.into_valid(tokens, config, (id, String::new()), (unix_now(), arrived))?;
        finish(&mut req, headers, config, arrived, custom_session, tenant)?;
        Ok(req)
    }

    async fn tokenize(
        self: &Arc<Self>,
        checked: Checked,
    ) -> Result<(Checked, Vec<u32>), ServeError> {
        if !checked.is_large() {
            let tokens = checked.tokenize(&self.tokenizer, &self.prompts)?;
            return Ok((checked, tokens));
        }
        let me = self.clone();
        tokio::task::spawn_blocking(move || {
            let tokens = checked.tokenize(&me.tokenizer, &me.prompts)?;
            Ok((checked, tokens))
        })
        .await
        .map_err(|e| ServeError::internal(format!("tokenizer task failed: {e}")))?
    }
}

/// What follows validation and tokenization, for the HTTP edge and the endpoint picker
/// alike: the scheduling headers, the session (the configured body field, else the header),
/// the tenant's cache salt and the tenant.
pub(crate) fn finish(
    req: &mut ValidRequest,
    headers: &HeaderMap,
    config: &HttpConfig,
    arrived: std::time::Instant,
    custom_session: Option<String>,
    tenant: Option<auth::Tenant>,
) -> Result<(), ServeError> {
    validate::apply_scheduling_headers(req, headers, config, arrived)?;
    if req.routing.session.is_none() && custom_session.is_some() {
        req.routing.session = custom_session;
    }
    hints::apply_session_header(&mut req.routing, headers)?;
    req.cache_salt = auth::cache_salt(tenant.as_ref(), req.cache_salt.take());
    req.tenant = tenant.map(|t| t.name);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_their_api() {
        assert_eq!(endpoint_of("/v1/chat/completions"), Some(Endpoint::Chat));
        assert_eq!(
            endpoint_of("/v1/completions?x=1"),
            Some(Endpoint::Completion)
        );
        assert_eq!(endpoint_of("/pool/v1/messages/"), Some(Endpoint::Messages));
        assert_eq!(endpoint_of("/v1/responses"), None);
        assert_eq!(endpoint_of("/v1/models"), None);
    }
}
