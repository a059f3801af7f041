//! Discovery against a real etcd started by `external::EtcdServer` (short TTLs to stay fast).
//!
//! Waits are bounded by generous timeouts and look for a state to be reached, never for an
//! exact timing, so a loaded machine slows these tests down without failing them.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use tandem_protocol::{
    BlockSize, TierCapacity, WorkerAddresses, WorkerId, WorkerRecord, WorkerRole,
};
use tandem_runtime::discovery::WorkerView;
use tandem_runtime::{
    Discovery, DiscoveryEvent, DiscoveryWatch, EtcdConfig, EtcdDiscovery, EtcdOptions, EtcdServer,
    RuntimeError,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

const TTL: Duration = Duration::from_secs(2);

/// Logs go to the test's captured output (shown when a test fails).
fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter("info,tandem_runtime=debug")
        .with_test_writer()
        .try_init();
}

fn record(id: u64, role: WorkerRole) -> WorkerRecord {
    WorkerRecord {
        id: WorkerId(id),
        role,
        model: "test-model".into(),
        block_size: BlockSize::new(16).expect("valid block size"),
        kv_capacity: TierCapacity {
            device_blocks: 64,
            host_blocks: 0,
            disk_blocks: 0,
        },
        addresses: WorkerAddresses {
            grpc: format!("127.0.0.1:{}", 7000 + id),
            kv_transfer: None,
            metrics: None,
            http: None,
        },
        kv_events: true,
        placement: Default::default(),
        takes_text: false,
    }
}

fn config(server: &EtcdServer, ttl: Duration) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![server.endpoint()],
        namespace: "it".into(),
        lease_ttl: ttl,
        connect_timeout: Duration::from_secs(2),
        max_backoff: Duration::from_millis(500),
        ..EtcdConfig::default()
    }
}

async fn next_event(watch: &mut DiscoveryWatch, within: Duration) -> Result<DiscoveryEvent> {
    tokio::time::timeout(within, watch.next())
        .await
        .context("no discovery event in time")?
        .context("watch ended")
}

/// Folds events into `view` until `done(view)` holds; returns the events seen.
async fn wait_for(
    watch: &mut DiscoveryWatch,
    view: &mut WorkerView,
    within: Duration,
    done: impl Fn(&WorkerView) -> bool,
) -> Result<Vec<DiscoveryEvent>> {
    let deadline = Instant::now() + within;
    let mut seen = Vec::new();
    while !done(view) {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = next_event(watch, left).await.with_context(|| {
            format!(
                "waiting for state; view {:?}, seen {seen:?}",
                view.records()
            )
        })?;
        view.apply(&event);
        seen.push(event);
    }
    Ok(seen)
}

async fn raw_client(server: &EtcdServer) -> Result<etcd_client::Client> {
    Ok(etcd_client::Client::connect([server.endpoint()], None).await?)
}

