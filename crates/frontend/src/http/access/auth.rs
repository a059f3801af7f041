//! API keys and tenants at the HTTP edge (docs/ARCHITECTURE.md §10, "Tenants"): which tenant a request
//! comes from, whether it may be served at all, and the cache salt that keeps tenants'
//! KV blocks apart.
//!
//! # Modes
//!
//! - **No keys configured** (neither [`AccessConfig::api_keys_file`] nor
//!   [`AccessConfig::api_keys`]): every request is served, as without this module. A request
//!   may name its tenant in `x-tandem-tenant` (for deployments where a gateway in front
//!   authenticated the user); without it, it is anonymous (tenant None).
//! - **Keys configured** (a file, an inline list, or both; even a file that holds no key at
//!   the moment): generation requests and `GET /v1/models` need a known key, sent as
//!   `Authorization: Bearer <key>` (OpenAI) or `x-api-key: <key>` (Anthropic); when both
//!   headers are sent, the Bearer one decides. No key or an unknown one is a 401
//!   (`invalid_api_key`; Anthropic's `authentication_error` on `/v1/messages`). The key names
//!   the tenant; `x-tandem-tenant` is ignored. `/health` and `/live` stay open (probes
//!   carry no key).
//!
//! # The operator's surfaces
//!
//! The status page (`/`, `/status`), `/status.json` and `/metrics` name every tenant and
//! what it used: they are served on the admin listener ([`crate::http::serve_state`]; loopback by
//! default), not to the public. With an admin key ([`AccessConfig::admin_key`], sent as
//! `Authorization: Bearer <key>` or `x-api-key`) they need it on both listeners, and the
//! public one serves them to it (for a scraper that must reach them from elsewhere);
//! without one, the admin listener serves anyone who reaches it and the public one answers
//! 404. A tenant key opens no admin surface and the admin key no API (it names no tenant).
//!
//! # The keys file (`--api-keys-file`)
//!
//! ```json
//! {"tenants": {
//!   "acme": {"keys": ["sk-acme-1", "sk-acme-2"], "cache_salt": "shared-x",
//!            "requests_per_minute": 600, "tokens_per_minute": 200000, "weight": 2},
//!   "beta": {"keys": ["sk-beta"]}
//! }}
//! ```
//!
//! Per tenant: `keys` (at least one; none empty, none with whitespace or control
//! characters, none shared with another tenant), and optionally `cache_salt`, and the flow
//! control limits of [`TenantLimits`] (`requests_per_minute`, `tokens_per_minute`: unset is
//! unlimited; `weight`: the fair share, default 1). Unknown fields, a tenant named twice and
//! a key listed twice are refused. Tenant names are 1–128 characters of `A–Z a–z 0–9 - _ .
//! : @ /`. `--api-keys key=tenant,…` adds keys to the same table (a tenant it names that
//! the file does not gets the defaults).
//!
//! The file is polled ([`AccessConfig::reload_interval`], 2 s) by [`watch_api_keys`]; when
//! its modification time or size changes it is read again. A new table replaces the old one
//! whole (requests already admitted keep the tenant they had); one that fails to read or
//! parse is refused with an error in the log and the old table stays. A file that fails at
//! start stops the process. After every load the backend gets every named tenant's limits
//! ([`crate::http::Backend::set_tenants`]). Write the new file beside the old one and rename it
//! over it, so that a poll never reads half a file.
//!
//! # Cache salts
//!
//! A tenant's requests are salted with its `cache_salt`, or its name when it has none:
//! blocks hashed under different salts never match, so two tenants never share KV blocks
//! (a cache hit would show in their TTFT) unless the operator gives them the same
//! `cache_salt`. A request's own `cache_salt` narrows it further: the salt sent on is
//! `"{tenant salt}\u{1f}{request salt}"` (unit separator; tenant names and configured salts
//! cannot contain control characters, so the composition is unambiguous). Anonymous requests
//! keep their own `cache_salt`, as before.
//!
//! # Comparing keys
//!
//! Keys are never compared byte by byte. The table maps the SHA-256 digest of each key to
//! its tenant, and a presented key is hashed and looked up: the time a lookup takes depends
//! on the digest only, and learning about a digest tells nothing about the key that would
//! help guess the next character (that is what a byte-wise early-exit comparison would
//! leak). The table holds no key in the clear, and [`AccessConfig`]'s `Debug` hides them.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::http::{HeaderMap, header};
use parking_lot::{Mutex, RwLock};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use tandem_router::TenantLimits;

