//! The event plane against a real nats-server started by `external::NatsServer`.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use bytes::Bytes;
use tandem_runtime::events::subjects;
use tandem_runtime::{
    EventPlane, NatsAuth, NatsConfig, NatsEventPlane, NatsOptions, NatsServer, RuntimeError,
};
use tokio::time::Instant;

/// Logs go to the test's captured output (shown when a test fails).
fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("info,tandem_runtime=debug")
        .with_test_writer()
        .try_init();
}

fn config(server: &NatsServer) -> NatsConfig {
    NatsConfig {
        url: server.url(),
        name: Some("tandem-runtime-test".into()),
        connect_timeout: Duration::from_secs(2),
        // Also the bound on the round trip after a subscribe: on a loaded machine 300 ms could
        // pass before the server knows the subscription, and a message right after is lost.
        publish_timeout: Duration::from_secs(1),
        max_reconnect_delay: Duration::from_millis(250),
        ..NatsConfig::default()
    }
}

#[tokio::test]
async fn publish_subscribe_roundtrip() -> Result<()> {
    logs();
    let server = NatsServer::start(NatsOptions::default()).await?;
    let publisher = NatsEventPlane::connect(config(&server)).await?;
    let subscriber = NatsEventPlane::connect(config(&server)).await?;
    let subject = subjects::kv_events("it");
    let mut sub = subscriber.subscribe(&subject).await?;
    let mut other = subscriber.subscribe(&subjects::load_reports("it")).await?;
    publisher
        .publish(&subject, Bytes::from_static(b"hello"))
        .await?;
    let got = tokio::time::timeout(Duration::from_secs(5), sub.next())
        .await
        .context("message in time")?
        .context("subscription open")?;
    assert_eq!(got, Bytes::from_static(b"hello"));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), other.next())
            .await
            .is_err(),
        "other subjects stay quiet"
    );
    Ok(())
}

#[tokio::test]
async fn subscription_survives_a_server_restart() -> Result<()> {
    logs();
    let mut server = NatsServer::start(NatsOptions::default()).await?;
    let plane = NatsEventPlane::connect(config(&server)).await?;
    let subject = subjects::router_sync("it");
    let mut sub = plane.subscribe(&subject).await?;
    plane
        .publish(&subject, Bytes::from_static(b"before"))
        .await?;
    let first = tokio::time::timeout(Duration::from_secs(5), sub.next()).await?;
    assert_eq!(first, Some(Bytes::from_static(b"before")));

    server.restart().await?;

    // Keep publishing until one published after the restart comes through (the client needs a
    // moment to notice, reconnect and re-subscribe). Publishes may fail meanwhile.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = 0u32;
    loop {
        if Instant::now() > deadline {
            bail!("no message after the restart within 10 s ({n} published)");
        }
        n += 1;
        let _ = plane
            .publish(&subject, Bytes::from(format!("after-{n}")))
            .await;
        if let Ok(Some(got)) = tokio::time::timeout(Duration::from_millis(200), sub.next()).await
            && got.starts_with(b"after-")
        {
            break;
        }
    }
    Ok(())
}

#[tokio::test]
async fn publishing_while_disconnected_is_bounded() -> Result<()> {
    logs();
    let mut server = NatsServer::start(NatsOptions::default()).await?;
    let plane = NatsEventPlane::connect(NatsConfig {
        client_capacity: 4,
        ..config(&server)
    })
    .await?;
    server.stop();
    let mut errors = 0;
    for i in 0..16u32 {
        let started = Instant::now();
        let result = tokio::time::timeout(
            Duration::from_secs(5),
            plane.publish("tandem.it.load", Bytes::from(i.to_be_bytes().to_vec())),
        )
        .await
        .context("publish returned")?;
        assert!(started.elapsed() < Duration::from_secs(5));
        if let Err(e) = result {
            assert_eq!(e.class(), tandem_runtime::ErrorClass::Unavailable, "{e}");
            errors += 1;
        }
    }
    assert!(errors > 0, "a full buffer turns into errors, not a hang");
    Ok(())
}

#[tokio::test]
async fn token_auth_is_used() -> Result<()> {
    logs();
    let server = NatsServer::start(NatsOptions {
        extra_args: vec!["--auth".into(), "s3cret".into()],
        ..NatsOptions::default()
    })
    .await?;
    let denied = NatsEventPlane::connect(config(&server)).await;
    assert!(denied.is_err(), "no token, no connection");
    let plane = NatsEventPlane::connect(NatsConfig {
        auth: NatsAuth::Token("s3cret".into()),
        ..config(&server)
    })
    .await?;
    let mut sub = plane.subscribe("tandem.it.kv-events").await?;
    plane
        .publish("tandem.it.kv-events", Bytes::from_static(b"x"))
        .await?;
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(5), sub.next()).await?,
        Some(Bytes::from_static(b"x"))
    );
    Ok(())
}

#[tokio::test]
async fn missing_nats_binary_is_a_typed_error() {
    logs();
    let options = NatsOptions {
        binary: "tandem-no-such-nats-server".into(),
        ..NatsOptions::default()
    };
    match NatsServer::start(options).await {
        Err(RuntimeError::MissingBinary { package, .. }) => assert_eq!(package, "nats-server"),
        other => panic!("expected MissingBinary, got {other:?}"),
    }
}
