//! The GPU's kernels as Rust calls: the CUDA source compiled by NVRTC for the device at hand,
//! and one launch function per kernel. The one module of `gpu` with `unsafe`: a kernel launch
//! is unchecked by nature, so each function here checks, before it launches, that every buffer
//! it names holds at least what the kernel will touch (the safety contract below), and the
//! KV arena's bounds are the engine's (every block id in a step's tables is inside the arena,
//! which the pool guarantees and [`Gpu::check_tables`] checks again).
//!
//! Safety contract, shared by every `unsafe` block here: the kernel's arguments are pushed in
//! the order and types `kernels.cu` declares (u64 for pointers given as addresses, i32 for
//! `int`, f32 for `float`), every device buffer is at least as long as the launch's indices
//! reach (asserted just before), and all launches go to one stream, so a buffer is never
//! written by one kernel while another reads it.
#![allow(unsafe_code)]

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DevicePtr, DriverError,
    LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::{CompileOptions, Ptx};

use super::GpuError;
use crate::kernels::WeightFormat;

/// The CUDA source of every kernel.
pub const SOURCE: &str = include_str!("kernels.cu");

/// A matrix product's block: `MM_WARPS` warps of one weight row each, over `MM_ROWS`
/// activation rows (`kernels.cu`'s constants).
const MM_WARPS: u32 = 8;
const MM_ROWS: u32 = 8;
/// Threads of a norm's block (`NORM_THREADS`) and of an attention block (`ATT_THREADS`).
const NORM_THREADS: u32 = 256;
const ATT_THREADS: u32 = 128;
/// Splits of a row's positions attention spreads over (`ATT_SPLITS`).
const ATT_SPLITS: usize = 16;
/// The widest head attention takes (`HD_MAX`).
pub const HD_MAX: usize = 256;

/// Compiles [`SOURCE`] to PTX for `arch` (`compute_90`…; None: NVRTC's default). Needs only
/// the NVRTC library, no device.
pub fn compile(arch: Option<&str>) -> Result<Ptx, GpuError> {
    // SAFETY: only tries to load the NVRTC library and closes it again.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(GpuError::Unavailable(
            "the NVRTC library (libnvrtc.so, CUDA 12 or later) is not on the library path: \
             the GPU kernels are compiled at start with it"
                .into(),
        ));
    }
    let opts = CompileOptions {
        // Batch invariance (kernels.cu): nothing fused or flushed behind the source's back.
        fmad: Some(false),
        ftz: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        options: arch
            .map(|a| vec![format!("--gpu-architecture={a}")])
            .unwrap_or_default(),
        name: Some("tandem_native.cu".into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
        .map_err(|e| GpuError::Compile(format!("{e:?}")))
}

/// One device: its context, the stream every kernel and copy goes to, and the kernels.
pub struct Gpu {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    name: String,
    /// By weight format.
    matmul: [CudaFunction; 4],
    embed: [CudaFunction; 4],
    rms_norm: CudaFunction,
    swiglu: CudaFunction,
    rope_store: CudaFunction,
    attention: CudaFunction,
    attention_combine: CudaFunction,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .field("name", &self.name)
            .finish()
    }
}

fn driver(op: &'static str) -> impl FnOnce(DriverError) -> GpuError {
    move |e| GpuError::Driver {
        op,
        detail: e.to_string(),
    }
}

/// The index of a weight format's kernels.
fn fmt_index(f: WeightFormat) -> usize {
    match f {
        WeightFormat::F32 => 0,
        WeightFormat::Q8_0 => 1,
        WeightFormat::Q4_0 => 2,
        WeightFormat::Q4_1 => 3,
    }
}

