//! In-process round trips, bounds and dead peers for every transport (no GPU needed).

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{LOCAL, Setup, TCP};
use tandem_kv_transfer::{
    ErrorClass, Region, RegionDescriptor, TransferError, Transport, TransportKind,
};

const BLOCKS: u32 = 300;
const BPB: usize = 4096 + 64;

/// Expose on one transport, connect from another, stream 300 blocks out of order, verify,
/// then check the typed errors of bad puts.
async fn round_trip(setup: Setup) {
    round_trip_in(setup.clone(), false).await;
    // Memory the transport allocates (UCX: shared memory that a same-host sender maps).
    round_trip_in(setup, true).await;
}

async fn round_trip_in(setup: Setup, transport_memory: bool) {
    let recv = setup.open().await;
    let send = setup.open().await;
    let region = if transport_memory {
        recv.alloc_region(BLOCKS, BPB).await.unwrap()
    } else {
        Region::host(BLOCKS, BPB).unwrap()
    };
    assert!(
        region
            .read_block(BLOCKS - 1)
            .unwrap()
            .iter()
            .all(|&b| b == 0)
    );
    let desc = recv.expose(Arc::clone(&region)).await.unwrap();
    assert_eq!(desc.transport, setup.kind);
    // Through the compact form, as a discovery record would carry it.
    let desc: RegionDescriptor = desc.to_compact().parse().unwrap();
    let mut w = send.connect(&desc).await.unwrap();
    common::send_all(w.as_mut(), BLOCKS, BPB, 42).await;
    common::verify(&region, 42);

    let block = vec![1u8; BPB];
    let e = w.put(BLOCKS, &block).await.unwrap_err();
    assert!(
        matches!(
            e,
            TransferError::OutOfRange {
                block: BLOCKS,
                num_blocks: BLOCKS
            }
        ),
        "{e}"
    );
    assert_eq!(e.class(), ErrorClass::InvalidRequest);
    let e = w.put(0, &block[..BPB - 1]).await.unwrap_err();
    assert!(matches!(e, TransferError::BlockSize { .. }), "{e}");
    let small = Region::host(2, 16).unwrap();
    let e = w.put_region(0, &small, 0).await.unwrap_err();
    assert!(matches!(e, TransferError::BlockSize { .. }), "{e}");
    // A rejected put sent nothing: the writer still works.
    w.put(7, &block).await.unwrap();
    w.flush().await.unwrap();
    assert_eq!(region.read_block(7).unwrap(), block);

    // A second writer to the same peer (cached connection / endpoint).
    drop(w);
    let mut w2 = send.connect(&desc).await.unwrap();
    w2.put(8, &block).await.unwrap();
    w2.flush().await.unwrap();
    assert_eq!(region.read_block(8).unwrap(), block);
    parts_in_order(w2.as_mut(), send.as_ref(), &region).await;

    recv.withdraw(&desc).await.unwrap();
    assert!(recv.withdraw(&desc).await.is_err());
}

/// Blocks sent part by part through `w` into `region` (`BLOCKS` × `BPB`), as a prefill sends
/// each layer's K/V when the layer is done (layer-major blocks: layer `l` is bytes
/// `l · PART..(l + 1) · PART`), mixed with whole-block puts of the same blocks: everything
/// lands, in call order. The source is memory the sending transport allocated.
async fn parts_in_order(
    w: &mut dyn tandem_kv_transfer::BlockWriter,
    send: &dyn Transport,
    region: &Region,
) {
    const N: u32 = 12;
    const LAYERS: usize = 4;
    const PART: usize = BPB / LAYERS;
    let src = send.alloc_region(N, BPB).await.unwrap();
    let mut bytes = vec![0u8; BPB];
    for b in 0..N {
        common::fill(7, b, &mut bytes);
        src.write_block(b, &bytes).unwrap();
    }
    // Block 1 first goes whole, as zeros: its parts come after and win.
    w.put(common::dst_of(1, N), &[0u8; BPB]).await.unwrap();
    for layer in 0..LAYERS {
        for b in 0..N {
            let range = layer * PART..(layer + 1) * PART;
            w.put_region_part(common::dst_of(b, N), &src, b, range)
                .await
                .unwrap();
        }
    }
    // Block 0's parts went first: a whole block after them wins.
    let other = vec![0xA5u8; BPB];
    w.put(common::dst_of(0, N), &other).await.unwrap();
    w.flush().await.unwrap();
    for b in 1..N {
        common::fill(7, b, &mut bytes);
        assert_eq!(
            region.read_block(common::dst_of(b, N)).unwrap(),
            bytes,
            "block {b}"
        );
    }
    assert_eq!(region.read_block(common::dst_of(0, N)).unwrap(), other);

    // A part past the block's end, or of a block past the region's, is refused.
    let e = w
        .put_region_part(0, &src, 0, BPB - 8..BPB + 8)
        .await
        .unwrap_err();
    assert!(matches!(e, TransferError::BadPart { .. }), "{e}");
    assert_eq!(e.class(), ErrorClass::InvalidRequest);
    let e = w.put_region_part(BLOCKS, &src, 0, 0..8).await.unwrap_err();
    assert!(matches!(e, TransferError::OutOfRange { .. }), "{e}");
    // An empty part moves nothing, and the writer still works.
    w.put(N, &[0u8; BPB]).await.unwrap();
    w.put_region_part(N, &src, 0, 16..16).await.unwrap();
    w.put_region_part(N, &src, 2, PART..2 * PART).await.unwrap();
    w.flush().await.unwrap();
    let landed = region.read_block(N).unwrap();
    common::fill(7, 2, &mut bytes);
    assert_eq!(landed[PART..2 * PART], bytes[PART..2 * PART]);
    assert!(landed[..PART].iter().all(|&b| b == 0));
}

