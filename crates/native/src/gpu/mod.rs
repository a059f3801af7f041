//! The forward pass on an NVIDIA GPU (feature `cuda`): [`GpuModel`], the engine's
//! [`Model`] with the weights and the KV arena in device memory.
//!
//! **How.** cudarc loads the CUDA driver and NVRTC at run time, and the kernels
//! (`kernels.cu`) are compiled for the device when a model opens it: the build needs no CUDA
//! toolkit, and a binary built with the feature runs on a machine without a GPU until a
//! worker asks for one. The weights go to the device once, in the formats the CPU path keeps
//! (Q4_0, Q4_1 and Q8_0 as the file has them, everything else f32), dequantized inside the
//! matrix kernel; activations are f32. A step is the CPU path's step: the scheduled rows as
//! one activation matrix, K and V written into the engine's arena (which must be in GPU
//! memory: [`ArenaStorage::device`]) through the block tables and read back from there,
//! f16, by attention. Logits come back to the host, where the CPU path's sampler draws.
//!
//! **Batch invariance** holds as on the CPU (see `kernels.cu`): a row's logits are bitwise the
//! same in one shot or in chunks, alone or batched, from a prefix hit, or from KV copied into
//! another arena. The GPU's logits are not bitwise the CPU's (another summation order, f32
//! activations where the CPU quantizes them to 8 bits): a cluster mixes GPU and CPU workers of
//! one model only where exactness between them does not matter.
//!
//! **Why own kernels, not cuBLAS.** cuBLAS picks its algorithm (and split of the reduction)
//! by the matrix shape, so a row's result would change with the step's row count: batch
//! invariance, and with it agg == disagg, would be lost. A fixed-order product per output is
//! invariant by construction, and for the weights of small models a step is bound by launches
//! and memory, not by tensor-core arithmetic.
//!
//! **Layout.** `device`: the one module with `unsafe` (kernel launches), the CUDA source's
//! compilation and one call per kernel; here: [`Device`], the uploaded weights
//! ([`GpuWeights`], shared by every engine of a process on one device), [`GpuModel`] and
//! [`DeviceArena`] (an arena in device memory for engines without a KV transport's region).

mod device;

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, ValidAsZeroBits};
use tandem_engine::scheduler::ModelView;
use tandem_engine::{ArenaStorage, DeviceMemory, KvShape, Model, SampledToken, StepPlan};
use tandem_protocol::{ErrorClass, RequestId};

pub use device::{Gpu, HD_MAX, SOURCE, compile};

pub use crate::device::Device;
use crate::kernels::WeightFormat;
use crate::llama::{Llama, StepRow};
use crate::model::{NativeModel, sample_step, step_rows};
use crate::sampling::Sampler;
use crate::tensor::Matrix;
use device::{AttnShape, LayerArgs, Product, StepGraph, StepSlices};

/// Why the GPU cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// No driver, no NVRTC, no such device.
    #[error("no GPU: {0}")]
    Unavailable(String),
    /// NVRTC refused the kernels (its log).
    #[error("the GPU kernels do not compile: {0}")]
    Compile(String),
    #[error("CUDA {op}: {detail}")]
    Driver { op: &'static str, detail: String },
    /// A model the kernels do not compute.
    #[error("the GPU engine cannot compute this model: {0}")]
    Unsupported(String),
}

impl GpuError {
    pub fn class(&self) -> ErrorClass {
        match self {
            GpuError::Unsupported(_) => ErrorClass::InvalidRequest,
            _ => ErrorClass::Unavailable,
        }
    }
}

fn driver(op: &'static str) -> impl FnOnce(DriverError) -> GpuError {
    move |e| GpuError::Driver {
        op,
        detail: e.to_string(),
    }
}

/// A weight matrix in device memory, in its CPU format.
#[derive(Debug)]
pub struct GpuMatrix {
    format: WeightFormat,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    data: CudaSlice<u8>,
}