impl Gpu {
    /// Opens CUDA device `ordinal` (its primary context) and compiles the kernels for it.
    pub fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        // SAFETY: only tries to load the driver library and closes it again.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(GpuError::Unavailable(
                "the CUDA driver library (libcuda.so) is not present".into(),
            ));
        }
        cudarc::driver::result::init().map_err(driver("cuInit"))?;
        let count = CudaContext::device_count().map_err(driver("device count"))?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::Unavailable(format!(
                "no CUDA device {ordinal} ({count} present)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(driver("context"))?;
        // SAFETY: every kernel and copy goes to the one stream below, in order: there is no
        // second stream whose work the per-buffer events would have to order.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().map_err(driver("capability"))?;
        let ptx = compile(Some(&format!("compute_{major}{minor}")))?;
        let module = ctx.load_module(ptx).map_err(driver("module load"))?;
        let f = |name: &str| module.load_function(name).map_err(driver("function"));
        let name = ctx.name().unwrap_or_default();
        Ok(Gpu {
            // The null stream: ordered after the synchronous copies the KV transports make
            // into the same arena (a received block lands before the step that reads it).
            stream: ctx.default_stream(),
            matmul: [
                f("matmul_f32")?,
                f("matmul_q8_0")?,
                f("matmul_q4_0")?,
                f("matmul_q4_1")?,
            ],
            embed: [
                f("embed_f32")?,
                f("embed_q8_0")?,
                f("embed_q4_0")?,
                f("embed_q4_1")?,
            ],
            rms_norm: f("rms_norm")?,
            swiglu: f("swiglu")?,
            rope_store: f("rope_store")?,
            attention: f("attention")?,
            attention_combine: f("attention_combine")?,
            ctx,
            name,
        })
    }

    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The device's name (`NVIDIA H200`…).
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn ptr<T>(&self, s: &CudaSlice<T>) -> u64 {
        s.device_ptr(&self.stream).0
    }

    /// For each `(W, y, bias)` of `products` (one to three, all of one format and width),
    /// `y[r][o] = (accumulate ? y[r][o] : 0) + W[o] · x[r] + bias[o]` for `rows` rows, in one
    /// launch.
    pub fn matmul(
        &self,
        st: &CudaStream,
        products: &mut [Product<'_>],
        x: &CudaSlice<f32>,
        rows: usize,
        accumulate: bool,
    ) -> Result<(), DriverError> {
        assert!((1..=3).contains(&products.len()));
        let (format, cols) = (products[0].w.format, products[0].w.cols);
        assert!(x.len() >= rows * cols && cols.is_multiple_of(32));
        let mut segs = [Seg::default(); 3];
        let mut blocks = [0u32; 3];
        for (i, p) in products.iter_mut().enumerate() {
            let w = p.w;
            assert!(w.format == format && w.cols == cols);
            assert!(p.y.len() >= rows * w.rows && p.bias.is_none_or(|b| b.len() >= w.rows));
            segs[i] = Seg {
                w: self.ptr(&w.data),
                row_bytes: w.row_bytes as u64,
                n_out: w.rows as i32,
                y: self.ptr(p.y),
                bias: p.bias.map_or(0, |b| self.ptr(b)),
            };
            blocks[i] = (w.rows as u32).div_ceil(MM_WARPS);
        }
        let (nb_a, nb_b) = (blocks[0] as i32, blocks[1] as i32);
        let (k_cols, n_rows, acc) = (cols as i32, rows as i32, i32::from(accumulate));
        let cfg = LaunchConfig {
            grid_dim: (blocks.iter().sum(), (rows as u32).div_ceil(MM_ROWS), 1),
            block_dim: (32 * MM_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(&self.matmul[fmt_index(format)]);
        b.arg(&segs[0])
            .arg(&segs[1])
            .arg(&segs[2])
            .arg(&nb_a)
            .arg(&nb_b)
            .arg(&k_cols)
            .arg(x)
            .arg(&n_rows)
            .arg(&acc);
        // SAFETY: the module's contract; each segment's weights hold `n_out × row_bytes`
        // bytes (GpuMatrix), its output and bias the lengths asserted above; the unused
        // segments get no blocks.
        unsafe { b.launch(cfg) }.map(drop)
    }

    /// `x[r] = embedding row tokens[r]` for `rows` rows.
    pub fn embed(
        &self,
        st: &CudaStream,
        w: &super::GpuMatrix,
        tokens: &CudaSlice<u32>,
        rows: usize,
        x: &mut CudaSlice<f32>,
    ) -> Result<(), DriverError> {
        assert!(tokens.len() >= rows && x.len() >= rows * w.cols);
        let (row_bytes, cols) = (w.row_bytes as u64, w.cols as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(&self.embed[fmt_index(w.format)]);
        b.arg(&w.data).arg(&row_bytes).arg(&cols).arg(tokens).arg(x);
        // SAFETY: the module's contract; every token id is below the matrix's rows (the
        // caller's check, `GpuModel::compute`), the rest asserted above.
        unsafe { b.launch(cfg) }.map(drop)
    }

    /// `out[r] = rms_norm(x[src])` for `rows` rows, `src = gather[r]` or `r`.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm(
        &self,
        st: &CudaStream,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        rows: usize,
        d: usize,
        eps: f32,
        gather: Option<(&CudaSlice<u32>, usize)>,
    ) -> Result<(), DriverError> {
        assert!(w.len() >= d && out.len() >= rows * d);
        match gather {
            // Each gathered index is a row of x (the caller's: indices of the step's rows).
            Some((g, x_rows)) => assert!(g.len() >= rows && x.len() >= x_rows * d),
            None => assert!(x.len() >= rows * d),
        }
        let rows_ptr = gather.map_or(0, |(g, _)| self.ptr(g));
        let (d, cfg) = (
            d as i32,
            LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (NORM_THREADS, 1, 1),
                shared_mem_bytes: 0,
            },
        );
        let mut b = st.launch_builder(&self.rms_norm);
        b.arg(x).arg(w).arg(out).arg(&d).arg(&eps).arg(&rows_ptr);
        // SAFETY: the module's contract, lengths asserted above.
        unsafe { b.launch(cfg) }.map(drop)
    }

    /// `g = silu(g) · u` over the first `n` values.
    pub fn swiglu(
        &self,
        st: &CudaStream,
        g: &mut CudaSlice<f32>,
        u: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), DriverError> {
        assert!(g.len() >= n && u.len() >= n);
        let n64 = n as u64;
        let cfg = LaunchConfig::for_num_elems(n as u32);
        let mut b = st.launch_builder(&self.swiglu);
        b.arg(g).arg(u).arg(&n64);
        // SAFETY: the module's contract, lengths asserted above.
        unsafe { b.launch(cfg) }.map(drop)
    }

    /// RoPE on every row's Q and K, then K and V into the arena at the row's slot of layer
    /// `l` (see `kernels.cu`).
    pub fn rope_store(
        &self,
        st: &CudaStream,
        a: &LayerArgs<'_>,
        s: &mut StepSlices<'_>,
    ) -> Result<(), DriverError> {
        let sh = a.shape;
        let rows = a.rows;
        assert!(s.q.len() >= rows * sh.n_head * sh.hd && s.k.len() >= rows * sh.n_head_kv * sh.hd);
        assert!(s.v.len() >= rows * sh.n_head_kv * sh.hd);
        assert!(s.cos.len() >= rows * sh.rope_dims / 2 && s.sin.len() >= rows * sh.rope_dims / 2);
        assert!(s.pos.len() >= rows && s.table_off.len() >= rows);
        let ints = [
            a.layer as i32,
            sh.bs as i32,
            sh.n_head as i32,
            sh.n_head_kv as i32,
            sh.hd as i32,
            sh.rope_dims as i32,
            i32::from(sh.neox),
        ];
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (NORM_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(&self.rope_store);
        b.arg(&mut *s.q)
            .arg(&mut *s.k)
            .arg(s.v)
            .arg(s.cos)
            .arg(s.sin)
            .arg(s.pos)
            .arg(s.table_off)
            .arg(s.tables)
            .arg(&a.arena)
            .arg(&a.block_bytes);
        for i in &ints {
            b.arg(i);
        }
        // SAFETY: the module's contract; every row's slot is inside the arena: its block id
        // comes from its table (checked against the arena by `check_tables`), its slot from
        // its position within that block.
        unsafe { b.launch(cfg) }.map(drop)
    }

    /// Attention of every (row, query head) over the row's positions, K and V from the
    /// arena: `ATT_SPLITS` partial results each into `s.part`, then folded into `s.att`.
    pub fn attention(
        &self,
        st: &CudaStream,
        a: &LayerArgs<'_>,
        s: &mut StepSlices<'_>,
    ) -> Result<(), DriverError> {
        let sh = a.shape;
        let rows = a.rows;
        assert!(s.q.len() >= rows * sh.n_head * sh.hd && s.att.len() >= rows * sh.n_head * sh.hd);
        assert!(s.part.len() >= attention_scratch(rows, sh.n_head, sh.hd));
        assert!(s.pos.len() >= rows && s.table_off.len() >= rows && sh.hd <= HD_MAX);
        let ints = [
            a.layer as i32,
            sh.bs as i32,
            sh.n_head as i32,
            sh.n_head_kv as i32,
            sh.hd as i32,
        ];
        let scale = 1.0 / (sh.hd as f32).sqrt();
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, sh.n_head as u32, ATT_SPLITS as u32),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(&self.attention);
        b.arg(&*s.q)
            .arg(&mut *s.part)
            .arg(s.pos)
            .arg(s.table_off)
            .arg(s.tables)
            .arg(&a.arena)
            .arg(&a.block_bytes);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&scale);
        // SAFETY: as `rope_store`: every position a row reads (0..=pos) lies in a block of its
        // table, inside the arena; `part` holds every (row, head, split)'s `hd + 2` values.
        unsafe { b.launch(cfg) }?;
        let (n_head, hd) = (sh.n_head as i32, sh.hd as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, sh.n_head as u32, 1),
            block_dim: (ATT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = st.launch_builder(&self.attention_combine);
        b.arg(&*s.part).arg(&mut *s.att).arg(&n_head).arg(&hd);
        // SAFETY: the module's contract, lengths asserted above.
        unsafe { b.launch(cfg) }.map(drop)
    }
}

/// Floats of attention's partial results for `rows` rows (`kernels.cu`'s `ATT_SPLITS`
/// splits per row and head, each its maximum, sum and `hd` outputs).
pub fn attention_scratch(rows: usize, n_head: usize, hd: usize) -> usize {
    rows * n_head * ATT_SPLITS * (hd + 2)
}

/// A step's launches captured once and replayed: one launch instead of hundreds.
pub struct StepGraph(CudaGraph);

// SAFETY: a graph may be used from any thread as long as no two use it at once (the CUDA
// driver's rule for graph objects); a `StepGraph` lives in one model, which the engine
// steps through `&mut`, one step at a time.
unsafe impl Send for StepGraph {}

impl StepGraph {
    /// Captures what `launches` puts on `st` (launches only: thread-local capture mode, so
    /// other engines' allocations and copies on other threads go on meanwhile).
    pub fn capture(
        st: &Arc<CudaStream>,
        launches: impl FnOnce() -> Result<(), DriverError>,
    ) -> Result<StepGraph, DriverError> {
        st.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let launched = launches();
        // The capture ends whatever happened, or the stream stays in capture mode.
        let graph = st.end_capture(sys::CUgraphInstantiate_flags(0));
        launched?;
        Ok(StepGraph(graph?.ok_or(DriverError(
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        ))?))
    }

    pub fn launch(&self) -> Result<(), DriverError> {
        self.0.launch()
    }
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

/// One product of a fused launch: its weights, its output and its bias.
#[derive(Debug)]
pub struct Product<'a> {
    pub w: &'a super::GpuMatrix,
    pub y: &'a mut CudaSlice<f32>,
    pub bias: Option<&'a CudaSlice<f32>>,
}

/// `kernels.cu`'s `Seg`, one product of a launch, as the kernel reads it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Seg {
    w: u64,
    row_bytes: u64,
    n_out: i32,
    y: u64,
    bias: u64,
}

// SAFETY: `Seg` is `#[repr(C)]` plain data laid out as the C struct of the same name (two
// 8-byte fields, a 4-byte int padded to 8, two 8-byte pointers), passed by value.
unsafe impl cudarc::driver::DeviceRepr for Seg {}

/// The model's attention geometry, as the kernels take it.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub bs: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub hd: usize,
    pub rope_dims: usize,
    pub neox: bool,
}

/// One layer's launch of the attention kernels over a step's rows.
#[derive(Clone, Copy, Debug)]
pub struct LayerArgs<'a> {
    pub shape: &'a AttnShape,
    pub layer: usize,
    pub rows: usize,
    /// The arena's device address and its block size in bytes.
    pub arena: u64,
    pub block_bytes: u64,
}

/// The step's buffers the attention kernels use.
#[derive(Debug)]
pub struct StepSlices<'a> {
    pub q: &'a mut CudaSlice<f32>,
    pub k: &'a mut CudaSlice<f32>,
    pub v: &'a CudaSlice<f32>,
    pub att: &'a mut CudaSlice<f32>,
    /// Attention's partial results ([`attention_scratch`]).
    pub part: &'a mut CudaSlice<f32>,
    pub cos: &'a CudaSlice<f32>,
    pub sin: &'a CudaSlice<f32>,
    pub pos: &'a CudaSlice<u32>,
    pub table_off: &'a CudaSlice<u32>,
    pub tables: &'a CudaSlice<u32>,
}
