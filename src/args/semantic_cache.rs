//! `--semantic-cache…`: the frontend's semantic cache (README, "Semantic cache").

use std::time::Duration;

use clap::{ArgAction, Args};

/// The semantic cache (README, "Semantic cache"): answers served again for requests that
/// mean the same, compared by the pool's own embeddings, never between tenants.
#[derive(Args, Debug, Clone)]
pub struct SemanticCacheArgs {
    /// Turn the semantic cache on.
    #[arg(long = "semantic-cache", env = "TANDEM_SEMANTIC_CACHE", default_value_t = false, action = ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub enabled: bool,
    /// The largest cosine distance (1 - cosine similarity) that is a hit: 0.05 recommended,
    /// false hits grow above 0.2.
    #[arg(
        long = "semantic-cache-threshold",
        env = "TANDEM_SEMANTIC_CACHE_THRESHOLD",
        default_value_t = 0.05
    )]
    pub threshold: f32,
    /// Seconds an answer is served from the cache.
    #[arg(
        long = "semantic-cache-ttl-s",
        env = "TANDEM_SEMANTIC_CACHE_TTL_S",
        default_value_t = 3600
    )]
    pub ttl_s: u64,
    /// Most answers held (all tenants together); the oldest go first.
    #[arg(
        long = "semantic-cache-max-entries",
        env = "TANDEM_SEMANTIC_CACHE_MAX_ENTRIES",
        default_value_t = 10_000
    )]
    pub max_entries: usize,
    /// A chat's last this many messages are compared.
    #[arg(
        long = "semantic-cache-messages",
        env = "TANDEM_SEMANTIC_CACHE_MESSAGES",
        default_value_t = 4
    )]
    pub messages: usize,
    /// Compare system messages too.
    #[arg(long = "semantic-cache-include-system", env = "TANDEM_SEMANTIC_CACHE_INCLUDE_SYSTEM", default_value_t = false, action = ArgAction::Set)]
    pub include_system: bool,
    /// Request headers whose values also keep answers apart (comma-separated), beside the
    /// tenant and the model, which always do.
    #[arg(
        long = "semantic-cache-vary-by",
        env = "TANDEM_SEMANTIC_CACHE_VARY_BY",
        value_delimiter = ','
    )]
    pub vary_by: Vec<String>,
    /// An OpenAI-compatible embeddings endpoint (the whole URL, ending in /v1/embeddings) to
    /// compare with, instead of the pool's own model.
    #[arg(
        long = "semantic-cache-embeddings-url",
        env = "TANDEM_SEMANTIC_CACHE_EMBEDDINGS_URL"
    )]
    pub embeddings_url: Option<String>,
    /// The `model` asked of that endpoint.
    #[arg(
        long = "semantic-cache-embeddings-model",
        env = "TANDEM_SEMANTIC_CACHE_EMBEDDINGS_MODEL"
    )]
    pub embeddings_model: Option<String>,
    /// The environment variable holding that endpoint's API key.
    #[arg(
        long = "semantic-cache-embeddings-key-env",
        env = "TANDEM_SEMANTIC_CACHE_EMBEDDINGS_KEY_ENV"
    )]
    pub embeddings_key_env: Option<String>,
}

impl SemanticCacheArgs {
    pub fn config(&self) -> anyhow::Result<tandem_frontend::http::SemanticCacheConfig> {
        // The binary is where the environment is read.
        #[allow(clippy::disallowed_methods)]
        let key = match &self.embeddings_key_env {
            Some(var) => Some(std::env::var(var).map_err(|_| {
                anyhow::anyhow!("--semantic-cache-embeddings-key-env: {var} is not set")
            })?),
            None => None,
        };
        Ok(tandem_frontend::http::SemanticCacheConfig {
            enabled: self.enabled,
            threshold: self.threshold,
            ttl: Duration::from_secs(self.ttl_s),
            max_entries: self.max_entries,
            last_messages: self.messages,
            include_system: self.include_system,
            vary_by: self
                .vary_by
                .iter()
                .map(|h| h.trim().to_ascii_lowercase())
                .filter(|h| !h.is_empty())
                .collect(),
            embeddings_url: self.embeddings_url.clone(),
            embeddings_model: self.embeddings_model.clone(),
            embeddings_key: key.map(|k| tandem_frontend::http::ApiKey(k.trim().to_string())),
        })
    }

    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--semantic-cache={}", self.enabled),
            format!("--semantic-cache-threshold={}", self.threshold),
            format!("--semantic-cache-ttl-s={}", self.ttl_s),
            format!("--semantic-cache-max-entries={}", self.max_entries),
            format!("--semantic-cache-messages={}", self.messages),
            format!("--semantic-cache-include-system={}", self.include_system),
        ];
        if !self.vary_by.is_empty() {
            a.push(format!(
                "--semantic-cache-vary-by={}",
                self.vary_by.join(",")
            ));
        }
        if let Some(url) = &self.embeddings_url {
            a.push(format!("--semantic-cache-embeddings-url={url}"));
        }
        if let Some(model) = &self.embeddings_model {
            a.push(format!("--semantic-cache-embeddings-model={model}"));
        }
        if let Some(var) = &self.embeddings_key_env {
            a.push(format!("--semantic-cache-embeddings-key-env={var}"));
        }
        a
    }
}
