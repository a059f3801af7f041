//! Two-process KV transfer bandwidth: a child process exposes regions, this process writes
//! into them (16 KiB … 64 MiB transfers of up to 64 KiB blocks, `put_region` + one `flush`).
//! Baselines measured in the same run: `memcpy` of the same bytes, and a raw tokio TCP socket
//! to a child (write the bytes, read a one-byte ack).
//!
//! `cargo bench -p tandem-kv-transfer --bench transfer [-- [--quick] [--gpu]]`
//! (`--quick`: one round of 50 ms cells instead of the median of three rounds of 200 ms;
//! `--gpu` needs `--features cuda`: CUDA regions on both sides, device-to-device baseline).
//! Results and their analysis: BENCHMARKS.md.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_kv_transfer::{
    MemoryKind, Region, RegionDescriptor, TransferError, TransportConfig, TransportKind, UcxConfig,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const KIB: usize = 1024;
const MIB: usize = 1024 * 1024;
const MAX_BLOCK: usize = 64 * KIB;
const SIZES: [usize; 7] = [
    16 * KIB,
    64 * KIB,
    256 * KIB,
    MIB,
    4 * MIB,
    16 * MIB,
    64 * MIB,
];

#[derive(Clone, Copy, Debug)]
struct Setup {
    name: &'static str,
    kind: TransportKind,
    tls: Option<&'static str>,
    peer_failure_detection: bool,
    /// Regions from `Transport::alloc_region` (UCX: shared memory) instead of `Region::host`.
    transport_memory: bool,
}

const SETUPS: [Setup; 4] = [
    // UCX's default selection, regions it allocates: same-host shared memory that the sender
    // maps (ucp_rkey_ptr) and copies into.
    Setup {
        name: "ucx",
        kind: TransportKind::Ucx,
        tls: None,
        peer_failure_detection: true,
        transport_memory: true,
    },
    // UCX shared-memory transports with plain page-aligned regions registered by
    // ucp_mem_map: one-sided ucp_put_nbx through the worker thread.
    Setup {
        name: "ucx-put",
        kind: TransportKind::Ucx,
        tls: Some("sm,self"),
        peer_failure_detection: false,
        transport_memory: false,
    },
    Setup {
        name: "ucx-tcp",
        kind: TransportKind::Ucx,
        tls: Some("tcp"),
        peer_failure_detection: true,
        transport_memory: true,
    },
    Setup {
        name: "tcp",
        kind: TransportKind::Tcp,
        tls: None,
        peer_failure_detection: true,
        transport_memory: true,
    },
];

impl Setup {
    fn by_name(name: &str) -> Setup {
        *SETUPS.iter().find(|s| s.name == name).expect("known setup")
    }

    fn config(&self) -> TransportConfig {
        TransportConfig {
            ucx: UcxConfig {
                tls: self.tls.map(str::to_string),
                net_devices: Some("lo".into()),
                peer_failure_detection: self.peer_failure_detection,
                // UCX's TCP moves RMA as 8 KiB active-message segments by default; 64 KiB
                // segments (one KV block) cut per-segment overhead (BENCHMARKS.md). Only where
                // a TCP interface is in use (UCX warns about options no interface takes).
                options: if self.tls.is_none_or(|t| t.contains("tcp")) {
                    ["TX_SEG_SIZE", "RX_SEG_SIZE"]
                        .map(|k| (k.to_string(), "64k".to_string()))
                        .to_vec()
                } else {
                    Vec::new()
                },
            },
            ..TransportConfig::default()
        }
    }

    async fn region(
        &self,
        t: &dyn tandem_kv_transfer::Transport,
        gpu: bool,
        blocks: u32,
        bpb: usize,
    ) -> Result<Arc<Region>, TransferError> {
        if gpu {
            Region::cuda(0, blocks, bpb)
        } else if self.transport_memory {
            t.alloc_region(blocks, bpb).await
        } else {
            Region::host(blocks, bpb)
        }
    }
}

fn block_size(bytes: usize) -> usize {
    bytes.min(MAX_BLOCK)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let gpu = args.iter().any(|a| a == "--gpu");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if let Some(pos) = args.iter().position(|a| a == "--child") {
        let role = args.get(pos + 1).map(String::as_str).unwrap_or("");
        rt.block_on(child(role, gpu));
        return;
    }
    if gpu && let Err(e) = Region::cuda(0, 1, 4096) {
        eprintln!("transfer bench --gpu: {e}");
        std::process::exit(2);
    }
    let quick = args.iter().any(|a| a == "--quick");
    rt.block_on(parent(gpu, quick));
}

