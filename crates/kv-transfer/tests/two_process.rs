//! Two processes: this test binary re-runs itself as the other side (`child_entry`, selected
//! by environment variables), so memory registration, remote keys and worker addresses really
//! cross a process boundary.

// The child learns its role from the environment its parent test set: a harness switch.
#![allow(clippy::disallowed_methods)]

mod common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::Setup;
use tandem_kv_transfer::{ErrorClass, Region, RegionDescriptor};

const ROLE: &str = "TANDEM_KVT_CHILD_ROLE";
const SETUP: &str = "TANDEM_KVT_CHILD_SETUP";
const DESCRIPTOR: &str = "TANDEM_KVT_CHILD_DESCRIPTOR";
const BLOCKS: u32 = 256;
const BPB: usize = 16 * 1024;
const SEED: u64 = 0x5eed;

/// The child side. A no-op when run as a normal test.
#[test]
fn child_entry() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let setup = Setup::by_name(&std::env::var(SETUP).unwrap());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let t = setup.open().await;
        match role.as_str() {
            "send" => {
                let d: RegionDescriptor = std::env::var(DESCRIPTOR).unwrap().parse().unwrap();
                let mut w = t.connect(&d).await.unwrap();
                common::send_all(w.as_mut(), d.num_blocks, d.bytes_per_block as usize, SEED).await;
                println!("SENT");
            }
            "recv" => {
                let region = t.alloc_region(BLOCKS, BPB).await.unwrap();
                let d = t.expose(region).await.unwrap();
                println!("DESCRIPTOR {}", d.to_compact());
                // Serve until killed or until the parent closes stdin.
                tokio::task::spawn_blocking(|| {
                    let mut line = String::new();
                    let _ = std::io::stdin().read_line(&mut line);
                })
                .await
                .unwrap();
            }
            other => panic!("unknown role {other}"),
        }
    });
}

/// Exposes a region here, has a child process write every block, verifies every byte.
async fn child_sends(setup: Setup, transport_memory: bool) {
    let t = setup.open().await;
    let region = if transport_memory {
        t.alloc_region(BLOCKS, BPB).await.unwrap()
    } else {
        Region::host(BLOCKS, BPB).unwrap()
    };
    let d = t.expose(Arc::clone(&region)).await.unwrap();
    let mut cmd = common::child(
        "child_entry",
        &[
            (ROLE, "send".into()),
            (SETUP, setup.name.into()),
            (DESCRIPTOR, d.to_compact()),
        ],
    );
    cmd.stdin(Stdio::null());
    // Off the runtime thread: this process serves the child's writes (TCP listener) meanwhile.
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("SENT"),
        "{}: child failed: {}\n{stdout}\n{}",
        setup.name,
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    common::verify(&region, SEED);
}

/// A child exposes a region; this process writes into it, kills the child, and must see its
/// writes fail within a bounded time instead of hanging.
async fn receiver_dies(setup: Setup) {
    let mut child = common::child(
        "child_entry",
        &[(ROLE, "recv".into()), (SETUP, setup.name.into())],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()
    .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let d = loop {
        let line = lines.next().expect("child exited early").unwrap();
        if let Some(d) = common::parse_descriptor_line(&line) {
            break d;
        }
    };
    let t = setup.open().await;
    let mut w = t.connect(&d).await.unwrap();
    let block = vec![3u8; BPB];
    w.put(0, &block).await.unwrap();
    w.flush().await.unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    let start = Instant::now();
    let error = loop {
        let r = async {
            for b in 0..BLOCKS {
                w.put(b, &block).await?;
            }
            w.flush().await
        }
        .await;
        if let Err(e) = r {
            break e;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "{}: writes to a dead receiver kept succeeding",
            setup.name
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(
        error.class(),
        ErrorClass::Unavailable,
        "{}: {error}",
        setup.name
    );
    assert!(
        w.flush().await.is_err(),
        "{}: the writer stays failed",
        setup.name
    );
    // A fresh connect to the dead peer fails too, in bounded time.
    let start = Instant::now();
    let r = t.connect(&d).await;
    if let Ok(mut w) = r {
        let r = w.put(0, &block).await.and(w.flush().await);
        assert!(
            r.is_err(),
            "{}: connect and write to a dead peer",
            setup.name
        );
    }
    assert!(start.elapsed() < Duration::from_secs(10), "{}", setup.name);
}

#[tokio::test]
async fn tcp_child_sends() {
    child_sends(common::TCP, false).await;
}

#[tokio::test]
async fn tcp_receiver_dies() {
    receiver_dies(common::TCP).await;
}

#[cfg(feature = "ucx")]
mod ucx {
    use super::*;
    use common::{UCX_DEFAULT, UCX_SM, UCX_TCP};

    #[tokio::test]
    async fn ucx_child_sends_into_ucx_memory() {
        let _one = common::ucx_alone().await;
        // Same host: the child maps this process's shared memory and copies directly.
        child_sends(UCX_DEFAULT, true).await;
    }

    #[tokio::test]
    async fn ucx_child_sends_into_plain_memory() {
        let _one = common::ucx_alone().await;
        // Memory registered with ucp_mem_map: one-sided ucp_put_nbx.
        child_sends(UCX_DEFAULT, false).await;
    }

    #[tokio::test]
    async fn ucx_shared_memory_child_sends() {
        let _one = common::ucx_alone().await;
        child_sends(UCX_SM, false).await;
        child_sends(UCX_SM, true).await;
    }

    #[tokio::test]
    async fn ucx_tcp_child_sends() {
        let _one = common::ucx_alone().await;
        child_sends(UCX_TCP, false).await;
        child_sends(UCX_TCP, true).await;
    }

    #[tokio::test]
    async fn ucx_receiver_dies() {
        let _one = common::ucx_alone().await;
        receiver_dies(UCX_DEFAULT).await;
    }

    #[tokio::test]
    async fn ucx_tcp_receiver_dies() {
        let _one = common::ucx_alone().await;
        receiver_dies(UCX_TCP).await;
    }
}
