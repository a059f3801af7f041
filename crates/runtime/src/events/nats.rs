//! The event plane on core NATS (no JetStream: nats-server 2.9 lacks what async-nats' KV wants,
//! and fire-and-forget is all the plane promises).
//!
//! The client reconnects on its own forever (delay doubling from 50 ms up to
//! [`NatsConfig::max_reconnect_delay`]) and re-subscribes every live [`Subscription`] after a
//! reconnect; disconnects, reconnects and slow-consumer drops are logged. Buffers are bounded:
//! [`NatsConfig::client_capacity`] outgoing commands (they wait there while disconnected and go
//! out after the reconnect) and [`NatsConfig::subscription_capacity`] messages per subscription
//! (beyond it NATS drops, as for any slow consumer). A publish that cannot enter the full buffer
//! fails after [`NatsConfig::publish_timeout`] instead of blocking.

use std::path::PathBuf;
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event};
use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;

use super::{EventPlane, Subscription, validate_subject};
use crate::error::{RuntimeError, with_timeout};

/// How to authenticate to NATS.
#[derive(Clone, Default)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// `--user` / `--pass` style.
    UserPassword { user: String, password: String },
    /// `--auth` token.
    Token(String),
    /// A `.creds` file (JWT + nkey seed).
    CredsFile(PathBuf),
}

impl NatsAuth {
    /// The one way of authenticating that a set of optional settings names (the frontend's and
    /// workers' `--nats-*` flags): a user with a password, a token, a credentials file, or
    /// none; anything else (a user without a password, two ways at once) is refused.
    pub fn from_parts(
        user: Option<String>,
        password: Option<String>,
        token: Option<String>,
        creds: Option<PathBuf>,
    ) -> Result<NatsAuth, RuntimeError> {
        Ok(match (user, password, token, creds) {
            (Some(user), Some(password), None, None) => NatsAuth::UserPassword { user, password },
            (None, None, Some(token), None) => NatsAuth::Token(token),
            (None, None, None, Some(path)) => NatsAuth::CredsFile(path),
            (None, None, None, None) => NatsAuth::None,
            _ => {
                return Err(RuntimeError::Config(
                    "NATS auth: give a user with a password, or a token, or a credentials \
                     file (one of them)"
                        .into(),
                ));
            }
        })
    }
}

impl std::fmt::Debug for NatsAuth {
    // Secrets stay out of logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::UserPassword { user, .. } => f
                .debug_struct("UserPassword")
                .field("user", user)
                .field("password", &"<redacted>")
                .finish(),
            NatsAuth::Token(_) => f.write_str("Token(<redacted>)"),
            NatsAuth::CredsFile(path) => f.debug_tuple("CredsFile").field(path).finish(),
        }
    }
}

/// How to reach NATS.
#[derive(Clone, Debug)]
pub struct NatsConfig {
    /// Server URL, e.g. `nats://127.0.0.1:4222`.
    pub url: String,
    pub auth: NatsAuth,
    /// Client name shown by the server (`connz`).
    pub name: Option<String>,
    /// Deadline for the first connection (and for each reconnect attempt).
    pub connect_timeout: Duration,
    /// Longest a publish waits for room in the outgoing buffer.
    pub publish_timeout: Duration,
    /// Outgoing command buffer, in commands.
    pub client_capacity: usize,
    /// Per-subscription message buffer, in messages.
    pub subscription_capacity: usize,
    /// Largest delay between reconnect attempts.
    pub max_reconnect_delay: Duration,
    /// How often the client pings the server (detects dead connections).
    pub ping_interval: Duration,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            auth: NatsAuth::None,
            name: None,
            connect_timeout: Duration::from_secs(5),
            publish_timeout: Duration::from_secs(1),
            client_capacity: 2048,
            subscription_capacity: 8192,
            max_reconnect_delay: Duration::from_secs(2),
            ping_interval: Duration::from_secs(10),
        }
    }
}

/// The event plane on NATS. Cheap to clone (clones share the connection).
#[derive(Clone, Debug)]
pub struct NatsEventPlane {
    client: Client,
    publish_timeout: Duration,
    flush_timeout: Duration,
}

impl NatsEventPlane {
    /// Connects; fails if the server cannot be reached now. After that, reconnects forever.
    pub async fn connect(config: NatsConfig) -> Result<Self, RuntimeError> {
        if config.client_capacity == 0 || config.subscription_capacity == 0 {
            return Err(RuntimeError::Config(
                "nats: buffer capacities must be positive".into(),
            ));
        }
        let mut options = match &config.auth {
            NatsAuth::None => ConnectOptions::new(),
            NatsAuth::UserPassword { user, password } => {
                ConnectOptions::with_user_and_password(user.clone(), password.clone())
            }
            NatsAuth::Token(token) => ConnectOptions::with_token(token.clone()),
            NatsAuth::CredsFile(path) => ConnectOptions::with_credentials_file(path)
                .await
                .map_err(RuntimeError::io("reading NATS credentials"))?,
        };
        let max_delay = config.max_reconnect_delay;
        let url = config.url.clone();
        options = options
            .connection_timeout(config.connect_timeout)
            .client_capacity(config.client_capacity)
            .subscription_capacity(config.subscription_capacity)
            .ping_interval(config.ping_interval)
            .max_reconnects(None)
            .reconnect_delay_callback(move |attempts| reconnect_delay(attempts, max_delay))
            .event_callback(move |event| {
                let url = url.clone();
                async move { log_event(&url, event) }
            });
        if let Some(name) = &config.name {
            options = options.name(name);
        }
        let client = with_timeout("nats connect", config.connect_timeout, async {
            options
                .connect(config.url.as_str())
                .await
                .map_err(RuntimeError::nats("connect"))
        })
        .await?;
        tracing::info!(url = %config.url, "connected to NATS");
        Ok(NatsEventPlane {
            client,
            publish_timeout: config.publish_timeout,
            flush_timeout: config.connect_timeout,
        })
    }

