//! Shared helpers of the integration tests: deterministic block contents, transport set-ups,
//! a full round trip, and re-running this test binary as a child process.

#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use tandem_kv_transfer::{
    BlockWriter, Region, RegionDescriptor, Transport, TransportConfig, TransportKind, UcxConfig,
};

/// Holds the UCX tests of one test binary to one at a time. UCX 1.13 aborts the process (an
/// assertion in `ucp_request.c` on a pending wireup reply, from `uct_tcp_ep_set_failed`) when
/// an endpoint to a peer that went away fails while a UCX worker created meanwhile, in the same
/// process or a child, has taken the dead peer's port: the tests that kill peers or connect to
/// dead ones must not overlap the tests that start new workers. Seen under load in CI.
pub async fn ucx_alone() -> tokio::sync::MutexGuard<'static, ()> {
    static ONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    ONE.lock().await
}

/// A named transport set-up: the kind plus the UCX transport list where it matters.
#[derive(Clone, Debug)]
pub struct Setup {
    pub name: &'static str,
    pub kind: TransportKind,
    pub ucx_tls: Option<&'static str>,
}

pub const TCP: Setup = Setup {
    name: "tcp",
    kind: TransportKind::Tcp,
    ucx_tls: None,
};
pub const LOCAL: Setup = Setup {
    name: "local",
    kind: TransportKind::Local,
    ucx_tls: None,
};
/// UCX's own selection (shared memory between processes on one host).
pub const UCX_DEFAULT: Setup = Setup {
    name: "ucx",
    kind: TransportKind::Ucx,
    ucx_tls: None,
};
pub const UCX_SM: Setup = Setup {
    name: "ucx-sm",
    kind: TransportKind::Ucx,
    ucx_tls: Some("sm,self"),
};
pub const UCX_TCP: Setup = Setup {
    name: "ucx-tcp",
    kind: TransportKind::Ucx,
    ucx_tls: Some("tcp"),
};

impl Setup {
    pub fn by_name(name: &str) -> Setup {
        [TCP, LOCAL, UCX_DEFAULT, UCX_SM, UCX_TCP]
            .into_iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("unknown setup {name}"))
    }

    pub fn config(&self) -> TransportConfig {
        TransportConfig {
            ucx: UcxConfig {
                tls: self.ucx_tls.map(str::to_string),
                net_devices: Some("lo".into()),
                peer_failure_detection: self.name != "ucx-sm",
                options: vec![("TX_SEG_SIZE".into(), "64k".into())],
            },
            connect_timeout: Duration::from_secs(3),
            op_timeout: Duration::from_secs(3),
            ..TransportConfig::default()
        }
    }

    pub async fn open(&self) -> Arc<dyn Transport> {
        tandem_kv_transfer::open(self.kind, &self.config())
            .await
            .unwrap_or_else(|e| panic!("{}: open: {e}", self.name))
    }
}

/// Deterministic pseudo-random contents of block `block` for `seed` (splitmix64).
pub fn fill(seed: u64, block: u32, buf: &mut [u8]) {
    let mut x = seed ^ (u64::from(block) << 32) ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in buf.chunks_mut(8) {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
    }
}

/// A permutation of `0..n` (deterministic for `seed`): the order puts are issued in.
pub fn shuffled(n: u32, seed: u64) -> Vec<u32> {
    let mut v: Vec<u32> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

/// Source blocks per chunk in [`dst_of`].
const CHUNK: u32 = 8;

/// Destination block of source block `i`: the source's chunks of [`CHUNK`] blocks in reverse
/// order, each chunk's blocks in order, so the mapping is not the identity and consecutive
/// source blocks land on consecutive destination blocks except across a chunk's edge.
pub fn dst_of(i: u32, n: u32) -> u32 {
    let start = i / CHUNK * CHUNK;
    let end = (start + CHUNK).min(n);
    n - end + (i - start)
}

/// Writes all `n` blocks of `seed`'s contents through `w`, then flushes: every fifth block
/// with `put`, in a shuffled order, between the others, which go with `put_region` in source
/// order (so writers that gather consecutive blocks into one operation see runs broken by a
/// gap in the source, by a jump in the destination, and by nothing).
pub async fn send_all(w: &mut dyn BlockWriter, n: u32, bpb: usize, seed: u64) {
    let src = Region::host(n, bpb).unwrap();
    let mut buf = vec![0u8; bpb];
    for i in 0..n {
        fill(seed, i, &mut buf);
        src.write_block(i, &buf).unwrap();
    }
    let mut copied = shuffled(n, seed).into_iter().filter(|i| i % 5 == 0);
    for i in (0..n).filter(|i| i % 5 != 0) {
        if i % 3 == 0
            && let Some(c) = copied.next()
        {
            fill(seed, c, &mut buf);
            w.put(dst_of(c, n), &buf)
                .await
                .unwrap_or_else(|e| panic!("put {c}: {e}"));
        }
        w.put_region(dst_of(i, n), &src, i)
            .await
            .unwrap_or_else(|e| panic!("put_region {i}: {e}"));
    }
    for c in copied {
        fill(seed, c, &mut buf);
        w.put(dst_of(c, n), &buf)
            .await
            .unwrap_or_else(|e| panic!("put {c}: {e}"));
    }
    w.flush().await.unwrap_or_else(|e| panic!("flush: {e}"));
}

/// Checks every byte of `region` against what `send_all` wrote.
pub fn verify(region: &Region, seed: u64) {
    let n = region.num_blocks();
    let mut want = vec![0u8; region.bytes_per_block()];
    for i in 0..n {
        fill(seed, i, &mut want);
        let got = region.read_block(dst_of(i, n)).unwrap();
        assert!(got == want, "block {i} (at {}) differs", dst_of(i, n));
    }
}

/// Parses a child's `DESCRIPTOR <compact>` output (the test harness may print its own
/// `test name ... ` before it on the same line).
pub fn parse_descriptor_line(line: &str) -> Option<RegionDescriptor> {
    let at = line.find("DESCRIPTOR ")?;
    line[at + "DESCRIPTOR ".len()..].trim().parse().ok()
}

/// Runs test `name` of this test binary in a child process with `env` set.
pub fn child(name: &str, env: &[(&str, String)]) -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--nocapture", "--test-threads=1"]);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}
