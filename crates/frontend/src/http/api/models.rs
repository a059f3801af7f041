//! The models served — the base model ([`HttpConfig::served_model_name`]) and its LoRA
//! adapters ([`HttpConfig::lora_adapters`]) — and `GET /v1/models`, `GET /v1/models/{model}`.
//!
//! A request's `model` resolves once, here, for every API (chat, completions, Responses,
//! Messages): absent or the served name → the base model; a listed adapter → that adapter;
//! anything else → 404 `model_not_found`. The adapter then joins the request's block-hash
//! seed ([`tandem_protocol::HashSeed::for_request`]), its route (the router's LoRA-aware
//! cost) and what is sent to workers (`lora_adapter`).
//!
//! The model objects follow vLLM's `ModelCard` (`vllm/entrypoints/openai/protocol.py`) and
//! `show_available_models` (`vllm/entrypoints/openai/serving_models.py`): the base model
//! with `root` its name (vLLM: its path) and `parent: null`, then each adapter with `root`
//! its name (vLLM: its path, which the frontend does not know) and `parent` the base model.

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::http::error::ServeError;
use crate::http::json;
use crate::http::openai;
use crate::http::state::{HttpConfig, HttpState};

/// What a request's `model` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModelChoice {
    /// The name responses show (`model`): the served model name or the adapter's.
    pub model: String,
    /// The LoRA adapter it runs on; `None`: the base model.
    pub adapter: Option<String>,
}

/// Resolves a request's `model` field (see the module docs).
pub(crate) fn resolve_model(
    model: Option<&str>,
    config: &HttpConfig,
) -> Result<ModelChoice, ServeError> {
    match model {
        None => Ok(ModelChoice {
            model: config.served_model_name.clone(),
            adapter: None,
        }),
        Some(m) if m == config.served_model_name => Ok(ModelChoice {
            model: m.to_string(),
            adapter: None,
        }),
        Some(m) if config.lora_adapters.iter().any(|a| a == m) => Ok(ModelChoice {
            model: m.to_string(),
            adapter: Some(m.to_string()),
        }),
        Some(m) => Err(ServeError::model_not_found(m)),
    }
}

/// The model objects served, the base model first.
pub(crate) fn model_cards(config: &HttpConfig, created: u64) -> Vec<openai::Model<'_>> {
    let base = config.served_model_name.as_str();
    let mut cards = Vec::with_capacity(1 + config.lora_adapters.len());
    cards.push(openai::Model {
        id: base,
        object: "model",
        created,
        owned_by: "tandem",
        root: base,
        parent: None,
        max_model_len: Some(config.context_length),
    });
    cards.extend(config.lora_adapters.iter().map(|a| openai::Model {
        id: a,
        object: "model",
        created,
        owned_by: "tandem",
        root: a,
        parent: Some(base),
        max_model_len: None,
    }));
    cards
}

/// `GET /v1/models`.
pub(crate) async fn models(State(state): State<HttpState>, headers: HeaderMap) -> Response {
    // OpenAI asks for a key here too; so do we, when keys are configured.
    if let Err(e) = state.access().require_key(&headers) {
        return e.into_response();
    }
    let list = openai::ModelList {
        object: "list",
        data: model_cards(state.config(), state.started()),
    };
    match serde_json::to_string(&list) {
        Ok(body) => json(body),
        Err(e) => ServeError::internal(format!("failed to encode the models: {e}")).into_response(),
    }
}

/// `GET /v1/models/{model}`: the base model or an adapter, else 404 `model_not_found`.
pub(crate) async fn model(
    State(state): State<HttpState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if let Err(e) = state.access().require_key(&headers) {
        return e.into_response();
    }
    let cards = model_cards(state.config(), state.started());
    let Some(card) = cards.iter().find(|c| c.id == name) else {
        return ServeError::model_not_found(&name).into_response();
    };
    match serde_json::to_string(card) {
        Ok(body) => json(body),
        Err(e) => ServeError::internal(format!("failed to encode the model: {e}")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::state::{AdapterNameError, check_adapters};

    fn config(adapters: &[&str]) -> HttpConfig {
        HttpConfig {
            served_model_name: "base".to_string(),
            lora_adapters: adapters.iter().map(|a| a.to_string()).collect(),
            ..HttpConfig::default()
        }
    }

    #[test]
    fn model_resolves_to_the_base_or_an_adapter() {
        let c = config(&["sql-lora", "chat-lora"]);
        let base = ModelChoice {
            model: "base".to_string(),
            adapter: None,
        };
        assert_eq!(resolve_model(None, &c), Ok(base.clone()));
        assert_eq!(resolve_model(Some("base"), &c), Ok(base));
        assert_eq!(
            resolve_model(Some("chat-lora"), &c),
            Ok(ModelChoice {
                model: "chat-lora".to_string(),
                adapter: Some("chat-lora".to_string()),
            })
        );
        for other in ["other", "", "SQL-LORA", "sql-lora "] {
            let e = resolve_model(Some(other), &c).unwrap_err();
            assert_eq!(e.code(), Some("model_not_found"), "{other:?}");
        }
        // Without adapters, only the base model.
        let e = resolve_model(Some("sql-lora"), &config(&[])).unwrap_err();
        assert_eq!(e.code(), Some("model_not_found"));
    }

    #[test]
    fn adapter_names_are_checked() {
        assert_eq!(check_adapters(&config(&["a", "b"])), Ok(()));
        assert_eq!(check_adapters(&config(&[])), Ok(()));
        assert_eq!(check_adapters(&config(&[""])), Err(AdapterNameError::Empty));
        assert_eq!(
            check_adapters(&config(&["base"])),
            Err(AdapterNameError::BaseName("base".into()))
        );
        assert_eq!(
            check_adapters(&config(&["a", "b", "a"])),
            Err(AdapterNameError::Duplicate("a".into()))
        );
        assert_eq!(
            check_adapters(&config(&["a b"])),
            Err(AdapterNameError::BadCharacters("a b".into()))
        );
    }

    #[test]
    fn cards_list_the_base_then_each_adapter_with_its_parent() {
        let c = config(&["sql-lora", "chat-lora"]);
        let v = serde_json::to_value(model_cards(&c, 7)).unwrap();
        assert_eq!(
            v,
            serde_json::json!([
                {"id": "base", "object": "model", "created": 7, "owned_by": "tandem",
                 "root": "base", "parent": null, "max_model_len": 32768},
                {"id": "sql-lora", "object": "model", "created": 7, "owned_by": "tandem",
                 "root": "sql-lora", "parent": "base", "max_model_len": null},
                {"id": "chat-lora", "object": "model", "created": 7, "owned_by": "tandem",
                 "root": "chat-lora", "parent": "base", "max_model_len": null},
            ])
        );
    }
}