/// One transformer block's weights on the device.
#[derive(Debug)]
struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wq: GpuMatrix,
    wk: GpuMatrix,
    wv: GpuMatrix,
    bias: Option<[CudaSlice<f32>; 3]>,
    wo: GpuMatrix,
    ffn_norm: CudaSlice<f32>,
    w_gate: GpuMatrix,
    w_up: GpuMatrix,
    w_down: GpuMatrix,
}

/// A model's weights on one device, with the device's kernels: what every engine of the
/// process computing this model there shares.
#[derive(Debug)]
pub struct GpuWeights {
    gpu: Gpu,
    llama: Arc<Llama>,
    embed: GpuMatrix,
    layers: Vec<GpuLayer>,
    output_norm: CudaSlice<f32>,
    output: Option<GpuMatrix>,
    bytes: usize,
}

impl GpuWeights {
    /// Opens device `ordinal`, compiles the kernels and copies `llama`'s weights there.
    pub fn upload(llama: Arc<Llama>, ordinal: usize) -> Result<Arc<GpuWeights>, GpuError> {
        let cfg = &llama.cfg;
        if cfg.head_dim > HD_MAX || !cfg.head_dim.is_multiple_of(8) {
            return Err(GpuError::Unsupported(format!(
                "heads of {} dimensions (the attention kernel takes multiples of 8 up to \
                 {HD_MAX})",
                cfg.head_dim
            )));
        }
        let gpu = Gpu::open(ordinal)?;
        let embed = upload_matrix(&gpu, &llama.embed)?;
        let output = llama
            .output
            .as_ref()
            .map(|m| upload_matrix(&gpu, m))
            .transpose()?;
        let mut layers = Vec::with_capacity(llama.layers.len());
        for l in &llama.layers {
            let bias = match &l.bias {
                Some([bq, bk, bv]) => {
                    Some([upload(&gpu, bq)?, upload(&gpu, bk)?, upload(&gpu, bv)?])
                }
                None => None,
            };
            layers.push(GpuLayer {
                attn_norm: upload(&gpu, &l.attn_norm)?,
                wq: upload_matrix(&gpu, &l.wq)?,
                wk: upload_matrix(&gpu, &l.wk)?,
                wv: upload_matrix(&gpu, &l.wv)?,
                bias,
                wo: upload_matrix(&gpu, &l.wo)?,
                ffn_norm: upload(&gpu, &l.ffn_norm)?,
                w_gate: upload_matrix(&gpu, &l.w_gate)?,
                w_up: upload_matrix(&gpu, &l.w_up)?,
                w_down: upload_matrix(&gpu, &l.w_down)?,
            });
        }
        let bytes = llama.embed.bytes()
            + llama.output.as_ref().map_or(0, Matrix::bytes)
            + llama
                .layers
                .iter()
                .map(|l| {
                    [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]
                        .iter()
                        .map(|m| m.bytes())
                        .sum::<usize>()
                })
                .sum::<usize>();
        let output_norm = upload(&gpu, &llama.output_norm)?;
        gpu.stream.synchronize().map_err(driver("weights"))?;
        Ok(Arc::new(GpuWeights {
            gpu,
            llama,
            embed,
            layers,
            output_norm,
            output,
            bytes,
        }))
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    pub fn llama(&self) -> &Arc<Llama> {
        &self.llama
    }

    /// Bytes of the matrices on the device.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

fn upload<T: DeviceRepr>(gpu: &Gpu, values: &[T]) -> Result<CudaSlice<T>, GpuError> {
    gpu.stream.clone_htod(values).map_err(driver("weights"))
}

fn upload_matrix(gpu: &Gpu, m: &Matrix) -> Result<GpuMatrix, GpuError> {
    Ok(GpuMatrix {
        format: m.format(),
        rows: m.rows(),
        cols: m.cols(),
        row_bytes: m.format().row_bytes(m.cols()),
        data: upload(gpu, m.data())?,
    })
}

/// A device buffer that grows to what a step needs and is reused after.
#[derive(Debug, Default)]
struct Buf<T: DeviceRepr>(Option<CudaSlice<T>>);

impl<T: DeviceRepr + ValidAsZeroBits> Buf<T> {
    /// At least `n` elements; whether the buffer moved (a step graph naming it is stale).
    fn reserve(&mut self, st: &Arc<CudaStream>, n: usize) -> Result<bool, DriverError> {
        let n = n.max(1);
        if self.0.as_ref().is_some_and(|s| s.len() >= n) {
            return Ok(false);
        }
        // Room for growth, so a step a little longer does not reallocate.
        self.0 = Some(st.alloc_zeros::<T>(n + n / 2)?);
        Ok(true)
    }

    /// `values` copied to the front of the buffer (reserved for them).
    fn upload(&mut self, st: &Arc<CudaStream>, values: &[T]) -> Result<(), DriverError> {
        if !values.is_empty() {
            st.memcpy_htod(values, &mut self.get_mut().slice_mut(0..values.len()))?;
        }
        Ok(())
    }

    fn get(&self) -> &CudaSlice<T> {
        self.0.as_ref().expect("reserved for the step")
    }

    fn get_mut(&mut self) -> &mut CudaSlice<T> {
        self.0.as_mut().expect("reserved for the step")
    }
}

/// The step's buffers on the device, reused from step to step.
#[derive(Debug, Default)]
struct Scratch {
    x: Buf<f32>,
    h: Buf<f32>,
    q: Buf<f32>,
    k: Buf<f32>,
    v: Buf<f32>,
    att: Buf<f32>,
    part: Buf<f32>,
    gate: Buf<f32>,
    up: Buf<f32>,
    logits: Buf<f32>,
    tokens: Buf<u32>,
    pos: Buf<u32>,
    table_off: Buf<u32>,
    tables: Buf<u32>,
    out_rows: Buf<u32>,
    cos: Buf<f32>,
    sin: Buf<f32>,
}

impl Scratch {
    /// Room for a step of `h`'s inputs; whether any buffer moved.
    fn reserve(
        &mut self,
        st: &Arc<CudaStream>,
        l: &Llama,
        h: &HostStep,
    ) -> Result<bool, DriverError> {
        let cfg = &l.cfg;
        let n = h.tokens.len();
        let vocab = l.output.as_ref().unwrap_or(&l.embed).rows();
        let mut moved = false;
        for (buf, len) in [
            (&mut self.x, n * cfg.n_embd),
            (&mut self.h, n * cfg.n_embd),
            (&mut self.q, n * cfg.q_dim()),
            (&mut self.k, n * cfg.kv_dim()),
            (&mut self.v, n * cfg.kv_dim()),
            (&mut self.att, n * cfg.q_dim()),
            (
                &mut self.part,
                device::attention_scratch(n, cfg.n_head, cfg.head_dim),
            ),
            (&mut self.gate, n * cfg.n_ff),
            (&mut self.up, n * cfg.n_ff),
            (&mut self.logits, h.out_rows.len() * vocab),
            (&mut self.cos, h.cos.len()),
            (&mut self.sin, h.sin.len()),
        ] {
            moved |= buf.reserve(st, len)?;
        }
        for (buf, len) in [
            (&mut self.tokens, n),
            (&mut self.pos, n),
            (&mut self.table_off, n),
            (&mut self.tables, h.tables.len()),
            (&mut self.out_rows, h.out_rows.len()),
        ] {
            moved |= buf.reserve(st, len)?;
        }
        Ok(moved)
    }

    fn upload(&mut self, st: &Arc<CudaStream>, h: &HostStep) -> Result<(), DriverError> {
        self.tokens.upload(st, &h.tokens)?;
        self.pos.upload(st, &h.pos)?;
        self.table_off.upload(st, &h.table_off)?;
        self.tables.upload(st, &h.tables)?;
        self.out_rows.upload(st, &h.out_rows)?;
        self.cos.upload(st, &h.cos)?;
        self.sin.upload(st, &h.sin)
    }
}

/// The step's inputs as the host lays them out before one copy each.
#[derive(Debug, Default)]
struct HostStep {
    tokens: Vec<u32>,
    pos: Vec<u32>,
    table_off: Vec<u32>,
    tables: Vec<u32>,
    out_rows: Vec<u32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    angle_cos: Vec<f32>,
    angle_sin: Vec<f32>,
}

/// Steps of at most this many rows replay a captured graph of their launches (decode steps:
/// hundreds of small kernels, whose launch costs more than their work); longer ones launch
/// directly.
const GRAPH_ROWS: usize = 256;
/// Graphs kept (by rows and sampling rows) before they are all dropped and captured again.
const GRAPHS: usize = 64;

/// The Llama forward pass on a GPU as the engine's model (see the module docs).
pub struct GpuModel {
    w: Arc<GpuWeights>,
    /// This model's own stream: a step's graph is captured on it, apart from other engines'.
    stream: Arc<CudaStream>,
    shape: AttnShape,
    s: Scratch,
    host: HostStep,
    /// Captured steps by (rows, sampling rows), all naming `s`'s current buffers.
    graphs: HashMap<(usize, usize), StepGraph>,
    sampler: Sampler,
    logits: Vec<f32>,
}

impl std::fmt::Debug for GpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuModel")
            .field("gpu", &self.w.gpu)
            .field("shape", &self.shape)
            .field("graphs", &self.graphs.len())
            .finish_non_exhaustive()
    }
}