use crate::http::error::ServeError;

/// Where API keys come from. Default: none (no key needed).
#[derive(Clone, PartialEq, Eq)]
pub struct AccessConfig {
    /// The JSON keys file (module docs), polled for changes.
    pub api_keys_file: Option<PathBuf>,
    /// More keys, `(key, tenant)`, fixed for the process's life (`--api-keys`).
    pub api_keys: Vec<(String, String)>,
    /// How often the keys file is checked for changes. Default 2 s.
    pub reload_interval: Duration,
    /// The key that opens the operator's surfaces (module docs). Default: none.
    pub admin_key: Option<String>,
}

/// Which listener a request came in on (the operator's surfaces are the admin one's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    Public,
    Admin,
}

impl Default for AccessConfig {
    fn default() -> Self {
        AccessConfig {
            api_keys_file: None,
            api_keys: Vec::new(),
            reload_interval: Duration::from_secs(2),
            admin_key: None,
        }
    }
}

impl AccessConfig {
    /// Whether requests need a key.
    pub fn keys_required(&self) -> bool {
        self.api_keys_file.is_some() || !self.api_keys.is_empty()
    }
}

impl fmt::Debug for AccessConfig {
    /// Keys are secrets: only their tenants are shown.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let tenants: Vec<&str> = self.api_keys.iter().map(|(_, t)| t.as_str()).collect();
        f.debug_struct("AccessConfig")
            .field("api_keys_file", &self.api_keys_file)
            .field("api_keys (tenants)", &tenants)
            .field("reload_interval", &self.reload_interval)
            .field("admin_key", &self.admin_key.as_ref().map(|_| "(set)"))
            .finish()
    }
}

/// Why a key table was refused.
#[derive(Debug, thiserror::Error)]
pub enum AccessError {
    #[error("reading the API keys file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the API keys file {path} is not valid: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("--api-keys: {0}")]
    Inline(String),
    #[error("--admin-key: {0}")]
    Admin(String),
}

/// The tenant of requests without one (no keys file, or the keys file's open access).
pub(crate) const ANONYMOUS: &str = "anonymous";

/// A request's tenant: its name and the salt its cache is kept under.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Tenant {
    pub(crate) name: Arc<str>,
    salt: Arc<str>,
}

impl Tenant {
    /// The salt sent on with a request of this tenant (module docs, "Cache salts").
    pub(crate) fn cache_salt(&self, request_salt: Option<String>) -> String {
        match request_salt {
            Some(s) => format!("{}\u{1f}{s}", self.salt),
            None => self.salt.to_string(),
        }
    }
}

/// The effective cache salt of a request: tenant None keeps the request's own.
pub(crate) fn cache_salt(tenant: Option<&Tenant>, request_salt: Option<String>) -> Option<String> {
    match tenant {
        Some(t) => Some(t.cache_salt(request_salt)),
        None => request_salt,
    }
}

/// One loaded table: key digests → tenants.
#[derive(Debug, Default)]
struct KeyTable {
    keys: HashMap<[u8; 32], usize>,
    tenants: Vec<(Tenant, TenantLimits)>,
}

impl KeyTable {
    fn lookup(&self, key: &str) -> Option<&Tenant> {
        self.keys.get(&digest(key)).map(|&i| &self.tenants[i].0)
    }

