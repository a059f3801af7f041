//! tandem's forward pass against an independent one: NumPy over weights dequantized by the
//! GGUF authors' `gguf` package (tests/reference_forward.py, in float64 with an f16 KV cache).
//!
//! - In f32 mode (every weight dequantized, f32 activations) tandem's logits agree with it to
//!   a relative error of 1e-3 on five prompts, and so do the embeddings (the last position's
//!   final hidden state at length 1, what `/v1/embeddings` returns): cosine ≥ 0.9999; in the
//!   quantized mode ≥ 0.99.
//! - In its quantized mode (the file's Q4_1 / Q8_0 weights, 8-bit activations) tandem picks
//!   the same most likely token at ≥ 95 % of 500 teacher-forced positions, and at every one
//!   where the reference's top token leads by half a logit or more: 8-bit activations change
//!   near-ties, which every quantized engine lives with (llama.cpp through llama-cpp-python
//!   0.3.36 agrees at 486 of these 500 positions, tandem at 481: BENCHMARKS.md).

use std::path::{Path, PathBuf};
use std::process::Command;

use tandem_engine::KvArena;
use tandem_native::llama::{Compute, Scratch, StepRow};
use tandem_native::{GgufFile, Isa, Kernels, Llama, NativeModel, Precision};

const TEXT: &str = "The history of astronomy is one of the oldest of the natural sciences. \
Early cultures identified celestial objects with gods and spirits, and related these objects \
and their movements to phenomena such as rain, drought, seasons, and tides. It is generally \
believed that the first astronomers were priests, and that they understood celestial objects \
and events to be manifestations of the divine. Astronomical observations were used to mark \
the passing of the year, to plan the planting of crops, and to set the dates of festivals. \
Over centuries, careful records of the positions of the Sun, the Moon and the planets made it \
possible to predict eclipses and to build calendars of remarkable accuracy. In ancient Greece, \
thinkers proposed that the Earth was a sphere and estimated its size; later, Ptolemy described \
a model in which the planets moved on circles upon circles around a stationary Earth. That \
model held for more than a thousand years, until Copernicus placed the Sun at the centre, \
Kepler found that orbits are ellipses, and Galileo turned a telescope to the sky and saw the \
moons of Jupiter, the phases of Venus and the craters of the Moon. Newton then showed that one \
law of gravitation explains both the fall of an apple and the orbit of a planet. In the \
nineteenth century, spectroscopy revealed what stars are made of, and photography allowed \
faint objects to be recorded over long exposures. The twentieth century brought the discovery \
that the Milky Way is only one galaxy among billions, that the universe is expanding, and that \
it began in a hot, dense state some fourteen billion years ago. Radio telescopes, space \
observatories and detectors of gravitational waves have since opened new windows on the sky, \
and today astronomers study planets around other stars, the birth of galaxies, and the nature \
of the dark matter and dark energy that seem to make up most of the cosmos. \
Bread is among the oldest prepared foods. Evidence from more than thirty thousand years ago \
shows that people ground the roots of plants into flour, mixed it with water and baked it on \
hot stones. The spread of farming brought wheat and barley to many regions, and with them the \
craft of the baker. Yeast, whether caught from the air or kept alive from one batch to the \
next, makes dough rise by turning sugars into carbon dioxide, while kneading builds the gluten \
that traps the gas. A good loaf depends on time as much as on skill: a slow rise develops \
flavour, and a hot oven sets the crust before the crumb dries out. Around the world, bakers \
shape flat breads, braided loaves, sourdough rounds and steamed buns, each suited to local \
grains, ovens and tastes, and each carrying the habits of the people who make it.";

fn target() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target")
}

fn model_path() -> PathBuf {
    let p = target().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: scripts/test.sh fetches it",
        p.display()
    );
    p
}

/// Every position's logits of `ids`, computed in one step over a fresh arena, and the last
/// position's final hidden state at length 1 (its embedding).
fn forward_all(llama: &Llama, ids: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let bs = 16;
    let blocks = ids.len().div_ceil(bs);
    let shape = NativeModel::kv_shape_of(llama);
    let mut arena = KvArena::new(blocks, shape.bytes_per_block(bs));
    let table: Vec<u32> = (0..blocks as u32).collect();
    let rows: Vec<StepRow<'_>> = ids
        .iter()
        .enumerate()
        .map(|(pos, &token)| StepRow {
            token,
            pos,
            table: &table,
            logits: true,
        })
        .collect();
    let compute = Compute::new(Kernels::new(Isa::detect()), 2);
    let mut logits = Vec::new();
    let mut scratch = Scratch::default();
    // The forward pass tells how many layers' K/V are written, after each layer.
    let layers = parking_lot::Mutex::new(Vec::new());
    llama.forward(
        &compute,
        &rows,
        &mut arena,
        bs,
        &mut scratch,
        &mut logits,
        &|done| layers.lock().push(done),
    );
    let layers = layers.into_inner();
    assert_eq!(layers, (1..=llama.cfg.n_layer as u32).collect::<Vec<_>>());
    let d = llama.cfg.n_embd;
    let hidden = scratch.output_hidden();
    let mut last = hidden[hidden.len() - d..].to_vec();
    tandem_engine::model::normalize(&mut last);
    (logits, last)
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot = |x: &[f32], y: &[f32]| {
        x.iter()
            .zip(y)
            .map(|(p, q)| f64::from(*p) * f64::from(*q))
            .sum::<f64>()
    };
    dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()
}