impl GpuModel {
    /// A model for an engine whose blocks hold `block_size` tokens, computing on the device
    /// `weights` are on. The engine's arena must be in that device's memory.
    pub fn new(weights: Arc<GpuWeights>, block_size: usize) -> Result<GpuModel, GpuError> {
        let cfg = &weights.llama.cfg;
        let shape = AttnShape {
            bs: block_size,
            n_head: cfg.n_head,
            n_head_kv: cfg.n_head_kv,
            hd: cfg.head_dim,
            rope_dims: cfg.rope_dims,
            neox: cfg.arch.rope_neox(),
        };
        let stream = weights.gpu.ctx.new_stream().map_err(driver("stream"))?;
        Ok(GpuModel {
            w: weights,
            stream,
            shape,
            s: Scratch::default(),
            host: HostStep::default(),
            graphs: HashMap::new(),
            sampler: Sampler::default(),
            logits: Vec::new(),
        })
    }

    pub fn llama(&self) -> &Llama {
        &self.w.llama
    }

    pub fn weights(&self) -> &Arc<GpuWeights> {
        &self.w
    }

    /// The logits of the last step's sampling rows, in plan order (`n_vocab` each).
    pub fn last_logits(&self) -> &[f32] {
        &self.logits
    }

    /// Computes `rows` against the arena at `mem` (`num_blocks` blocks of `block_bytes`),
    /// leaving the logits of the rows that want them in `self.logits`.
    fn forward(
        &mut self,
        rows: &[StepRow<'_>],
        mem: DeviceMemory,
        num_blocks: usize,
        block_bytes: usize,
    ) -> Result<(), DriverError> {
        self.logits.clear();
        let n = rows.len();
        if n == 0 {
            return Ok(());
        }
        lay_out(
            &self.w.llama,
            rows,
            self.shape.bs,
            num_blocks,
            &mut self.host,
        );
        let m = self.host.out_rows.len();
        let st = &self.stream;
        if self.s.reserve(st, &self.w.llama, &self.host)? {
            self.graphs.clear();
        }
        // KV a transport wrote into the arena (synchronous copies, on the null stream) has
        // landed before this step reads it.
        let landed = self.w.gpu.stream.record_event(None)?;
        st.wait(&landed)?;
        self.s.upload(st, &self.host)?;
        let at = Arena {
            base: mem.base,
            block_bytes: block_bytes as u64,
        };
        if n <= GRAPH_ROWS {
            if !self.graphs.contains_key(&(n, m)) {
                if self.graphs.len() >= GRAPHS {
                    self.graphs.clear();
                }
                let graph = StepGraph::capture(st, || {
                    launch_step(&self.w, st, &self.shape, &mut self.s, n, m, at)
                })?;
                self.graphs.insert((n, m), graph);
            }
            self.graphs[&(n, m)].launch()?;
        } else {
            launch_step(&self.w, st, &self.shape, &mut self.s, n, m, at)?;
        }
        if m > 0 {
            let len = m * self.w.llama.cfg.n_vocab;
            self.logits.resize(len, 0.0);
            st.memcpy_dtoh(&self.s.logits.get().slice(0..len), &mut self.logits)?;
        }
        st.synchronize()
    }
}

/// Where the engine's arena is: its device address and its blocks' size in bytes.
#[derive(Clone, Copy, Debug)]
struct Arena {
    base: u64,
    block_bytes: u64,
}

/// Every kernel of a step of `n` rows, `m` of them sampling, over `s`'s inputs (uploaded),
/// on `st`. Launches only: no allocation, no copy, no wait, so a graph can capture it.
fn launch_step(
    w: &GpuWeights,
    st: &CudaStream,
    shape: &AttnShape,
    s: &mut Scratch,
    n: usize,
    m: usize,
    arena: Arena,
) -> Result<(), DriverError> {
    let (gpu, cfg) = (&w.gpu, &w.llama.cfg);
    let (d, ff, eps) = (cfg.n_embd, cfg.n_ff, cfg.rms_eps);
    gpu.embed(st, &w.embed, s.tokens.get(), n, s.x.get_mut())?;
    for (l, layer) in w.layers.iter().enumerate() {
        gpu.rms_norm(
            st,
            s.x.get(),
            &layer.attn_norm,
            s.h.get_mut(),
            n,
            d,
            eps,
            None,
        )?;
        let bias = layer.bias.as_ref();
        let (q, k, v) = (s.q.get_mut(), s.k.get_mut(), s.v.get_mut());
        let mut qkv = [
            Product {
                w: &layer.wq,
                y: q,
                bias: bias.map(|b| &b[0]),
            },
            Product {
                w: &layer.wk,
                y: k,
                bias: bias.map(|b| &b[1]),
            },
            Product {
                w: &layer.wv,
                y: v,
                bias: bias.map(|b| &b[2]),
            },
        ];
        products(gpu, st, &mut qkv, s.h.get(), n, false)?;
        let args = LayerArgs {
            shape,
            layer: l,
            rows: n,
            arena: arena.base,
            block_bytes: arena.block_bytes,
        };
        let mut slices = StepSlices {
            q: s.q.0.as_mut().expect("reserved"),
            k: s.k.0.as_mut().expect("reserved"),
            v: s.v.0.as_ref().expect("reserved"),
            att: s.att.0.as_mut().expect("reserved"),
            part: s.part.0.as_mut().expect("reserved"),
            cos: s.cos.get(),
            sin: s.sin.get(),
            pos: s.pos.get(),
            table_off: s.table_off.get(),
            tables: s.tables.get(),
        };
        gpu.rope_store(st, &args, &mut slices)?;
        gpu.attention(st, &args, &mut slices)?;
        let wo = Product {
            w: &layer.wo,
            y: s.x.get_mut(),
            bias: None,
        };
        gpu.matmul(st, &mut [wo], s.att.get(), n, true)?;
        gpu.rms_norm(
            st,
            s.x.get(),
            &layer.ffn_norm,
            s.h.get_mut(),
            n,
            d,
            eps,
            None,
        )?;
        let (g, u) = (s.gate.get_mut(), s.up.get_mut());
        let mut gate_up = [
            Product {
                w: &layer.w_gate,
                y: g,
                bias: None,
            },
            Product {
                w: &layer.w_up,
                y: u,
                bias: None,
            },
        ];
        products(gpu, st, &mut gate_up, s.h.get(), n, false)?;
        gpu.swiglu(st, s.gate.get_mut(), s.up.get(), n * ff)?;
        let down = Product {
            w: &layer.w_down,
            y: s.x.get_mut(),
            bias: None,
        };
        gpu.matmul(st, &mut [down], s.gate.get(), n, true)?;
    }
    if m == 0 {
        return Ok(());
    }
    let out = w.output.as_ref().unwrap_or(&w.embed);
    let gather = Some((s.out_rows.get(), n));
    gpu.rms_norm(
        st,
        s.x.get(),
        &w.output_norm,
        s.h.get_mut(),
        m,
        d,
        eps,
        gather,
    )?;
    let logits = Product {
        w: out,
        y: s.logits.get_mut(),
        bias: None,
    };
    gpu.matmul(st, &mut [logits], s.h.get(), m, false)
}

/// Products of the same activations in one launch where their weights share a format (the
/// kernel's condition), one launch each otherwise (a file may keep V in another type).
fn products(
    gpu: &Gpu,
    st: &CudaStream,
    jobs: &mut [Product<'_>],
    x: &CudaSlice<f32>,
    rows: usize,
    accumulate: bool,
) -> Result<(), DriverError> {
    if jobs.iter().all(|p| p.w.format == jobs[0].w.format) {
        return gpu.matmul(st, jobs, x, rows, accumulate);
    }
    for p in jobs {
        gpu.matmul(st, std::slice::from_mut(p), x, rows, accumulate)?;
    }
    Ok(())
}

/// The step's inputs laid out for the device: tokens, positions, each row's table (one copy
/// per run of rows sharing it) and its offset, the rows that want logits, and every row's
/// RoPE angles as the CPU path computes them.
///
/// # Panics
/// When a token is outside the vocabulary or a block outside the arena: the engine's own
/// checks keep both from happening, and a kernel must never see either.
fn lay_out(llama: &Llama, rows: &[StepRow<'_>], bs: usize, num_blocks: usize, h: &mut HostStep) {
    let n_vocab = llama.embed.rows();
    h.tokens.clear();
    h.pos.clear();
    h.table_off.clear();
    h.tables.clear();
    h.out_rows.clear();
    h.cos.clear();
    h.sin.clear();
    // Rows of one entry share its table: one copy of it.
    let mut last: Option<(*const u32, usize)> = None;
    for (r, row) in rows.iter().enumerate() {
        assert!(
            (row.token as usize) < n_vocab,
            "token {} past the vocabulary",
            row.token
        );
        assert!(row.table.len() > row.pos / bs, "a row past its block table");
        let key = (row.table.as_ptr(), row.table.len());
        if last != Some(key) {
            assert!(
                row.table.iter().all(|&b| (b as usize) < num_blocks),
                "a block table past the arena"
            );
            last = Some(key);
            h.tables.extend_from_slice(row.table);
        }
        h.table_off.push((h.tables.len() - row.table.len()) as u32);
        h.tokens.push(row.token);
        h.pos.push(row.pos as u32);
        if row.logits {
            h.out_rows.push(r as u32);
        }
        llama
            .rope
            .angles(row.pos, &mut h.angle_cos, &mut h.angle_sin);
        h.cos.extend_from_slice(&h.angle_cos);
        h.sin.extend_from_slice(&h.angle_sin);
    }
}

/// A step the device could not compute: the GPU is unusable (an Xid, ECC or driver fault),
/// and so is this worker, whose weights and KV live there. It exits, as an engine on a failed
/// GPU does; its lease lapses and the frontend moves its streams elsewhere.
#[cold]
fn device_failed(e: &DriverError) -> ! {
    tracing::error!(error = %e, "a forward pass on the GPU failed: the worker cannot continue");
    std::process::exit(70)
}

impl Model for GpuModel {
    fn kv_shape(&self) -> KvShape {
        NativeModel::kv_shape_of(&self.w.llama)
    }

    /// Real compute: a step takes what it takes.
    fn step_duration_ms(&self, _: &StepPlan, _: usize) -> f64 {
        0.0
    }

    fn compute(&mut self, view: ModelView<'_>, sampled: &mut Vec<SampledToken>) {
        let rows = step_rows(&view);
        let mem = view
            .arena
            .device()
            .filter(|m| m.ordinal == self.w.gpu.ordinal());
        let Some(mem) = mem else {
            // The worker builds a GPU engine's arena on its device (`--device` sets
            // `--kv-memory`); anything else is a wiring bug, caught on the first step.
            panic!("a GPU model's KV arena must be in its device's memory");
        };
        let (blocks, block_bytes) = (view.arena.num_blocks(), view.arena.bytes_per_block());
        if let Err(e) = self.forward(&rows, mem, blocks, block_bytes) {
            device_failed(&e);
        }
        let n_vocab = self.w.llama.cfg.n_vocab;
        // (The graph keeps its hidden states on the device: no embeddings from it yet.)
        sample_step(
            &view,
            (&self.logits, n_vocab),
            None,
            &mut self.sampler,
            sampled,
        );
    }

    fn forget(&mut self, _: RequestId) {}
}

/// A KV arena in device memory, for an engine without a KV transport's region (which the
/// workers use: `--kv-memory cuda`). Host access goes through a block-sized staging copy.
pub struct DeviceArena {
    gpu_ordinal: usize,
    stream: Arc<cudarc::driver::CudaStream>,
    bytes: CudaSlice<u8>,
}

impl std::fmt::Debug for DeviceArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceArena")
            .field("ordinal", &self.gpu_ordinal)
            .field("len", &self.bytes.len())
            .finish()
    }
}

impl DeviceArena {
    /// `len` zeroed bytes on the device `gpu` is.
    pub fn new(gpu: &Gpu, len: usize) -> Result<DeviceArena, GpuError> {
        let bytes = gpu
            .stream
            .alloc_zeros::<u8>(len.max(1))
            .map_err(driver("arena"))?;
        gpu.stream.synchronize().map_err(driver("arena"))?;
        Ok(DeviceArena {
            gpu_ordinal: gpu.ordinal(),
            stream: gpu.stream.clone(),
            bytes,
        })
    }