    fn limits(&self) -> Vec<(Arc<str>, TenantLimits)> {
        self.tenants
            .iter()
            .map(|(t, l)| (t.name.clone(), *l))
            .collect()
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The admin key's digest, once it is checked as tenant keys are.
fn admin_digest(key: &str) -> Result<[u8; 32], AccessError> {
    check_key(key).map_err(AccessError::Admin)?;
    if key.len() < 16 {
        tracing::warn!("an admin key shorter than 16 characters is easy to guess");
    }
    Ok(digest(key))
}

/// The file's identity for change detection: modification time and length.
type FileStamp = (Option<SystemTime>, u64);

/// The live key table of an [`crate::http::HttpState`].
pub(crate) struct Access {
    pub(crate) config: AccessConfig,
    table: RwLock<Arc<KeyTable>>,
    /// The admin key's digest.
    admin: Option<[u8; 32]>,
    /// The stamp of the file last read (loaded or refused), and the last reload error (so
    /// that a file that stays broken is reported once, not every poll).
    seen: Mutex<(Option<FileStamp>, Option<String>)>,
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let table = self.table.read();
        f.debug_struct("Access")
            .field("config", &self.config)
            .field("tenants", &table.tenants.len())
            .field("keys", &table.keys.len())
            .finish()
    }
}

impl Access {
    /// Loads the table `config` describes (the file once).
    pub(crate) fn load(config: &AccessConfig) -> Result<Access, AccessError> {
        let stamp = match &config.api_keys_file {
            Some(path) => Some(stamp(path).map_err(|source| AccessError::Read {
                path: path.clone(),
                source,
            })?),
            None => None,
        };
        let table = build_table(config)?;
        log_loaded(config, &table, "API keys loaded");
        let admin = config.admin_key.as_deref().map(admin_digest).transpose()?;
        if admin.is_some_and(|d| table.keys.contains_key(&d)) {
            return Err(AccessError::Admin(
                "the admin key is also a tenant's API key".into(),
            ));
        }
        Ok(Access {
            config: config.clone(),
            table: RwLock::new(Arc::new(table)),
            admin,
            seen: Mutex::new((stamp, None)),
        })
    }

    pub(crate) fn keys_required(&self) -> bool {
        self.config.keys_required()
    }

    /// Every named tenant's limits (for [`crate::http::Backend::set_tenants`]).
    pub(crate) fn tenant_limits(&self) -> Vec<(Arc<str>, TenantLimits)> {
        self.table.read().limits()
    }

    /// The tenant of a request with `headers`; a 401 when keys are configured and the
    /// request has none or an unknown one, a 400 for an unusable `x-tandem-tenant`.
    pub(crate) fn authenticate(&self, headers: &HeaderMap) -> Result<Option<Tenant>, ServeError> {
        if !self.keys_required() {
            return gateway_tenant(headers);
        }
        let Some(key) = presented_key(headers) else {
            return Err(ServeError::unauthorized(
                "You didn't provide an API key. Send it as `Authorization: Bearer <key>` \
                 (or `x-api-key: <key>`).",
            ));
        };
        let table = self.table.read().clone();
        match key.and_then(|k| table.lookup(k)) {
            Some(t) => Ok(Some(t.clone())),
            None => Err(ServeError::unauthorized(
                "Incorrect API key provided. Send a valid key as `Authorization: Bearer <key>` \
                 (or `x-api-key: <key>`).",
            )),
        }
    }

    /// A 401 unless keys are not configured or the request has a known one (the tenant is
    /// not needed: `GET /v1/models`).
    pub(crate) fn require_key(&self, headers: &HeaderMap) -> Result<(), ServeError> {
        if self.keys_required() {
            self.authenticate(headers)?;
        }
        Ok(())
    }

    /// Whether a request may see an operator's surface on `listener` (module docs): a 404
    /// on the public listener without an admin key, a 401 without the right one.
    pub(crate) fn authorize_admin(
        &self,
        headers: &HeaderMap,
        listener: Listener,
        path: &str,
    ) -> Result<(), ServeError> {
        let Some(want) = &self.admin else {
            return match listener {
                Listener::Admin => Ok(()),
                Listener::Public => Err(ServeError::not_found(path)),
            };
        };
        match presented_key(headers) {
            Some(Some(key)) if digest(key) == *want => Ok(()),
            Some(_) => Err(ServeError::unauthorized(
                "Incorrect admin key provided for this operator's surface.",
            )),
            None => Err(ServeError::unauthorized(
                "This is an operator's surface: send the admin key as \
                 `Authorization: Bearer <key>`.",
            )),
        }
    }

