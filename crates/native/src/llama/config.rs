//! A Llama-family model's hyperparameters, from its GGUF metadata.

/// The architectures the forward pass computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    /// `llama` (Llama 2/3, SmolLM, Mistral…): RoPE on adjacent pairs (ggml's "normal" mode,
    /// the converter permuted Q and K for it), no attention biases.
    Llama,
    /// `qwen2`: Q, K and V biases, RoPE on the two halves of a head (ggml's NeoX mode).
    Qwen2,
}

impl Arch {
    /// The architecture named by `general.architecture`, if the pass computes it.
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }

    /// RoPE rotates `(x[i], x[i + d/2])` rather than `(x[2i], x[2i + 1])`.
    pub fn rope_neox(self) -> bool {
        matches!(self, Arch::Qwen2)
    }

    pub fn has_qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2)
    }
}

/// How positions are stretched for contexts past the trained one.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (`rope.scaling.type = linear`).
    Linear {
        factor: f32,
    },
    /// YaRN (`rope.scaling.type = yarn`): ramped interpolation between the original and the
    /// stretched frequencies, and a magnitude correction, as ggml's `rope_yarn`.
    Yarn {
        factor: f32,
        original_context: u32,
        beta_fast: f32,
        beta_slow: f32,
    },
}

/// Everything the forward pass needs to know about the model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    /// The trained context (`context_length`).
    pub n_ctx: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    /// Dimensions of a head RoPE rotates (`rope.dimension_count`, default the whole head).
    pub rope_dims: usize,
    pub rope_scaling: RopeScaling,
}

impl LlamaConfig {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_head / self.n_head_kv
    }

    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Checks the shapes hang together; the reason when they do not.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_count", self.n_layer),
            ("embedding_length", self.n_embd),
            ("attention.head_count", self.n_head),
            ("attention.head_count_kv", self.n_head_kv),
            ("feed_forward_length", self.n_ff),
            ("vocabulary", self.n_vocab),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} is 0"));
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(format!(
                "{} heads do not share {} KV heads evenly",
                self.n_head, self.n_head_kv
            ));
        }
        if !self.head_dim.is_multiple_of(2)
            || self.rope_dims > self.head_dim
            || !self.rope_dims.is_multiple_of(2)
        {
            return Err(format!(
                "head dimension {} with {} rotated dimensions",
                self.head_dim, self.rope_dims
            ));
        }
        for (name, v) in [
            ("embedding_length", self.n_embd),
            ("feed_forward_length", self.n_ff),
            ("the attention width", self.q_dim()),
        ] {
            if v % crate::kernels::QK != 0 {
                return Err(format!("{name} {v} is not a multiple of 32"));
            }
        }
        if !(self.rms_eps > 0.0 && self.rope_base > 0.0) {
            return Err("the RMS epsilon and the RoPE base must be positive".into());
        }
        Ok(())
    }
}