#[tokio::test]
async fn tcp_round_trip() {
    round_trip(TCP).await;
}

#[tokio::test]
async fn local_round_trip() {
    round_trip(LOCAL).await;
}

#[tokio::test]
async fn tcp_connect_to_dead_address_fails_fast() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let t = TCP.open().await;
    let desc = RegionDescriptor {
        transport: TransportKind::Tcp,
        address: format!("127.0.0.1:{port}"),
        region: 1,
        rkey: vec![],
        bytes_per_block: 64,
        num_blocks: 4,
        memory: tandem_kv_transfer::MemoryKind::Host,
    };
    let start = Instant::now();
    let e = t.connect(&desc).await.unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
}

#[tokio::test]
async fn tcp_unknown_region_and_wrong_kind_are_rejected() {
    let t = TCP.open().await;
    let region = Region::host(4, 64).unwrap();
    let mut desc = t.expose(region).await.unwrap();
    desc.region += 1000;
    assert!(t.connect(&desc).await.is_err());
    desc.transport = TransportKind::Local;
    let e = t.connect(&desc).await.unwrap_err();
    assert!(matches!(e, TransferError::BadDescriptor(_)), "{e}");
}

#[tokio::test]
async fn tcp_dead_receiver_fails_puts_and_flush() {
    let recv = TCP.open().await;
    let send = TCP.open().await;
    let region = Region::host(64, 64 * 1024).unwrap();
    let desc = recv.expose(region).await.unwrap();
    let mut w = send.connect(&desc).await.unwrap();
    w.put(0, &vec![5; 64 * 1024]).await.unwrap();
    w.flush().await.unwrap();
    drop(recv); // listener and connections go away
    let start = Instant::now();
    let block = vec![6; 64 * 1024];
    let mut failed = None;
    for i in 0..64 {
        if let Err(e) = w.put(i, &block).await {
            failed = Some(e);
            break;
        }
    }
    let e = match failed {
        Some(e) => e,
        None => w.flush().await.unwrap_err(),
    };
    assert_eq!(e.class(), ErrorClass::Unavailable, "{e}");
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    // The writer stays failed.
    assert!(w.flush().await.is_err());
}

#[tokio::test]
async fn local_rejects_foreign_and_unknown_regions() {
    let t = LOCAL.open().await;
    let region = Region::host(4, 64).unwrap();
    let desc = t.expose(region).await.unwrap();
    let mut other = desc.clone();
    other.address = "local:1".into();
    assert_eq!(
        t.connect(&other).await.unwrap_err().class(),
        ErrorClass::Unavailable
    );
    t.withdraw(&desc).await.unwrap();
    assert_eq!(
        t.connect(&desc).await.unwrap_err().class(),
        ErrorClass::Unavailable
    );
}