    /// The underlying client, for what the trait does not cover.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Waits until everything published so far has left this client's buffers.
    pub async fn flush(&self) -> Result<(), RuntimeError> {
        with_timeout("nats flush", self.flush_timeout, async {
            self.client
                .flush()
                .await
                .map_err(RuntimeError::nats("flush"))
        })
        .await
    }

    /// Waits until the server has processed everything this client sent so far (its
    /// subscriptions included): publishes to a fresh inbox this client subscribes to and waits
    /// for the message to come back. The server handles one connection's commands in order, so
    /// the echo proves the earlier ones are in effect. ([`NatsEventPlane::flush`] only empties
    /// the local buffer; async-nats has no PING round trip of its own.)
    pub async fn round_trip(&self) -> Result<(), RuntimeError> {
        with_timeout("nats round trip", self.flush_timeout, async {
            let inbox = self.client.new_inbox();
            let mut echo = self
                .client
                .subscribe(inbox.clone())
                .await
                .map_err(RuntimeError::nats("subscribe"))?;
            self.client
                .publish(inbox, Bytes::new())
                .await
                .map_err(RuntimeError::nats("publish"))?;
            echo.next()
                .await
                .map(|_| ())
                .ok_or(RuntimeError::Closed("nats round-trip subscription"))
        })
        .await
    }
}

/// No delay for the first attempt, then 50 ms doubling up to `max`.
fn reconnect_delay(attempts: usize, max: Duration) -> Duration {
    if attempts <= 1 {
        return Duration::ZERO;
    }
    let exponent = u32::try_from(attempts - 2).unwrap_or(u32::MAX).min(16);
    Duration::from_millis(50u64.saturating_mul(1u64 << exponent)).min(max)
}

fn log_event(url: &str, event: Event) {
    match event {
        Event::Connected => tracing::info!(%url, "NATS (re)connected"),
        Event::Disconnected => tracing::warn!(%url, "NATS disconnected; reconnecting"),
        Event::SlowConsumer(sid) => {
            tracing::warn!(%url, sid, "NATS slow consumer: messages dropped")
        }
        // Repeated for every failed reconnect attempt: the disconnect was logged already.
        Event::ClientError(error) => tracing::debug!(%url, %error, "NATS client error"),
        Event::Closed => tracing::info!(%url, "NATS connection closed"),
        other => tracing::warn!(%url, event = %other, "NATS event"),
    }
}

#[async_trait]
impl EventPlane for NatsEventPlane {
    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), RuntimeError> {
        validate_subject(subject, false)?;
        with_timeout("nats publish", self.publish_timeout, async {
            self.client
                .publish(subject.to_string(), payload)
                .await
                .map_err(RuntimeError::nats("publish"))
        })
        .await
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, RuntimeError> {
        validate_subject(subject, true)?;
        let subscriber = with_timeout("nats subscribe", self.publish_timeout, async {
            self.client
                .subscribe(subject.to_string())
                .await
                .map_err(RuntimeError::nats("subscribe"))
        })
        .await?;
        // The server knows the subscription before we return, so a message published right
        // after (from any connection) is delivered. If we are disconnected now, the client
        // subscribes again once it reconnects: the subscription is still good.
        if let Err(error) = self.round_trip().await {
            tracing::debug!(%subject, %error, "round trip after subscribe failed");
        }
        let stream = subscriber.map(|message| message.payload);
        Ok(Subscription::new(subject, stream.boxed()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delay_grows_and_is_capped() {
        let max = Duration::from_secs(2);
        assert_eq!(reconnect_delay(0, max), Duration::ZERO);
        assert_eq!(reconnect_delay(1, max), Duration::ZERO);
        assert_eq!(reconnect_delay(2, max), Duration::from_millis(50));
        assert_eq!(reconnect_delay(3, max), Duration::from_millis(100));
        assert_eq!(reconnect_delay(10, max), max);
        assert_eq!(reconnect_delay(usize::MAX, max), max);
    }

    #[test]
    fn auth_debug_hides_secrets() {
        let auth = NatsAuth::UserPassword {
            user: "u".into(),
            password: "hunter2".into(),
        };
        assert!(!format!("{auth:?}").contains("hunter2"));
        assert!(!format!("{:?}", NatsAuth::Token("tok".into())).contains("tok"));
    }

    #[tokio::test]
    async fn connect_to_nothing_fails_with_unavailable() {
        // A port nobody listens on: bind, read, release.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let config = NatsConfig {
            url: format!("nats://127.0.0.1:{port}"),
            connect_timeout: Duration::from_secs(2),
            ..NatsConfig::default()
        };
        let err = NatsEventPlane::connect(config)
            .await
            .expect_err("nothing listens");
        assert_eq!(err.class(), crate::ErrorClass::Unavailable);
    }
}
