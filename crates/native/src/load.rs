//! A [`Llama`] from a GGUF file: hyperparameters from its metadata, weights in the kernels'
//! formats.

use crate::Error;
use crate::gguf::{GgufFile, Tensor};
use crate::kernels::{QK, WeightFormat};
use crate::llama::{Arch, Layer, Llama, LlamaConfig, Rope, RopeScaling};
use crate::quant::GgmlType;
use crate::tensor::Matrix;

/// How the weights are held for compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// As in the file where a kernel reads the format directly (Q4_0, Q4_1, Q8_0, F32), with
    /// 8-bit activations against quantized weights; other types dequantized to f32 at load.
    #[default]
    Quantized,
    /// Everything dequantized to f32, activations in f32: the reference mode that an
    /// independent f32 forward pass is compared with (`tests/logits.rs`).
    F32,
}

/// Reads the model's configuration from `file`'s metadata.
pub fn config(file: &GgufFile) -> Result<LlamaConfig, Error> {
    let name = file.architecture()?;
    let arch = Arch::from_name(name).ok_or_else(|| Error::UnknownArchitecture {
        name: name.to_owned(),
    })?;
    let key = |k: &str| format!("{name}.{k}");
    let n_embd = file.get_u32(&key("embedding_length"))? as usize;
    let n_head = file.get_u32(&key("attention.head_count"))? as usize;
    let n_head_kv = file
        .get_opt::<u32>(&key("attention.head_count_kv"))?
        .map_or(n_head, |v| v as usize);
    let head_dim = n_embd.checked_div(n_head).unwrap_or(0);
    let head_dim = file
        .get_opt::<u32>(&key("attention.key_length"))?
        .map_or(head_dim, |v| v as usize);
    let n_vocab = match file.get_opt::<u32>(&key("vocab_size"))? {
        Some(v) => v as usize,
        None => file.get_str_array("tokenizer.ggml.tokens")?.len(),
    };
    let rope_scaling = match file.get_opt::<&str>(&key("rope.scaling.type"))? {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: file.get_f32(&key("rope.scaling.factor"))?,
        },
        Some("yarn") => RopeScaling::Yarn {
            factor: file.get_f32(&key("rope.scaling.factor"))?,
            original_context: file.get_u32(&key("rope.scaling.original_context_length"))?,
            beta_fast: file
                .get_opt::<f32>(&key("rope.scaling.yarn_beta_fast"))?
                .unwrap_or(32.0),
            beta_slow: file
                .get_opt::<f32>(&key("rope.scaling.yarn_beta_slow"))?
                .unwrap_or(1.0),
        },
        Some(other) => {
            return Err(Error::InvalidModel {
                reason: format!("RoPE scaling {other:?} is not one tandem computes (linear, yarn)"),
            });
        }
    };
    let cfg = LlamaConfig {
        arch,
        n_layer: file.get_u32(&key("block_count"))? as usize,
        n_embd,
        n_head,
        n_head_kv,
        head_dim,
        n_ff: file.get_u32(&key("feed_forward_length"))? as usize,
        n_vocab,
        n_ctx: file.get_u32(&key("context_length"))? as usize,
        rms_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
        rope_base: file
            .get_opt::<f32>(&key("rope.freq_base"))?
            .unwrap_or(10_000.0),
        rope_dims: file
            .get_opt::<u32>(&key("rope.dimension_count"))?
            .map_or(head_dim, |v| v as usize),
        rope_scaling,
    };
    cfg.validate()
        .map_err(|reason| Error::InvalidModel { reason })?;
    Ok(cfg)
}

/// Loads the whole model.
pub fn load(file: &GgufFile, precision: Precision) -> Result<Llama, Error> {
    let cfg = config(file)?;
    let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
    let tensor = |name: &str| {
        file.tensor(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_owned(),
        })
    };
    let matrix = |name: &str, rows: usize, cols: usize| -> Result<Matrix, Error> {
        to_matrix(tensor(name)?, rows, cols, precision)
    };
    let vector = |name: &str, len: usize| -> Result<Vec<f32>, Error> {
        let t = tensor(name)?;
        check_shape(&t, &[len])?;
        t.dequantize()
    };
    let mut layers = Vec::with_capacity(cfg.n_layer);
    for i in 0..cfg.n_layer {
        let p = |n: &str| format!("blk.{i}.{n}");
        let bias = if cfg.arch.has_qkv_bias() {
            Some([
                vector(&p("attn_q.bias"), qd)?,
                vector(&p("attn_k.bias"), kvd)?,
                vector(&p("attn_v.bias"), kvd)?,
            ])
        } else {
            None
        };
        layers.push(Layer {
            attn_norm: vector(&p("attn_norm.weight"), d)?,
            wq: matrix(&p("attn_q.weight"), qd, d)?,
            wk: matrix(&p("attn_k.weight"), kvd, d)?,
            wv: matrix(&p("attn_v.weight"), kvd, d)?,
            bias,
            wo: matrix(&p("attn_output.weight"), d, qd)?,
            ffn_norm: vector(&p("ffn_norm.weight"), d)?,
            w_gate: matrix(&p("ffn_gate.weight"), ff, d)?,
            w_up: matrix(&p("ffn_up.weight"), ff, d)?,
            w_down: matrix(&p("ffn_down.weight"), d, ff)?,
        });
    }
    let freq_factors = match file.tensor("rope_freqs.weight") {
        Some(t) => {
            check_shape(&t, &[cfg.rope_dims / 2])?;
            Some(t.dequantize()?)
        }
        None => None,
    };
    let output = match file.tensor("output.weight") {
        Some(t) => Some(to_matrix(t, cfg.n_vocab, d, precision)?),
        None => None,
    };
    Ok(Llama {
        rope: Rope::new(&cfg, freq_factors.as_deref()),
        embed: matrix("token_embd.weight", cfg.n_vocab, d)?,
        layers,
        output_norm: vector("output_norm.weight", d)?,
        output,
        cfg,
    })
}

fn check_shape(t: &Tensor<'_>, expected: &[usize]) -> Result<(), Error> {
    if t.dims() == expected {
        Ok(())
    } else {
        Err(Error::TensorShape {
            tensor: t.name().to_owned(),
            dims: t.dims().to_vec(),
            expected: expected.to_vec(),
        })
    }
}

/// A `rows × cols` weight (ggml dims `[cols, rows]`) in the format the kernels read.
fn to_matrix(
    t: Tensor<'_>,
    rows: usize,
    cols: usize,
    precision: Precision,
) -> Result<Matrix, Error> {
    check_shape(&t, &[cols, rows])?;
    let direct = match (precision, t.ty()) {
        (Precision::Quantized, GgmlType::Q4_0) => Some(WeightFormat::Q4_0),
        (Precision::Quantized, GgmlType::Q4_1) => Some(WeightFormat::Q4_1),
        (Precision::Quantized, GgmlType::Q8_0) => Some(WeightFormat::Q8_0),
        (_, GgmlType::F32) => Some(WeightFormat::F32),
        _ => None,
    };
    let invalid = || Error::InvalidModel {
        reason: format!(
            "tensor {:?}: rows of {cols} values are not whole 32-value blocks",
            t.name()
        ),
    };
    if !cols.is_multiple_of(QK) {
        return Err(invalid());
    }
    let matrix = match direct {
        Some(format) => Matrix::new(format, rows, cols, t.data().to_vec()),
        None => Matrix::from_f32(rows, cols, &t.dequantize()?),
    };
    matrix.ok_or_else(invalid)
}