    /// Reads the keys file again if it changed since it was last read. `Some(Ok)` when a new
    /// table is in force, `Some(Err)` when the file changed and was refused (the old table
    /// stays), None when nothing changed (or there is no file).
    pub(crate) fn reload_if_changed(&self) -> Option<Result<(), AccessError>> {
        let path = self.config.api_keys_file.as_ref()?;
        let now = match stamp(path) {
            Ok(s) => s,
            Err(source) => {
                let e = AccessError::Read {
                    path: path.clone(),
                    source,
                };
                return self.refused(None, e);
            }
        };
        if self.seen.lock().0 == Some(now) {
            return None;
        }
        match build_table(&self.config) {
            Ok(table) => {
                log_loaded(&self.config, &table, "API keys reloaded");
                *self.table.write() = Arc::new(table);
                *self.seen.lock() = (Some(now), None);
                Some(Ok(()))
            }
            Err(e) => self.refused(Some(now), e),
        }
    }

    /// Records a refused reload; reports it unless it is the same error as last time.
    fn refused(&self, stamp: Option<FileStamp>, e: AccessError) -> Option<Result<(), AccessError>> {
        let message = e.to_string();
        let mut seen = self.seen.lock();
        if stamp.is_some() {
            seen.0 = stamp;
        }
        if seen.1.as_deref() == Some(message.as_str()) {
            return None;
        }
        seen.1 = Some(message);
        Some(Err(e))
    }
}

fn stamp(path: &Path) -> std::io::Result<FileStamp> {
    let meta = std::fs::metadata(path)?;
    Ok((meta.modified().ok(), meta.len()))
}

fn log_loaded(config: &AccessConfig, table: &KeyTable, what: &str) {
    if config.keys_required() {
        tracing::info!(
            tenants = table.tenants.len(),
            keys = table.keys.len(),
            file = ?config.api_keys_file,
            "{what}"
        );
    }
}

/// The key a request presents: None when it sends none; `Some(None)` when the header is
/// there but unreadable (not visible ASCII).
fn presented_key(headers: &HeaderMap) -> Option<Option<&str>> {
    for value in headers.get_all(header::AUTHORIZATION) {
        let Ok(text) = value.to_str() else {
            return Some(None);
        };
        let text = text.trim();
        // The scheme is case-insensitive (RFC 9110 §11.1); other schemes are not ours.
        if let Some((scheme, key)) = text.split_once(' ')
            && scheme.eq_ignore_ascii_case("bearer")
        {
            return Some(Some(key.trim()));
        }
    }
    let value = headers.get("x-api-key")?;
    Some(value.to_str().ok().map(str::trim))
}

const TENANT_HEADER: &str = "x-tandem-tenant";

/// The tenant a gateway named (no keys configured).
fn gateway_tenant(headers: &HeaderMap) -> Result<Option<Tenant>, ServeError> {
    let Some(value) = headers.get(TENANT_HEADER) else {
        return Ok(None);
    };
    let name = value.to_str().map(str::trim).unwrap_or("\u{0}");
    check_tenant_name(name).map_err(|why| {
        ServeError::invalid(format!("{TENANT_HEADER}: {why}")).with_param(TENANT_HEADER)
    })?;
    let name: Arc<str> = Arc::from(name);
    Ok(Some(Tenant {
        salt: name.clone(),
        name,
    }))
}

fn check_tenant_name(name: &str) -> Result<(), String> {
    let ok = |c: char| c.is_ascii_alphanumeric() || "-_.:@/".contains(c);
    if name.is_empty() || name.len() > 128 || !name.chars().all(ok) {
        return Err(format!(
            "tenant name {name:?} must be 1-128 characters of A-Z a-z 0-9 - _ . : @ /"
        ));
    }
    Ok(())
}

fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() {
        return Err("an empty key".to_string());
    }
    if key.len() > 1024 || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(
            "a key must be at most 1024 visible ASCII characters, without spaces".to_string(),
        );
    }
    Ok(())
}

/// The file's shape (module docs).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeysFile {
    #[serde(deserialize_with = "unique_entries")]
    tenants: Vec<(String, TenantEntry)>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantEntry {
    keys: Vec<String>,
    #[serde(default)]
    cache_salt: Option<String>,
    #[serde(default)]
    requests_per_minute: Option<u64>,
    #[serde(default)]
    tokens_per_minute: Option<u64>,
    #[serde(default = "one")]
    weight: f64,
}

