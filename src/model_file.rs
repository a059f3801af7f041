//! `--model PATH.gguf` (or a named model, `crate::models`): a GGUF model the native engine computes (real tokens), loaded once per
//! process and shared by every engine in it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tandem_native::{Device, GgufFile, Isa, Kernels, Llama, Precision};
use tandem_worker::{KvMemory, NativeEngine, WorkerConfig};

/// A loaded GGUF model and what the frontend takes from the same file.
#[derive(Clone, Debug)]
pub struct ModelFile {
    pub path: PathBuf,
    /// The `--model` value that loads it again under the same name (another process's).
    pub flag: String,
    /// The name it is served under: the file's stem (`SmolLM2-135M-Instruct.Q4_1`).
    pub name: String,
    pub llama: Arc<Llama>,
    /// The context it was trained for (`<arch>.context_length`).
    pub context_length: u32,
    pub eos_token: Option<u32>,
    /// Its weights on each GPU a worker of this process computes on (`--device cuda`).
    #[cfg(feature = "cuda")]
    gpu: Arc<parking_lot::Mutex<Vec<Arc<tandem_native::gpu::GpuWeights>>>>,
}

/// How long a decode worker of the native engine waits for a remote prefill.
pub const NATIVE_PREFILL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl ModelFile {
    /// `--model`'s value, when it names a GGUF file (a path ending in `.gguf`, or a named model
    /// of `crate::models`, fetched on first use); loads it. Any other value is a served name
    /// for the mocker: `None`.
    pub async fn from_flag(
        model: &str,
        cache: &crate::models::ModelCacheArgs,
    ) -> anyhow::Result<Option<ModelFile>> {
        let (path, name) = if model.ends_with(".gguf") {
            let path = PathBuf::from(model);
            let stem = path
                .file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| model.to_string());
            (path, stem)
        } else if let Some(named) = crate::models::named(model) {
            (named.ensure(cache).await?, named.name.to_string())
        } else {
            return Ok(None);
        };
        // A process that computes with the model: its threads outnumber the cores (see
        // tandem_native::malloc).
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        tandem_native::malloc::cap_arenas(cores);
        let file = GgufFile::read(&path).with_context(|| format!("--model {model}"))?;
        let llama = tandem_native::load(&file, Precision::Quantized)
            .with_context(|| format!("--model {model}"))?;
        let context_length = u32::try_from(llama.cfg.n_ctx).unwrap_or(u32::MAX);
        let eos_token = tandem_native::tokenizer::info(&file)
            .with_context(|| format!("--model {model}"))?
            .eos;
        tracing::info!(
            model = %path.display(),
            arch = llama.cfg.arch.name(),
            layers = llama.cfg.n_layer,
            context_length,
            "model loaded"
        );
        Ok(Some(ModelFile {
            path,
            flag: model.to_string(),
            name,
            llama: Arc::new(llama),
            context_length,
            eos_token,
            #[cfg(feature = "cuda")]
            gpu: Default::default(),
        }))
    }

    /// `c` computing this model with the native engine as `engine`'s flags say: on
    /// `--device` (the CPU with `--threads`, `default_threads` unless given; or a GPU, its KV
    /// arena then in that GPU's memory), its device blocks what `--kv-memory-mb` holds, its
    /// name the model's, its step at most `--max-batched-tokens` tokens (unset:
    /// [`NATIVE_MAX_BATCHED_TOKENS`] on the CPU, [`GPU_MAX_BATCHED_TOKENS`] on a GPU).
    pub fn configure(
        &self,
        c: &mut WorkerConfig,
        engine: &NativeFlags,
        default_threads: usize,
    ) -> anyhow::Result<()> {
        c.model = self.name.clone();
        // A decode worker gives a remote prefill this long before it prefills locally: on
        // CPUs a long prompt's prefill takes tens of seconds (3,000 tokens on 2 cores: ~15 s),
        // and past the mocker's 5 s every long prompt was prefilled twice.
        c.prefill_timeout = NATIVE_PREFILL_TIMEOUT;
        let step_default = match engine.device {
            Device::Cpu => NATIVE_MAX_BATCHED_TOKENS,
            Device::Cuda(_) => GPU_MAX_BATCHED_TOKENS,
        };
        c.engine.scheduler.max_num_batched_tokens =
            engine.max_batched_tokens.unwrap_or(step_default);
        let threads = engine.threads.unwrap_or(default_threads);
        c.native = Some(self.engine(threads, engine.device)?);
        if let Some(n) = &mut c.native {
            anyhow::ensure!(
                engine.kv_dtype == tandem_native::KvDtype::F16 || engine.device == Device::Cpu,
                "--kv-dtype {}: the GPU engine keeps its KV in f16",
                engine.kv_dtype
            );
            n.kv_dtype = engine.kv_dtype;
        }
        if let Device::Cuda(ordinal) = engine.device {
            match c.kv_memory {
                KvMemory::Host => c.kv_memory = KvMemory::Cuda { ordinal },
                KvMemory::Cuda { ordinal: o } => anyhow::ensure!(
                    o == ordinal,
                    "--device cuda:{ordinal} computes with its KV arena on that GPU, not on \
                     cuda:{o} (--kv-memory)"
                ),
            }
        }
        let kv_memory_mb = engine.kv_memory_mb;
        let per_block = c.bytes_per_block() as u64;
        let blocks = (kv_memory_mb << 20) / per_block.max(1);
        anyhow::ensure!(
            blocks >= 2,
            "--kv-memory-mb {kv_memory_mb} holds {blocks} KV blocks of {per_block} bytes: at \
             least 2 are needed"
        );
        c.engine.pool.device_blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        Ok(())
    }

    /// The native engine of a worker computing this model on `device` (on the CPU with
    /// `threads` threads). On a GPU the weights go there once per process, shared by its
    /// workers.
    pub fn engine(&self, threads: usize, device: Device) -> anyhow::Result<NativeEngine> {
        #[cfg(not(feature = "cuda"))]
        anyhow::ensure!(
            device == Device::Cpu,
            "--device {device}: this tandem was built without GPU support (build it with \
             `cargo build --release --features cuda`)"
        );
        Ok(NativeEngine {
            model: self.llama.clone(),
            kernels: Kernels::new(Isa::detect()),
            threads: threads.max(1),
            eos_token: self.eos_token,
            #[cfg(feature = "cuda")]
            gpu: match device {
                Device::Cpu => None,
                Device::Cuda(ordinal) => Some(self.gpu_weights(ordinal)?),
            },
            kv_dtype: tandem_native::KvDtype::F16,
        })
    }

    /// The weights on GPU `ordinal`, uploaded by the first worker that asks.
    #[cfg(feature = "cuda")]
    fn gpu_weights(&self, ordinal: usize) -> anyhow::Result<Arc<tandem_native::gpu::GpuWeights>> {
        let mut uploaded = self.gpu.lock();
        if let Some(w) = uploaded.iter().find(|w| w.gpu().ordinal() == ordinal) {
            return Ok(w.clone());
        }
        let w = tandem_native::gpu::GpuWeights::upload(self.llama.clone(), ordinal)
            .with_context(|| format!("--device cuda:{ordinal}"))?;
        tracing::info!(
            gpu = w.gpu().name(),
            ordinal,
            weights_mb = w.bytes() >> 20,
            "model weights on the GPU"
        );
        uploaded.push(w.clone());
        Ok(w)
    }
}