#[tokio::test]
async fn unsupported_kind_and_bad_config_are_typed() {
    let bad = tandem_kv_transfer::TransportConfig {
        max_inflight_puts: 0,
        ..Default::default()
    };
    let e = tandem_kv_transfer::open(TransportKind::Tcp, &bad)
        .await
        .unwrap_err();
    assert_eq!(e.class(), ErrorClass::InvalidRequest);
    // The default kind is decided once and is a real transport here.
    let k = tandem_kv_transfer::default_kind();
    assert!(matches!(k, TransportKind::Ucx | TransportKind::Tcp));
}

#[cfg(feature = "ucx")]
mod ucx {
    use super::*;
    use common::{UCX_DEFAULT, UCX_SM, UCX_TCP};

    #[tokio::test]
    async fn ucx_default_round_trip() {
        let _one = common::ucx_alone().await;
        round_trip(UCX_DEFAULT).await;
    }

    #[tokio::test]
    async fn ucx_shared_memory_round_trip() {
        let _one = common::ucx_alone().await;
        round_trip(UCX_SM).await;
    }

    #[tokio::test]
    async fn ucx_tcp_round_trip() {
        let _one = common::ucx_alone().await;
        round_trip(UCX_TCP).await;
    }

    #[tokio::test]
    async fn ucx_puts_gather_into_runs_with_few_puts_in_flight() {
        let _one = common::ucx_alone().await;
        // A writer holds a permit per gathered block: with one or three allowed in flight,
        // runs are posted early and every block still arrives.
        for max_inflight_puts in [1, 3] {
            let config = tandem_kv_transfer::TransportConfig {
                max_inflight_puts,
                ..UCX_DEFAULT.config()
            };
            let open = || tandem_kv_transfer::open(UCX_DEFAULT.kind, &config);
            let (recv, send) = (open().await.unwrap(), open().await.unwrap());
            let region = Region::host(40, 4096).unwrap();
            let desc = recv.expose(Arc::clone(&region)).await.unwrap();
            let mut w = send.connect(&desc).await.unwrap();
            common::send_all(w.as_mut(), 40, 4096, 9).await;
            common::verify(&region, 9);
        }
    }

    #[tokio::test]
    async fn ucx_same_transport_loopback() {
        let _one = common::ucx_alone().await;
        // Expose and connect on one transport: UCX's `self` path.
        let t = UCX_DEFAULT.open().await;
        let region = Region::host(16, 1024).unwrap();
        let desc = t.expose(Arc::clone(&region)).await.unwrap();
        let mut w = t.connect(&desc).await.unwrap();
        common::send_all(w.as_mut(), 16, 1024, 3).await;
        common::verify(&region, 3);
    }

    #[tokio::test]
    async fn ucx_connect_to_dead_worker_fails_in_bounded_time() {
        let _one = common::ucx_alone().await;
        for (setup, transport_memory) in
            [(UCX_DEFAULT, false), (UCX_DEFAULT, true), (UCX_TCP, false)]
        {
            let dead = setup.open().await;
            let region = if transport_memory {
                dead.alloc_region(4, 4096).await.unwrap()
            } else {
                Region::host(4, 4096).unwrap()
            };
            let desc = dead.expose(region).await.unwrap();
            drop(dead); // worker destroyed, memory unmapped and freed
            let t = setup.open().await;
            let start = Instant::now();
            let r = t.connect(&desc).await;
            let took = start.elapsed();
            // Some transports only notice at the first flush: either way it fails, in time.
            let e = match r {
                Err(e) => e,
                Ok(mut w) => match w.flush().await {
                    Err(e) => e,
                    Ok(()) => w.put(0, &[0; 4096]).await.and(w.flush().await).unwrap_err(),
                },
            };
            assert_eq!(e.class(), ErrorClass::Unavailable, "{}: {e}", setup.name);
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{}: {took:?} / {:?}",
                setup.name,
                start.elapsed()
            );
        }
    }

    #[tokio::test]
    async fn ucx_rejects_garbage_descriptors() {
        let _one = common::ucx_alone().await;
        let t = UCX_DEFAULT.open().await;
        let region = Region::host(4, 4096).unwrap();
        let good = t.expose(region).await.unwrap();
        let mut d = good.clone();
        d.address = "zz".into();
        assert!(matches!(
            t.connect(&d).await.unwrap_err(),
            TransferError::BadDescriptor(_)
        ));
        let mut d = good.clone();
        d.rkey.clear();
        assert!(matches!(
            t.connect(&d).await.unwrap_err(),
            TransferError::BadDescriptor(_)
        ));
    }
}