fn one() -> f64 {
    1.0
}

/// A JSON object as its entries in order, refusing a name given twice (serde's maps keep
/// the last silently).
fn unique_entries<'de, D>(d: D) -> Result<Vec<(String, TenantEntry)>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    struct Entries;
    impl<'de> serde::de::Visitor<'de> for Entries {
        type Value = Vec<(String, TenantEntry)>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("an object of tenants")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(
            self,
            mut map: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out: Vec<(String, TenantEntry)> = Vec::new();
            while let Some((name, entry)) = map.next_entry::<String, TenantEntry>()? {
                if out.iter().any(|(n, _)| *n == name) {
                    return Err(serde::de::Error::custom(format!(
                        "tenant {name:?} is named twice"
                    )));
                }
                out.push((name, entry));
            }
            Ok(out)
        }
    }
    d.deserialize_map(Entries)
}

/// Builds the table from the file (read now) and the inline keys.
fn build_table(config: &AccessConfig) -> Result<KeyTable, AccessError> {
    let mut table = KeyTable::default();
    if let Some(path) = &config.api_keys_file {
        let text = std::fs::read_to_string(path).map_err(|source| AccessError::Read {
            path: path.clone(),
            source,
        })?;
        let parse = |message: String| AccessError::Parse {
            path: path.clone(),
            message,
        };
        let file: KeysFile = serde_json::from_str(&text).map_err(|e| parse(e.to_string()))?;
        for (name, entry) in file.tenants {
            add_tenant(&mut table, name, entry).map_err(parse)?;
        }
    }
    for (key, tenant) in &config.api_keys {
        check_tenant_name(tenant).map_err(AccessError::Inline)?;
        let index = match table.tenants.iter().position(|(t, _)| *t.name == **tenant) {
            Some(i) => i,
            None => {
                let name: Arc<str> = Arc::from(tenant.as_str());
                let t = Tenant {
                    salt: name.clone(),
                    name,
                };
                table.tenants.push((t, TenantLimits::default()));
                table.tenants.len() - 1
            }
        };
        add_key(&mut table, key, index).map_err(AccessError::Inline)?;
    }
    Ok(table)
}

fn add_tenant(table: &mut KeyTable, name: String, entry: TenantEntry) -> Result<(), String> {
    check_tenant_name(&name)?;
    if entry.keys.is_empty() {
        return Err(format!("tenant {name:?} has no keys"));
    }
    let salt = match entry.cache_salt {
        Some(s) => {
            if s.is_empty() || s.len() > 256 || s.chars().any(char::is_control) {
                return Err(format!(
                    "tenant {name:?}: cache_salt must be 1-256 bytes without control characters"
                ));
            }
            Arc::from(s)
        }
        None => Arc::from(name.as_str()),
    };
    let limits = TenantLimits {
        requests_per_minute: entry.requests_per_minute,
        tokens_per_minute: entry.tokens_per_minute,
        weight: entry.weight,
    };
    limits
        .validate()
        .map_err(|e| format!("tenant {name:?}: {e}"))?;
    let index = table.tenants.len();
    table.tenants.push((
        Tenant {
            name: Arc::from(name.as_str()),
            salt,
        },
        limits,
    ));
    for key in &entry.keys {
        add_key(table, key, index).map_err(|e| format!("tenant {name:?}: {e}"))?;
    }
    Ok(())
}

fn add_key(table: &mut KeyTable, key: &str, tenant: usize) -> Result<(), String> {
    check_key(key)?;
    match table.keys.insert(digest(key), tenant) {
        None => {}
        Some(other) => {
            let other = &table.tenants[other].0.name;
            return Err(format!(
                "a key of tenant {:?} is already a key of {other:?} (keys must be unique)",
                table.tenants[tenant].0.name
            ));
        }
    }
    if key.len() < 16 {
        tracing::warn!(
            tenant = %table.tenants[tenant].0.name,
            "an API key shorter than 16 characters is easy to guess"
        );
    }
    Ok(())
}