#[tokio::test]
async fn register_watch_expire_and_deregister() -> Result<()> {
    logs();
    let server = EtcdServer::start(EtcdOptions::default()).await?;
    let discovery = EtcdDiscovery::connect(config(&server, TTL)).await?;
    let mut watch = discovery.watch(&CancellationToken::new()).await?;

    let a = record(1, WorkerRole::Decode);
    let reg_a = discovery.register(a.clone()).await?;
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await?,
        DiscoveryEvent::Added(a.clone())
    );
    assert_eq!(discovery.list().await?, vec![a.clone()]);

    // Operators can read the record with etcdctl: plain JSON under the documented key.
    let mut raw = raw_client(&server).await?;
    let got = raw
        .get("/tandem/it/workers/decode/0000000000000001", None)
        .await?;
    let kv = got.kvs().first().context("key present")?;
    assert_eq!(serde_json::from_slice::<WorkerRecord>(kv.value())?, a);
    assert_ne!(kv.lease(), 0, "key is attached to a lease");

    // A record update reaches watchers.
    let mut a2 = a.clone();
    a2.kv_capacity.device_blocks = 128;
    reg_a.update(a2.clone())?;
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await?,
        DiscoveryEvent::Added(a2)
    );

    // Dropped without deregistering: the lease lapses and watchers learn it.
    let dropped_at = Instant::now();
    drop(reg_a);
    assert_eq!(
        next_event(&mut watch, TTL * 5).await?,
        DiscoveryEvent::Removed {
            id: WorkerId(1),
            role: WorkerRole::Decode
        }
    );
    assert!(
        dropped_at.elapsed() >= TTL / 2,
        "removal came from lease expiry"
    );

    // Deregistered: removed at once, long before a (10 s) lease would lapse.
    let long = EtcdDiscovery::connect(config(&server, Duration::from_secs(10))).await?;
    let b = record(2, WorkerRole::Prefill);
    let reg_b = long.register(b.clone()).await?;
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await?,
        DiscoveryEvent::Added(b)
    );
    reg_b.deregister().await;
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await?,
        DiscoveryEvent::Removed {
            id: WorkerId(2),
            role: WorkerRole::Prefill
        }
    );
    assert!(discovery.list().await?.is_empty());
    Ok(())
}

#[tokio::test]
async fn watch_starts_with_the_present_workers() -> Result<()> {
    logs();
    let server = EtcdServer::start(EtcdOptions::default()).await?;
    let discovery = EtcdDiscovery::connect(config(&server, TTL)).await?;
    let a = record(1, WorkerRole::Prefill);
    let b = record(2, WorkerRole::Aggregated);
    let _ra = discovery.register(a.clone()).await?;
    let _rb = discovery.register(b.clone()).await?;
    let mut watch = discovery.watch(&CancellationToken::new()).await?;
    let mut first = vec![
        next_event(&mut watch, Duration::from_secs(5)).await?,
        next_event(&mut watch, Duration::from_secs(5)).await?,
    ];
    first.sort_by_key(|e| match e {
        DiscoveryEvent::Added(r) => r.id,
        DiscoveryEvent::Removed { id, .. } => *id,
    });
    assert_eq!(
        first,
        vec![DiscoveryEvent::Added(a), DiscoveryEvent::Added(b)]
    );
    Ok(())
}