// ---------------------------------------------------------------------------------------------
// Child: the receiving side.

async fn child(role: &str, gpu: bool) {
    let mut out = std::io::stdout().lock();
    if role == "sink" {
        // Raw socket baseline: read `len` bytes, ack with one byte, repeat.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        writeln!(out, "ADDR {}", listener.local_addr().unwrap()).unwrap();
        out.flush().unwrap();
        drop(out);
        let (mut s, _) = listener.accept().await.unwrap();
        s.set_nodelay(true).unwrap();
        // Page-aligned, like the regions (see `memcpy_gbps` on misaligned copies).
        let region = Region::host(1, *SIZES.last().unwrap()).unwrap();
        let mut buf = region.lock_block(0).unwrap();
        while let Ok(len) = s.read_u64_le().await {
            if s.read_exact(&mut buf[..len as usize]).await.is_err() {
                return;
            }
            s.write_u8(1).await.unwrap();
        }
        return;
    }
    let setup = Setup::by_name(role);
    let transport = tandem_kv_transfer::open(setup.kind, &setup.config())
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", setup.name));
    let max = *SIZES.last().unwrap();
    let mut keep = Vec::new();
    for bpb in [16 * KIB, MAX_BLOCK] {
        let blocks = (max / bpb) as u32;
        let region = setup
            .region(transport.as_ref(), gpu, blocks, bpb)
            .await
            .unwrap_or_else(|e| panic!("{}: region: {e}", setup.name));
        let d = match transport.expose(Arc::clone(&region)).await {
            Ok(d) => d,
            Err(e) => {
                writeln!(out, "UNSUPPORTED {e}").unwrap();
                out.flush().unwrap();
                drop(out);
                return;
            }
        };
        writeln!(out, "DESCRIPTOR {}", d.to_compact()).unwrap();
        keep.push(region);
    }
    writeln!(out, "READY").unwrap();
    out.flush().unwrap();
    drop(out);
    // Serve until the parent closes our stdin.
    let _ = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
    })
    .await;
    drop(transport);
}

struct ChildProc {
    child: Child,
    lines: Vec<String>,
}

/// Spawns this binary as a child and reads its stdout up to a line starting with one of
/// `until`.
fn spawn_child(role: &str, gpu: bool, until: &[&str]) -> ChildProc {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--child", role]);
    if gpu {
        cmd.arg("--gpu");
    }
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn child");
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut lines = Vec::new();
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap() == 0 {
            panic!("child {role} exited early");
        }
        let line = line.trim().to_string();
        let done = until.iter().any(|u| line.starts_with(u));
        lines.push(line);
        if done {
            break;
        }
    }
    ChildProc { child, lines }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Parent: the sending side and the report.

/// Runs `op` (moving `bytes`) until `budget` is spent (at least 3 times); returns GB/s.
async fn measure(
    bytes: usize,
    budget: Duration,
    mut op: impl AsyncFnMut() -> Result<(), TransferError>,
) -> Result<f64, TransferError> {
    op().await?; // warm-up (first touch, connection set-up)
    let start = Instant::now();
    let mut n = 0u64;
    while n < 3 || start.elapsed() < budget {
        op().await?;
        n += 1;
    }
    Ok(bytes as f64 * n as f64 / start.elapsed().as_secs_f64() / 1e9)
}

/// `memcpy` between two page-aligned buffers (heap `Vec`s at the allocator's 16-byte offsets
/// hit a slow `rep movsb` case on this AMD machine below ~1 MiB: 2 GB/s instead of 40).
fn memcpy_gbps(bytes: usize, budget: Duration) -> f64 {
    let a = Region::host(1, bytes).unwrap();
    let b = Region::host(1, bytes).unwrap();
    let src = a.lock_block(0).unwrap();
    let mut dst = b.lock_block(0).unwrap();
    dst.copy_from_slice(&src);
    let start = Instant::now();
    let mut n = 0u64;
    while n < 3 || start.elapsed() < budget {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut *dst);
        n += 1;
    }
    bytes as f64 * n as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// Device-to-device copy of `bytes` (one block of that size), the GPU baseline.
