//! tandem's native engine: GGUF models computed on tandem's paged KV.
//!
//! **Job.** Load a model from a GGUF file (the Llama family; Qwen2 with its QKV biases) and
//! compute it on the CPU with tandem's own kernels, as the engine's [`tandem_engine::Model`]:
//! one step computes every scheduled row — prefill chunks and decode tokens of all running
//! requests — as one activation matrix, K and V written into the engine's KV arena through
//! the block tables and read back from there by attention. Its tokenizer and chat template
//! come from the same file.
//!
//! **Layout.**
//! - [`gguf`]: [`GgufFile`], the file read once into memory and checked; its metadata
//!   ([`Value`], typed getters) and its tensors ([`TensorInfo`], [`Tensor`] views of the
//!   bytes).
//! - [`quant`]: [`GgmlType`] with ggml's ids and block geometry, and [`dequantize_row`], the
//!   scalar dequantizers of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K.
//! - [`kernels`]: the dot products the forward pass is made of (Q4_0, Q4_1, Q8_0 weights
//!   against 8-bit activations, f32; attention over f16 K and V), portable, AVX2, AVX-VNNI
//!   and AVX-512 VNNI, chosen at run time, bit for bit the same.
//! - [`tensor`]: weight matrices in the kernels' formats, and a step's activation rows.
//! - [`llama`]: the configuration and the forward pass over the paged KV; [`load()`] builds
//!   one from a file ([`Precision`]: the file's formats, or all f32 as a reference).
//! - [`model`]: [`NativeModel`], the forward pass and the sampler as the engine's model.
//! - [`sampling`]: greedy and seeded temperature / top-k / top-p / min-p draws.
//! - [`kv`]: [`KvDtype`], what K and V are stored as (f16 by default, or f32), and the
//!   conversion of a block between them.
//! - [`tokenizer`]: the file's byte-level BPE tokenizer and its special tokens.
//! - [`team`]: the worker's threads, which spin briefly between a step's parallel regions,
//!   linger yielding between steps, and sleep when the worker is idle.
//! - `error`: [`Error`], classified by [`Error::class`].
//! - [`device`]: [`Device`], where the engine computes; `gpu` (feature `cuda`): the forward
//!   pass on an NVIDIA GPU, its kernels compiled at run time (see its docs).
//!
//! **Invariants.**
//! - `unsafe` lives in four audited modules, each block with a `// SAFETY:`: `kernels/simd/`
//!   (the SIMD intrinsics and prefetches), [`team`] (a parallel region's closure called through a
//!   pointer by the worker's threads, which `Team::run` outlives), [`malloc`] (one `mallopt`)
//!   and, with the `cuda` feature, `gpu/device.rs` (kernel launches). The file is read into a
//!   `Vec<u8>` (no memory mapping).
//! - Bounds are checked at parse time, once: every length and count against the bytes left
//!   (a hostile count never sizes an allocation beyond what the remaining bytes could hold),
//!   every tensor's type, shape and extent against the data section. Bad input is an
//!   [`Error`], never a panic; a [`Tensor`] handed out is in bounds and of a supported type.
//! - Dequantization is ggml's reference arithmetic, operation for operation, so it is
//!   bitwise equal to ggml's `dequantize_row_*` (tests/gguf_interop.rs checks it against
//!   gguf-py, the GGUF authors' own implementation).
//! - **Batch invariance**: a request's logits are bitwise the same whether its prompt is
//!   computed in one step or in chunks, alone or batched, on one thread or several, from a
//!   prefix hit, or from KV copied into another arena at other block ids (every operation
//!   works per row; attention reads f16 K/V from the arena, the step's own tokens included;
//!   tests/engine.rs). It is what makes disaggregated serving and migration give exactly the
//!   tokens of aggregated, uninterrupted serving.
//!
//! **Why own kernels.** The well-kept crate for this, candle, has a scalar Q4_1 kernel
//! (7.6–9.1 tok/s decode measured on this 2-core machine against llama.cpp's 59.7) and its
//! quantized Llama keeps a private contiguous KV cache, not chunk-invariant; a plain Rust
//! Q4_1 × Q8 dot product was 5× faster. So the kernels are ours, behind one small interface
//! with run-time CPU-feature dispatch and a portable path the tests hold the SIMD one to.

pub mod device;
pub mod gguf;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kernels;
pub mod kv;
pub mod llama;
pub mod load;
pub mod malloc;
pub mod model;
pub mod quant;
pub mod sampling;
pub mod team;
pub mod tensor;
pub mod tokenizer;

mod error;

pub use device::Device;
pub use error::{Error, ErrorClass, GgmlTypeId};
pub use gguf::{Array, GgufFile, Tensor, TensorInfo, Value, ValueType};
pub use kernels::{Isa, Kernels};
pub use kv::KvDtype;
pub use llama::{Llama, LlamaConfig};
pub use load::{Precision, load};
pub use model::NativeModel;
pub use quant::{GgmlType, dequantize_row};
