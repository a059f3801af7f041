//! `EngineArgs`: the flags of a worker's in-process engine (the mocker's timing, the native
//! engine's threads, KV memory, device, KV type and disk tier), shared by `tandem up` and the
//! worker roles.

use anyhow::Context;
use clap::Args;
use tandem_engine::{MockerConfig, SchedulerConfig};
use tandem_protocol::{BlockSize, WorkerId, WorkerRole};
use tandem_worker::WorkerConfig;

/// The engine of a worker (the mocker model).
#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Tokens per KV block; the frontend refuses workers with another.
    #[arg(long, env = "TANDEM_BLOCK_SIZE", default_value_t = 16)]
    pub block_size: u32,
    /// Device KV blocks.
    #[arg(long, env = "TANDEM_DEVICE_BLOCKS", default_value_t = 8192)]
    pub device_blocks: u32,
    /// Host KV blocks (0: no host tier).
    #[arg(long, env = "TANDEM_HOST_BLOCKS", default_value_t = 0)]
    pub host_blocks: u32,
    /// Tokens per engine step (default: 8192 for the mocker, as vLLM's GPU default; 512 for
    /// the native engine, whose step buffers grow with it: a CPU prefills as fast per token
    /// in 512-token chunks, and the worker stays within weights + KV + 100 MB).
    #[arg(long, env = "TANDEM_MAX_BATCHED_TOKENS")]
    pub max_batched_tokens: Option<usize>,
    /// Running requests per engine at most.
    #[arg(long, env = "TANDEM_MAX_NUM_SEQS", default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Requests waiting in the engine's queue at most; beyond it the worker answers busy and
    /// the frontend routes elsewhere or queues.
    #[arg(long, env = "TANDEM_MAX_WAITING", default_value_t = SchedulerConfig::default().max_waiting)]
    pub max_waiting: usize,
    /// Divide every mocker step time by this (faster than a real GPU when above 1).
    #[arg(long, env = "TANDEM_SPEEDUP_RATIO", default_value_t = 1.0)]
    pub speedup_ratio: f64,
    /// LoRA adapters one engine step may use at most, as vLLM's --max-loras: a request on
    /// another adapter waits for a slot, and loading one costs its step --adapter-load-ms.
    /// The worker reports the adapters it holds to the router. 0: not limited, no load
    /// modelled.
    #[arg(long, env = "TANDEM_MAX_LORAS", default_value_t = SchedulerConfig::default().max_loras)]
    pub max_loras: usize,
    /// Milliseconds a mocker step spends loading each LoRA adapter it needs and does not
    /// hold (with --max-loras; not divided by --speedup-ratio).
    #[arg(long, env = "TANDEM_ADAPTER_LOAD_MS", default_value_t = MockerConfig::default().adapter_load_ms)]
    pub adapter_load_ms: f64,
    /// The native engine's threads per worker (default: the cores the worker may use; under
    /// `tandem up`, those cores shared among its workers).
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// The native engine's KV memory per worker, MiB: its device blocks are as many as fit
    /// (K and V in f16; --device-blocks applies to the mocker).
    #[arg(long, env = "TANDEM_KV_MEMORY_MB", default_value_t = 512)]
    pub kv_memory_mb: u64,
    /// Where the native engine computes: cpu, or cuda / cuda:N (an NVIDIA GPU: the weights
    /// and the KV arena in its memory; needs a build with `--features cuda`, the driver and
    /// NVRTC, the kernels' run-time compiler).
    #[arg(long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: tandem_native::Device,
    /// A disk tier for the engine's KV, after device and host memory: blocks evicted from the
    /// tier above are written to a file in this directory (checksummed records; one that does
    /// not read back intact is a miss) and read back on a prefix hit, and a restarted worker
    /// reloads them and announces them. `tandem up` gives each worker a directory of its own
    /// under it (`prefill-0`, `decode-0`, …).
    #[arg(long, env = "TANDEM_KV_DISK_DIR")]
    pub kv_disk_dir: Option<std::path::PathBuf>,
    /// What the native engine stores K and V as: f16 (half the memory) or f32. A decode
    /// worker converts KV from a prefill worker of the other type as it arrives (f32 to f16
    /// rounds to nearest even); the GPU engine keeps f16.
    #[arg(long, env = "TANDEM_KV_DTYPE", default_value = "f16")]
    pub kv_dtype: tandem_native::KvDtype,
    /// The disk tier's size per worker, MiB (with --kv-disk-dir).
    #[arg(long, env = "TANDEM_KV_DISK_MB", default_value_t = 4096)]
    pub kv_disk_mb: u64,
}