fn dtod_gbps(bytes: usize, budget: Duration) -> f64 {
    let a = Region::cuda(0, 1, bytes).unwrap_or_else(|e| panic!("CUDA region: {e}"));
    let b = Region::cuda(0, 1, bytes).unwrap_or_else(|e| panic!("CUDA region: {e}"));
    let start = Instant::now();
    let mut n = 0u64;
    while n < 3 || start.elapsed() < budget {
        b.copy_block_from(0, &a, 0).expect("dtod");
        n += 1;
    }
    bytes as f64 * n as f64 / start.elapsed().as_secs_f64() / 1e9
}

/// The raw-socket baseline: a plain tokio TCP stream to a `sink` child.
struct RawRig {
    stream: tokio::net::TcpStream,
    buf: Arc<Region>,
    _child: ChildProc,
}

impl RawRig {
    async fn new() -> RawRig {
        let child = spawn_child("sink", false, &["ADDR"]);
        let addr = child.lines[0].trim_start_matches("ADDR ").to_string();
        let stream = tokio::net::TcpStream::connect(&addr).await.unwrap();
        stream.set_nodelay(true).unwrap();
        let buf = Region::host(1, *SIZES.last().unwrap()).unwrap();
        RawRig {
            stream,
            buf,
            _child: child,
        }
    }

    async fn measure(&mut self, bytes: usize, budget: Duration) -> f64 {
        let buf = self.buf.lock_block(0).unwrap();
        let s = &mut self.stream;
        measure(bytes, budget, async || {
            s.write_u64_le(bytes as u64).await.unwrap();
            // 2 MiB writes: measured faster than one huge write_all on this machine, and the
            // size of the TCP transport's batches.
            for chunk in buf[..bytes].chunks(2 << 20) {
                s.write_all(chunk).await.unwrap();
            }
            s.read_u8().await.unwrap();
            Ok(())
        })
        .await
        .unwrap()
    }
}

/// One transport set-up: a receiving child, this process's transport, and a writer plus a
/// source region per block size.
struct Rig {
    writers: Vec<(usize, Box<dyn tandem_kv_transfer::BlockWriter>, Arc<Region>)>,
    _transport: Arc<dyn tandem_kv_transfer::Transport>,
    _child: ChildProc,
}

impl Rig {
    async fn new(setup: Setup, gpu: bool) -> Result<Rig, TransferError> {
        let child = spawn_child(setup.name, gpu, &["READY", "UNSUPPORTED"]);
        if let Some(line) = child.lines.iter().find(|l| l.starts_with("UNSUPPORTED")) {
            return Err(TransferError::Unsupported(line.clone()));
        }
        let descriptors: Vec<RegionDescriptor> = child
            .lines
            .iter()
            .filter_map(|l| l.strip_prefix("DESCRIPTOR "))
            .map(|d| d.parse().expect("descriptor"))
            .collect();
        let transport = tandem_kv_transfer::open(setup.kind, &setup.config()).await?;
        let max = *SIZES.last().unwrap();
        let mut writers = Vec::new();
        for d in &descriptors {
            let want = if gpu {
                MemoryKind::Cuda
            } else {
                MemoryKind::Host
            };
            assert_eq!(d.memory, want);
            let bpb = d.bytes_per_block as usize;
            let blocks = (max / bpb) as u32;
            let src = setup.region(transport.as_ref(), gpu, blocks, bpb).await?;
            for b in 0..src.num_blocks() {
                if !gpu {
                    src.lock_block(b)?.fill(b as u8);
                }
            }
            writers.push((bpb, transport.connect(d).await?, src));
        }
        Ok(Rig {
            writers,
            _transport: transport,
            _child: child,
        })
    }

    async fn measure(&mut self, bytes: usize, budget: Duration) -> Result<f64, TransferError> {
        let bpb = block_size(bytes);
        let (_, w, src) = self
            .writers
            .iter_mut()
            .find(|(b, _, _)| *b == bpb)
            .expect("a region per block size");
        let blocks = (bytes / bpb) as u32;
        measure(bytes, budget, async || {
            for b in 0..blocks {
                w.put_region(b, src, b).await?;
            }
            w.flush().await
        })
        .await
    }
}

fn human(bytes: usize) -> String {
    if bytes >= MIB {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{} KiB", bytes / KIB)
    }
}