/// The engine flags the native engine takes (`EngineArgs`'s, for [`ModelFile::configure`]).
#[derive(Clone, Copy, Debug)]
pub struct NativeFlags {
    pub threads: Option<usize>,
    pub kv_memory_mb: u64,
    pub max_batched_tokens: Option<usize>,
    pub device: Device,
    pub kv_dtype: tandem_native::KvDtype,
}

/// Tokens per step of the mocker unless `--max-batched-tokens` says: vLLM's on a GPU.
pub const MOCKER_MAX_BATCHED_TOKENS: usize = 8192;

/// Tokens per step of the native engine on a GPU unless `--max-batched-tokens` says: a GPU
/// computes a long prompt's chunk in milliseconds, and its step buffers are small beside
/// its memory (vLLM's default chunk is 2,048 tokens too).
pub const GPU_MAX_BATCHED_TOKENS: usize = 2048;

/// Tokens per step of the native engine on the CPU unless `--max-batched-tokens` says. Its step buffers
/// (activations, the FFN's two `n_ff`-wide products, attention's) are sized by the step's
/// rows: about 30 KB per row for SmolLM2-135M, so 8192 rows took 250 MB more than weights
/// and KV, where 512 take 15 MB; and a CPU computes a prompt as fast per token in 512-token
/// chunks (the matrix kernels work in 32-row tiles), while a step of decode rows between
/// two chunks waits less.
pub const NATIVE_MAX_BATCHED_TOKENS: usize = 512;

/// The cores this process may use.
pub fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}