fn argmax(v: &[f32]) -> u32 {
    tandem_native::sampling::argmax(v)
}

#[test]
fn logits_agree_with_an_independent_forward_pass() {
    let file = GgufFile::read(model_path()).unwrap();
    let tok = tandem_native::tokenizer::from_gguf(&file).unwrap();
    let encode = |s: &str| tok.encode(s, false).unwrap().get_ids().to_vec();
    let chat = |q: &str| format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
    let mut prompts: Vec<Vec<u32>> = [
        "What is the capital of France?".to_string(),
        chat("Name three colors."),
        chat("Write a haiku about the sea."),
        "def fibonacci(n):\n    if n < 2:\n        return n\n".to_string(),
        "1, 2, 3, 4, 5, 6, 7,".to_string(),
    ]
    .iter()
    .map(|s| encode(s))
    .collect();
    let long: Vec<u32> = encode(TEXT).into_iter().take(500).collect();
    assert_eq!(long.len(), 500, "the text is 500 tokens or more");
    prompts.push(long.clone());

    let dir = target().join("tmp/native-logits");
    std::fs::create_dir_all(&dir).unwrap();
    let prompts_path = dir.join("prompts.json");
    std::fs::write(&prompts_path, serde_json::to_vec(&prompts).unwrap()).unwrap();
    let python = target().join("python/gguf/bin/python3");
    let out = Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/reference_forward.py"))
        .arg(model_path())
        .arg(&prompts_path)
        .arg(&dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{} (scripts/test.sh makes the gguf venv): {e}",
                python.display()
            )
        });
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |name: String| -> Vec<f32> {
        std::fs::read(dir.join(name))
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let reference = |i: usize| read(format!("{i}.f32"));
    let reference_embedding = |i: usize| read(format!("{i}.hidden.f32"));

    // f32 mode: every logit within 1e-3 of the largest one's magnitude.
    let f32_model = tandem_native::load(&file, Precision::F32).unwrap();
    let n_vocab = f32_model.cfg.n_vocab;
    for (i, p) in prompts.iter().take(5).enumerate() {
        let (all, embedding) = forward_all(&f32_model, p);
        let want = reference_embedding(i);
        assert_eq!(embedding.len(), want.len());
        let c = cosine(&embedding, &want);
        assert!(c >= 0.9999, "prompt {i}: embedding cosine {c}");
        let ours = &all[(p.len() - 1) * n_vocab..];
        let want = reference(i);
        let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let err = ours
            .iter()
            .zip(&want)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err / scale <= 1e-3,
            "prompt {i}: max error {err} against logits up to {scale}"
        );
        assert_eq!(argmax(ours), argmax(&want), "prompt {i}");
    }
    drop(f32_model);

    // Quantized mode: the same top-1 at ≥ 98 % of 500 teacher-forced positions.
    let q = tandem_native::load(&file, Precision::Quantized).unwrap();
    for (i, p) in prompts.iter().take(5).enumerate() {
        let c = cosine(&forward_all(&q, p).1, &reference_embedding(i));
        assert!(c >= 0.99, "prompt {i}: quantized embedding cosine {c}");
    }
    let (all, _) = forward_all(&q, &long);
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("5.argmax.json")).unwrap()).unwrap();
    let at = |key: &str, pos: usize| reference[key][pos].as_f64().unwrap();
    let mut disagree = Vec::new();
    for pos in 0..500 {
        let ours = argmax(&all[pos * n_vocab..(pos + 1) * n_vocab]);
        if f64::from(ours) != at("argmax", pos) {
            disagree.push((pos, at("margin", pos)));
        }
    }
    eprintln!("quantized top-1 disagreements (position, reference margin): {disagree:?}");
    assert!(disagree.len() <= 25, "{} of 500 disagree", disagree.len());
    // Disagreements are near-ties of the reference: where its top token leads by half a
    // logit or more, the quantized path agrees everywhere.
    assert!(
        disagree.iter().all(|(_, margin)| *margin < 0.5),
        "{disagree:?}"
    );
}