    fn copy_out(&self, offset: usize, len: usize) -> Vec<u8> {
        let mut host = vec![0u8; len];
        let r = self
            .stream
            .memcpy_dtoh(&self.bytes.slice(offset..offset + len), &mut host)
            .and_then(|()| self.stream.synchronize());
        if let Err(e) = r {
            device_failed(&e);
        }
        host
    }
}

impl ArenaStorage for DeviceArena {
    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn read(&self, offset: usize, len: usize, f: &mut dyn FnMut(&[u8])) {
        f(&self.copy_out(offset, len));
    }

    fn write(&mut self, offset: usize, len: usize, f: &mut dyn FnMut(&mut [u8])) {
        let mut host = self.copy_out(offset, len);
        f(&mut host);
        let r = self
            .stream
            .memcpy_htod(&host, &mut self.bytes.slice_mut(offset..offset + len))
            .and_then(|()| self.stream.synchronize());
        if let Err(e) = r {
            device_failed(&e);
        }
    }

    fn read_many(&self, offsets: &[usize], len: usize, f: &mut dyn FnMut(&[&[u8]])) {
        let copies: Vec<Vec<u8>> = offsets.iter().map(|&o| self.copy_out(o, len)).collect();
        let blocks: Vec<&[u8]> = copies.iter().map(Vec::as_slice).collect();
        f(&blocks);
    }

    fn device(&self) -> Option<DeviceMemory> {
        Some(DeviceMemory {
            ordinal: self.gpu_ordinal,
            base: self.bytes.device_ptr(&self.stream).0,
            len: self.bytes.len(),
        })
    }
}

#[cfg(test)]
mod tests;
