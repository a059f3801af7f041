//! The tokenizer a GGUF file describes (`tokenizer.ggml.*`), built on Hugging Face's
//! `tokenizers` crate: byte-level BPE from the file's tokens and merges, the pre-tokenizer
//! `tokenizer.ggml.pre` names (its split expressions as llama.cpp's `llama-vocab.cpp` lists
//! them), control tokens as special added tokens.
//!
//! Built this way, a GGUF tokenizes exactly as the model's own `tokenizer.json`: no prefix
//! space is added (a ready-made GGUF tokenizer that adds one gets SmolLM2's ids wrong).

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use crate::Error;
use crate::gguf::GgufFile;

/// GGUF token types (`tokenizer.ggml.token_type`), as llama.cpp numbers them.
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// Llama 3's and Qwen2's split expressions (their `tokenizer.json`s'; llama.cpp's
/// `llama-vocab.cpp` has them too). GPT-2's own expression byte-level BPE applies by itself
/// (`use_regex`).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What else the file says about its tokens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizerInfo {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Whether a BOS token goes before a prompt (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// `tokenizer.chat_template`, a Hugging Face Jinja template.
    pub chat_template: Option<String>,
}

/// The file's facts about its tokens besides the vocabulary.
pub fn info(file: &GgufFile) -> Result<TokenizerInfo, Error> {
    Ok(TokenizerInfo {
        bos: file.get_opt::<u32>("tokenizer.ggml.bos_token_id")?,
        eos: file.get_opt::<u32>("tokenizer.ggml.eos_token_id")?,
        add_bos: file
            .get_opt::<bool>("tokenizer.ggml.add_bos_token")?
            .unwrap_or(false),
        chat_template: file
            .get_opt::<&str>("tokenizer.chat_template")?
            .map(str::to_owned),
    })
}

/// The tokenizer `file` describes.
pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, Error> {
    let invalid = |reason: String| Error::InvalidModel { reason };
    let model = file.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(invalid(format!(
            "tokenizer.ggml.model {model:?}: tandem builds byte-level BPE tokenizers (\"gpt2\") only"
        )));
    }
    let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
    let merges = file.get_str_array("tokenizer.ggml.merges")?;
    let types = file.get_opt::<&[i32]>("tokenizer.ggml.token_type")?;
    let pre = file
        .get_opt::<&str>("tokenizer.ggml.pre")?
        .unwrap_or("default");
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| invalid(format!("merge {m:?} is not two tokens")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| invalid(format!("BPE: {e}")))?;
    let mut tok = Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    tok.with_decoder(Some(ByteLevel::default()));
    if let Some(types) = types {
        let added = |kind: i32, special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(types)
                .filter(|(_, t)| **t == kind)
                .map(|(s, _)| AddedToken::from(s.clone(), special))
                .collect()
        };
        tok.add_special_tokens(&added(CONTROL, true));
        tok.add_tokens(&added(USER_DEFINED, false));
    }
    Ok(tok)
}

/// The pre-tokenizer of `tokenizer.ggml.pre` (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*`).
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, Error> {
    let split = |re: &str| -> Result<PreTokenizerWrapper, Error> {
        Split::new(
            SplitPattern::Regex(re.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(Into::into)
        .map_err(|e| Error::InvalidModel {
            reason: format!("pre-tokenizer {pre:?}: {e}"),
        })
    };
    let byte_level = |use_regex: bool| ByteLevel::new(false, true, use_regex).into();
    Ok(match pre {
        // GPT-2's expression alone.
        "gpt2" | "default" => byte_level(true),
        // Every digit on its own, then GPT-2's expression.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => {
            Sequence::new(vec![split(r"\p{N}")?, byte_level(true)]).into()
        }
        "llama3" | "llama-bpe" => Sequence::new(vec![split(LLAMA3)?, byte_level(false)]).into(),
        "qwen2" | "stablelm2" => Sequence::new(vec![split(QWEN2)?, byte_level(false)]).into(),
        other => {
            return Err(Error::InvalidModel {
                reason: format!(
                    "tokenizer.ggml.pre {other:?} is not one tandem builds (smollm, llama3, qwen2, gpt2)"
                ),
            });
        }
    })
}