impl EngineArgs {
    /// A worker's config from these engine flags, with lifecycle defaults.
    pub fn config(
        &self,
        role: WorkerRole,
        id: WorkerId,
        model: &str,
        namespace: &str,
    ) -> anyhow::Result<WorkerConfig> {
        let mut c = WorkerConfig::new(id, role);
        c.model = model.to_string();
        c.namespace = namespace.to_string();
        c.engine.pool.block_size = BlockSize::new(self.block_size).context("--block-size")?;
        c.engine.pool.device_blocks = self.device_blocks;
        c.engine.pool.host_blocks = self.host_blocks;
        c.engine.scheduler = SchedulerConfig {
            max_num_batched_tokens: self
                .max_batched_tokens
                .unwrap_or(crate::model_file::MOCKER_MAX_BATCHED_TOKENS),
            max_num_seqs: self.max_num_seqs,
            max_waiting: self.max_waiting,
            max_loras: self.max_loras,
            ..Default::default()
        };
        c.engine.mocker.speedup_ratio = self.speedup_ratio;
        if !(self.adapter_load_ms.is_finite() && self.adapter_load_ms >= 0.0) {
            anyhow::bail!(
                "--adapter-load-ms must be a finite number of milliseconds >= 0, got {}",
                self.adapter_load_ms
            );
        }
        c.engine.mocker.adapter_load_ms = self.adapter_load_ms;
        c.kv_disk = self
            .kv_disk_dir
            .as_ref()
            .map(|dir| tandem_worker::KvDiskConfig {
                dir: dir.clone(),
                bytes: self.kv_disk_mb << 20,
            });
        Ok(c)
    }

    /// The flags the native engine takes.
    pub fn native(&self) -> crate::model_file::NativeFlags {
        crate::model_file::NativeFlags {
            threads: self.threads,
            kv_memory_mb: self.kv_memory_mb,
            max_batched_tokens: self.max_batched_tokens,
            device: self.device,
            kv_dtype: self.kv_dtype,
        }
    }

    /// These flags as a worker process takes them (`tandem up --processes`): every field.
    pub fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            format!("--block-size={}", self.block_size),
            format!("--device-blocks={}", self.device_blocks),
            format!("--host-blocks={}", self.host_blocks),
            format!("--max-num-seqs={}", self.max_num_seqs),
            format!("--max-waiting={}", self.max_waiting),
            format!("--speedup-ratio={}", self.speedup_ratio),
            format!("--max-loras={}", self.max_loras),
            format!("--adapter-load-ms={}", self.adapter_load_ms),
            format!("--kv-memory-mb={}", self.kv_memory_mb),
            format!("--device={}", self.device),
            format!("--kv-dtype={}", self.kv_dtype),
            format!("--kv-disk-mb={}", self.kv_disk_mb),
        ];
        if let Some(n) = self.max_batched_tokens {
            a.push(format!("--max-batched-tokens={n}"));
        }
        if let Some(n) = self.threads {
            a.push(format!("--threads={n}"));
        }
        if let Some(dir) = &self.kv_disk_dir {
            a.push(format!("--kv-disk-dir={}", dir.display()));
        }
        a
    }

    /// These flags for worker `name` of `tandem up` (`decode-0`…): its disk tier in a
    /// directory of its own under --kv-disk-dir.
    pub fn for_worker(&self, name: &str) -> EngineArgs {
        let mut args = self.clone();
        args.kv_disk_dir = self.kv_disk_dir.as_ref().map(|d| d.join(name));
        args
    }
}