/// Named columns of GB/s per size (`None`: not measured).
type Columns = Vec<(&'static str, Vec<Option<f64>>)>;

/// One round: for each size, every column in turn, so that the columns compared in a ratio
/// are measured back to back, under the same load.
async fn round(
    gpu: bool,
    budget: Duration,
    raw: &mut RawRig,
    rigs: &mut [(&'static str, Option<Rig>)],
) -> Columns {
    let baseline_name = if gpu { "dtod" } else { "memcpy" };
    let mut columns: Columns = vec![(baseline_name, Vec::new()), ("raw-socket", Vec::new())];
    columns.extend(rigs.iter().map(|(name, _)| (*name, Vec::new())));
    for &bytes in &SIZES {
        let base = if gpu {
            dtod_gbps(bytes, budget)
        } else {
            memcpy_gbps(bytes, budget)
        };
        columns[0].1.push(Some(base));
        columns[1].1.push(Some(raw.measure(bytes, budget).await));
        for (i, (name, rig)) in rigs.iter_mut().enumerate() {
            let v = match rig {
                Some(rig) => match rig.measure(bytes, budget).await {
                    Ok(v) => Some(v),
                    Err(e) => {
                        eprintln!("{name}: {e}");
                        None
                    }
                },
                None => None,
            };
            columns[2 + i].1.push(v);
        }
    }
    columns
}

/// Per cell, the median over rounds (this machine is shared: single runs swing by ±30%).
fn median_of(rounds: &[Columns]) -> Columns {
    let mut out = rounds[0].clone();
    for (c, (_, cells)) in out.iter_mut().enumerate() {
        for (i, cell) in cells.iter_mut().enumerate() {
            let mut v: Vec<f64> = rounds.iter().filter_map(|r| r[c].1[i]).collect();
            v.sort_by(f64::total_cmp);
            *cell = (!v.is_empty()).then(|| v[v.len() / 2]);
        }
    }
    out
}

async fn parent(gpu: bool, quick: bool) {
    let (budget, rounds) = if quick {
        (Duration::from_millis(50), 1)
    } else {
        (Duration::from_millis(200), 3)
    };
    let started = Instant::now();
    let baseline_name = if gpu { "dtod" } else { "memcpy" };
    let mut raw = RawRig::new().await;
    let mut rigs = Vec::new();
    for setup in SETUPS {
        let rig = match Rig::new(setup, gpu).await {
            Ok(rig) => Some(rig),
            Err(e) => {
                eprintln!("{}: {e}", setup.name);
                None
            }
        };
        rigs.push((setup.name, rig));
    }
    let mut all = Vec::new();
    for _ in 0..rounds {
        all.push(round(gpu, budget, &mut raw, &mut rigs).await);
    }
    drop(rigs);
    drop(raw);
    let columns = median_of(&all);
    println!(
        "\nKV transfer bandwidth, GB/s (1e9 B/s), median of {rounds} round(s) of {} ms per cell; \
         blocks of min(size, 64 KiB); {} regions",
        budget.as_millis(),
        if gpu { "CUDA" } else { "host" }
    );
    print!("{:>8} {:>6}", "size", "blocks");
    for (name, _) in &columns {
        print!(" {name:>10}");
    }
    println!();
    for (i, &bytes) in SIZES.iter().enumerate() {
        print!("{:>8} {:>6}", human(bytes), bytes / block_size(bytes));
        for (_, v) in &columns {
            match v[i] {
                Some(g) => print!(" {g:>10.2}"),
                None => print!(" {:>10}", "-"),
            }
        }
        println!();
    }
    let col = |name: &str| {
        columns
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
            .expect("column")
    };
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:.2}", a / b),
        _ => "-".into(),
    };
    let pairs = [
        ("ucx", baseline_name),
        ("ucx-put", baseline_name),
        ("tcp", "raw-socket"),
        ("ucx-tcp", "raw-socket"),
    ];
    println!(
        "\nratios at >= 1 MiB (targets: ucx/{baseline_name} >= 0.80, tcp/raw-socket >= 0.80):"
    );
    print!("{:>8}", "size");
    for (a, b) in pairs {
        print!(
            " {:>20}",
            format!("{a}/{}", if b == "raw-socket" { "raw" } else { b })
        );
    }
    println!();
    for (i, &bytes) in SIZES.iter().enumerate().filter(|(_, b)| **b >= MIB) {
        print!("{:>8}", human(bytes));
        for (a, b) in pairs {
            print!(" {:>20}", ratio(col(a)[i], col(b)[i]));
        }
        println!();
    }
    println!("\nwhole run: {:.1} s", started.elapsed().as_secs_f64());
}
