//! `--model PATH.gguf` (or a named model, `crate::models`): a GGUF model the native engine computes (real tokens), loaded once per
//! process and shared by every engine in it.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tandem_native::{GgufFile, Isa, Kernels, Llama, Precision};
use tandem_worker::{NativeEngine, WorkerConfig};

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
        }))
    }

    /// `c` computing this model with the native engine on `threads` threads: its device
    /// blocks are what `kv_memory_mb` (--kv-memory-mb) holds, its name the model's, its
    /// step at most `max_batched_tokens` tokens (unset: [`NATIVE_MAX_BATCHED_TOKENS`]).
    pub fn configure(
        &self,
        c: &mut WorkerConfig,
        threads: usize,
        kv_memory_mb: u64,
        max_batched_tokens: Option<usize>,
    ) -> anyhow::Result<()> {
        c.model = self.name.clone();
        // A decode worker gives a remote prefill this long before it prefills locally: on
        // CPUs a long prompt's prefill takes tens of seconds (3,000 tokens on 2 cores: ~15 s),
        // and past the mocker's 5 s every long prompt was prefilled twice.
        c.prefill_timeout = NATIVE_PREFILL_TIMEOUT;
        c.engine.scheduler.max_num_batched_tokens =
            max_batched_tokens.unwrap_or(NATIVE_MAX_BATCHED_TOKENS);
        c.native = Some(self.engine(threads));
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

    /// The native engine of a worker computing this model on `threads` threads.
    pub fn engine(&self, threads: usize) -> NativeEngine {
        NativeEngine {
            model: self.llama.clone(),
            kernels: Kernels::new(Isa::detect()),
            threads: threads.max(1),
            eos_token: self.eos_token,
        }
    }
}

/// Tokens per step of the mocker unless `--max-batched-tokens` says: vLLM's on a GPU.
pub const MOCKER_MAX_BATCHED_TOKENS: usize = 8192;

/// Tokens per step of the native engine unless `--max-batched-tokens` says. Its step buffers
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