#[tokio::test]
async fn wiped_etcd_restart_reregisters_and_the_watch_resyncs() -> Result<()> {
    logs();
    let mut server = EtcdServer::start(EtcdOptions::default()).await?;
    let discovery = EtcdDiscovery::connect(config(&server, TTL)).await?;
    let a = record(1, WorkerRole::Decode);
    let _reg = discovery.register(a.clone()).await?;
    // A worker whose key no registration maintains: after the wipe nobody brings it back, so
    // the watch must report its removal from the resync.
    let stray = record(9, WorkerRole::Prefill);
    let mut raw = raw_client(&server).await?;
    raw.put(
        "/tandem/it/workers/prefill/0000000000000009",
        serde_json::to_vec(&stray)?,
        None,
    )
    .await?;
    let mut watch = discovery.watch(&CancellationToken::new()).await?;
    let mut view = WorkerView::new();
    wait_for(&mut watch, &mut view, Duration::from_secs(5), |v| {
        v.len() == 2
    })
    .await?;

    server.restart_fresh().await?;

    // The stray worker goes, ours comes back by itself.
    let seen = wait_for(&mut watch, &mut view, Duration::from_secs(20), |v| {
        v.len() == 1 && v.get(WorkerRole::Decode, WorkerId(1)).is_some()
    })
    .await?;
    assert!(
        seen.contains(&DiscoveryEvent::Removed {
            id: WorkerId(9),
            role: WorkerRole::Prefill
        }),
        "stray removal reported: {seen:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if discovery.list().await.is_ok_and(|l| l == vec![a.clone()]) {
            break;
        }
        if Instant::now() > deadline {
            bail!("worker did not re-register in the wiped etcd");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The new key is on a live lease: it survives well past the TTL.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(discovery.list().await?, vec![a]);
    Ok(())
}

#[tokio::test]
async fn etcd_restart_with_same_data_keeps_the_registration() -> Result<()> {
    logs();
    let mut server = EtcdServer::start(EtcdOptions::default()).await?;
    let discovery = EtcdDiscovery::connect(config(&server, TTL)).await?;
    let a = record(3, WorkerRole::Aggregated);
    let _reg = discovery.register(a.clone()).await?;
    let mut watch = discovery.watch(&CancellationToken::new()).await?;
    let mut view = WorkerView::new();
    wait_for(&mut watch, &mut view, Duration::from_secs(5), |v| {
        v.len() == 1
    })
    .await?;

    server.restart().await?;

    // Still registered after several TTLs: keep-alive resumed (or re-registered) on its own.
    tokio::time::sleep(TTL * 3).await;
    assert_eq!(discovery.list().await?, vec![a.clone()]);
    // The watch followed: whatever it reported, its view ends with the worker present.
    wait_for(&mut watch, &mut view, Duration::from_secs(10), |v| {
        v.records() == vec![a.clone()]
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn connect_fails_cleanly_when_etcd_is_down() -> Result<()> {
    logs();
    let mut server = EtcdServer::start(EtcdOptions::default()).await?;
    let cfg = config(&server, TTL);
    server.stop();
    let err = EtcdDiscovery::connect(cfg).await.expect_err("etcd is down");
    assert_eq!(err.class(), tandem_runtime::ErrorClass::Unavailable);
    Ok(())
}

#[tokio::test]
async fn missing_etcd_binary_is_a_typed_error() {
    logs();
    let options = EtcdOptions {
        binary: "/nonexistent/tandem-test/etcd".into(),
        ..EtcdOptions::default()
    };
    match EtcdServer::start(options).await {
        Err(RuntimeError::MissingBinary { binary, package }) => {
            assert!(binary.ends_with("etcd"));
            assert_eq!(package, "etcd-server");
        }
        other => panic!("expected MissingBinary, got {other:?}"),
    }
    // A bare name that no PATH entry has behaves the same.
    let options = EtcdOptions {
        binary: "tandem-no-such-etcd-binary".into(),
        ..EtcdOptions::default()
    };
    assert!(matches!(
        EtcdServer::start(options).await,
        Err(RuntimeError::MissingBinary { .. })
    ));
}

// ---- Interop: our etcd client (src/discovery/etcd/client.rs) against the independent
// `etcd-client` crate, on the same real etcd (docs/CONVENTIONS.md §13). ----

#[tokio::test]
async fn etcd_client_sees_our_keys_on_our_lease_with_our_ttl() -> Result<()> {
    logs();
    let server = EtcdServer::start(EtcdOptions::default()).await?;
    let discovery = EtcdDiscovery::connect(config(&server, TTL)).await?;
    let a = record(4, WorkerRole::Prefill);
    let reg = discovery.register(a.clone()).await?;
    let key = "/tandem/it/workers/prefill/0000000000000004";

    let mut raw = raw_client(&server).await?;
    let got = raw.get(key, None).await?;
    let kv = got.kvs().first().context("key present")?;
    assert_eq!(serde_json::from_slice::<WorkerRecord>(kv.value())?, a);
    let lease = kv.lease();
    assert_ne!(lease, 0, "key is attached to a lease");
    let ttl = raw.lease_time_to_live(lease, None).await?;
    assert_eq!(ttl.granted_ttl(), 2, "the lease has our TTL");
    assert!(ttl.ttl() <= 2, "remaining TTL {}", ttl.ttl());

    // Past several TTLs the key is still there on the same lease: our keep-alives renew it.
    tokio::time::sleep(TTL * 2).await;
    let got = raw.get(key, None).await?;
    let kv = got.kvs().first().context("key still present")?;
    assert_eq!(kv.lease(), lease);

    // Deregistering deletes the key and revokes the lease (etcd answers TTL -1 for it then).
    reg.deregister().await;
    assert!(raw.get(key, None).await?.kvs().is_empty());
    assert_eq!(raw.lease_time_to_live(lease, None).await?.ttl(), -1);
    Ok(())
}

#[tokio::test]
async fn our_watch_and_list_follow_etcd_client_writes() -> Result<()> {
    logs();
    let server = EtcdServer::start(EtcdOptions::default()).await?;
    let discovery = EtcdDiscovery::connect(config(&server, TTL)).await?;
    let mut raw = raw_client(&server).await?;
    let before = record(5, WorkerRole::Decode);
    let key_5 = "/tandem/it/workers/decode/0000000000000005";
    raw.put(key_5, serde_json::to_vec(&before)?, None).await?;

    let mut watch = discovery.watch(&CancellationToken::new()).await?;
    let within = Duration::from_secs(5);
    assert_eq!(
        next_event(&mut watch, within).await?,
        DiscoveryEvent::Added(before.clone())
    );

    // A put of a new key, then of a changed value.
    let b = record(6, WorkerRole::Aggregated);
    let key_6 = "/tandem/it/workers/aggregated/0000000000000006";
    raw.put(key_6, serde_json::to_vec(&b)?, None).await?;
    assert_eq!(
        next_event(&mut watch, within).await?,
        DiscoveryEvent::Added(b.clone())
    );
    let mut b2 = b.clone();
    b2.kv_capacity.host_blocks = 32;
    raw.put(key_6, serde_json::to_vec(&b2)?, None).await?;
    assert_eq!(
        next_event(&mut watch, within).await?,
        DiscoveryEvent::Added(b2.clone())
    );
    assert_eq!(discovery.list().await?, vec![before.clone(), b2]);

    // A key under the prefix that names no worker is ignored; an unreadable record is a removal.
    raw.put("/tandem/it/workers/not-a-worker", "x", None)
        .await?;
    raw.put(key_6, "{not json", None).await?;
    assert_eq!(
        next_event(&mut watch, within).await?,
        DiscoveryEvent::Removed {
            id: WorkerId(6),
            role: WorkerRole::Aggregated
        }
    );

    // A delete, and a delete of a whole prefix (both DELETE events on our watch).
    raw.delete(key_5, None).await?;
    assert_eq!(
        next_event(&mut watch, within).await?,
        DiscoveryEvent::Removed {
            id: WorkerId(5),
            role: WorkerRole::Decode
        }
    );
    let c = record(7, WorkerRole::Prefill);
    raw.put(
        "/tandem/it/workers/prefill/0000000000000007",
        serde_json::to_vec(&c)?,
        None,
    )
    .await?;
    assert_eq!(
        next_event(&mut watch, within).await?,
        DiscoveryEvent::Added(c)
    );
    raw.delete(
        "/tandem/it/workers/",
        Some(etcd_client::DeleteOptions::new().with_prefix()),
    )
    .await?;
    assert_eq!(
        next_event(&mut watch, within).await?,
        DiscoveryEvent::Removed {
            id: WorkerId(7),
            role: WorkerRole::Prefill
        }
    );
    // Keys of another namespace (outside our prefix) never show.
    raw.put(
        "/tandem/other/workers/decode/0000000000000008",
        serde_json::to_vec(&record(8, WorkerRole::Decode))?,
        None,
    )
    .await?;
    assert!(discovery.list().await?.is_empty());
    assert!(
        tokio::time::timeout(Duration::from_millis(300), watch.next())
            .await
            .is_err(),
        "no event for another namespace"
    );
    Ok(())
}

/// Turns on etcd auth with etcd-client: `root` (role `root`, which etcd requires before
/// `auth enable`) and `worker`, whose role may only read and write under `/tandem/`.
async fn enable_auth(server: &EtcdServer) -> Result<()> {
    let mut raw = raw_client(server).await?;
    raw.user_add("root", "root-pw", None).await?;
    raw.role_add("root").await?;
    raw.user_grant_role("root", "root").await?;
    raw.user_add("worker", "worker-pw", None).await?;
    raw.role_add("tandem").await?;
    raw.role_grant_permission(
        "tandem",
        etcd_client::Permission::read_write("/tandem/").with_prefix(),
    )
    .await?;
    raw.user_grant_role("worker", "tandem").await?;
    raw.auth_enable().await?;
    Ok(())
}

fn with_credentials(mut config: EtcdConfig, user: &str, password: &str) -> EtcdConfig {
    config.username = Some(user.into());
    config.password = Some(password.into());
    config
}

#[tokio::test]
async fn authenticated_registration_and_clear_auth_errors() -> Result<()> {
    logs();
    let server = EtcdServer::start(EtcdOptions::default()).await?;
    enable_auth(&server).await?;

    // The limited user registers and watches: our token goes with unary calls and streams.
    let worker = with_credentials(config(&server, TTL), "worker", "worker-pw");
    let discovery = EtcdDiscovery::connect(worker.clone()).await?;
    let mut watch = discovery.watch(&CancellationToken::new()).await?;
    let a = record(10, WorkerRole::Decode);
    let _reg = discovery.register(a.clone()).await?;
    assert_eq!(
        next_event(&mut watch, Duration::from_secs(5)).await?,
        DiscoveryEvent::Added(a.clone())
    );
    // Past several TTLs: the keep-alive stream is accepted too.
    tokio::time::sleep(TTL * 2).await;
    assert_eq!(discovery.list().await?, vec![a.clone()]);

    // etcd-client, authenticated on its own, reads what we wrote.
    let options = etcd_client::ConnectOptions::new().with_user("root", "root-pw");
    let mut raw = etcd_client::Client::connect([server.endpoint()], Some(options)).await?;
    let got = raw
        .get("/tandem/it/workers/decode/000000000000000a", None)
        .await?;
    let kv = got.kvs().first().context("key present")?;
    assert_eq!(serde_json::from_slice::<WorkerRecord>(kv.value())?, a);
    assert_ne!(kv.lease(), 0);

    // A wrong password is refused at connect, with etcd's reason and the user in the message.
    let wrong = with_credentials(config(&server, TTL), "worker", "nope");
    let err = EtcdDiscovery::connect(wrong)
        .await
        .expect_err("wrong password");
    let text = err.to_string();
    assert!(
        text.contains("authentication as \"worker\" refused")
            && text.contains("invalid user ID or password"),
        "{text}"
    );
    assert_eq!(err.class(), tandem_runtime::ErrorClass::Unavailable);

    // No credentials at all: etcd refuses the first read.
    let err = EtcdDiscovery::connect(config(&server, TTL))
        .await
        .expect_err("no credentials");
    assert!(matches!(err, RuntimeError::Etcd { .. }), "{err}");
    assert!(err.to_string().contains("user name is empty"), "{err}");
    Ok(())
}

#[tokio::test]
async fn a_dead_endpoint_in_the_list_is_skipped() -> Result<()> {
    logs();
    let server = EtcdServer::start(EtcdOptions::default()).await?;
    // A port nothing listens on: connections to it are refused.
    let dead = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.local_addr()?.port()
    };
    let mut cfg = config(&server, TTL);
    cfg.endpoints = vec![format!("127.0.0.1:{dead}"), server.endpoint()];
    let discovery = EtcdDiscovery::connect(cfg).await?;
    let a = record(11, WorkerRole::Prefill);
    let _reg = discovery.register(a.clone()).await?;
    // Every list connects afresh, starting at a different endpoint each time.
    for _ in 0..4 {
        assert_eq!(discovery.list().await?, vec![a.clone()]);
    }
    Ok(())
}
