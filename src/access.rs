//! The frontend's access flags: API keys (tenants) and TLS on its HTTP listener. They become
//! [`AccessConfig`] and [`TlsConfig`] in the frontend's [`HttpConfig`]
//! (`tandem_frontend::http::auth` documents the keys file and the modes).
//!
//! [`HttpConfig`]: tandem_frontend::http::HttpConfig

use std::path::PathBuf;

use clap::Args;
use tandem_frontend::http::{AccessConfig, TlsConfig};

/// Who may use the frontend, and TLS on its listener.
#[derive(Args, Clone, Default)]
pub struct AccessArgs {
    /// A JSON file of tenants and their API keys (and cache salts and limits), reloaded when
    /// it changes. With it (or --api-keys), requests need a key.
    #[arg(long, env = "TANDEM_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// API keys as key=tenant pairs, comma-separated (the last `=` splits them). With them
    /// (or --api-keys-file), requests need a key.
    #[arg(
        long,
        env = "TANDEM_API_KEYS",
        hide_env_values = true,
        value_delimiter = ','
    )]
    pub api_keys: Vec<String>,
    /// The key that opens the status page, /status.json and /metrics (on the admin listener,
    /// and on the public one where a scraper must reach them from elsewhere). Unset: the
    /// admin listener serves them to whoever reaches it, the public one not at all.
    #[arg(long, env = "TANDEM_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Where the status page, /status.json and /metrics are served (`off`: nowhere but to
    /// --admin-key on the public port). Default: 127.0.0.1, the public port + 1.
    #[arg(long, env = "TANDEM_ADMIN_LISTEN")]
    pub admin_listen: Option<String>,
    /// PEM certificate chain: the HTTP listener speaks TLS (needs --tls-key).
    #[arg(long, env = "TANDEM_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "TANDEM_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
}

impl std::fmt::Debug for AccessArgs {
    /// Keys are secrets: not shown.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessArgs")
            .field("api_keys_file", &self.api_keys_file)
            .field(
                "api_keys",
                &format_args!("[{} hidden]", self.api_keys.len()),
            )
            .field("admin_key", &self.admin_key.as_ref().map(|_| "(hidden)"))
            .field("admin_listen", &self.admin_listen)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .finish()
    }
}

impl AccessArgs {
    /// The API keys these flags name. (Parsed here rather than by clap, whose errors would
    /// print the secret.)
    pub fn access(&self) -> anyhow::Result<AccessConfig> {
        let api_keys = self
            .api_keys
            .iter()
            .enumerate()
            .map(|(i, pair)| {
                key_tenant(pair).ok_or_else(|| {
                    anyhow::anyhow!(
                        "--api-keys (TANDEM_API_KEYS): pair {} is not key=tenant (pairs are \
                         comma-separated)",
                        i + 1
                    )
                })
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(AccessConfig {
            api_keys_file: self.api_keys_file.clone(),
            api_keys,
            admin_key: self.admin_key.clone(),
            ..Default::default()
        })
    }

    /// The listener's TLS: both files or neither.
    pub fn tls(&self) -> anyhow::Result<Option<TlsConfig>> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(TlsConfig {
                cert: cert.clone(),
                key: key.clone(),
            })),
            (None, None) => Ok(None),
            (Some(_), None) => anyhow::bail!("--tls-cert needs --tls-key (TANDEM_TLS_KEY)"),
            (None, Some(_)) => anyhow::bail!("--tls-key needs --tls-cert (TANDEM_TLS_CERT)"),
        }
    }

    /// Puts these flags into a frontend's HTTP config.
    pub fn apply(&self, http: &mut tandem_frontend::http::HttpConfig) -> anyhow::Result<()> {
        http.access = self.access()?;
        http.tls = self.tls()?;
        Ok(())
    }
}

/// `key=tenant`; split at the last `=` (keys may end in base64 padding).
fn key_tenant(s: &str) -> Option<(String, String)> {
    match s.trim().rsplit_once('=') {
        Some((key, tenant)) if !key.is_empty() && !tenant.is_empty() => {
            Some((key.to_string(), tenant.to_string()))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        access: AccessArgs,
    }

    #[test]
    fn keys_and_tls_flags() {
        let cli = Cli::try_parse_from(["t", "--api-keys", "sk-a==b=acme,sk-2=beta"]).unwrap();
        assert_eq!(
            cli.access.access().unwrap().api_keys,
            [
                ("sk-a==b".into(), "acme".into()),
                ("sk-2".into(), "beta".into())
            ]
        );
        assert!(!format!("{:?}", cli.access).contains("sk-a"));
        for bad in ["sk-secret", "sk-secret="] {
            let cli = Cli::try_parse_from(["t", "--api-keys", bad]).unwrap();
            let e = cli.access.access().unwrap_err().to_string();
            assert!(e.contains("pair 1") && !e.contains("secret"), "{e}");
        }
        let cli = Cli::try_parse_from(["t", "--tls-cert", "c.pem"]).unwrap();
        assert!(
            cli.access
                .tls()
                .unwrap_err()
                .to_string()
                .contains("--tls-key")
        );
        let cli = Cli::try_parse_from(["t", "--tls-cert", "c.pem", "--tls-key", "k.pem"]).unwrap();
        assert_eq!(
            cli.access.tls().unwrap().unwrap().key,
            PathBuf::from("k.pem")
        );
        let none = Cli::try_parse_from(["t"]).unwrap().access.access().unwrap();
        assert!(!none.keys_required());
    }
}
