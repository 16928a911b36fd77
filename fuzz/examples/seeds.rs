//! Writes the small seed corpora under `fuzz/corpus/<target>/` (run from `fuzz/`:
//! `cargo run --example seeds`). The calibration seeds come from `fathom calibrate` on the
//! capture seeds (see `fuzz/README.md`).

use std::path::Path;

use fathom_bench::capture::capture_bytes;
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_bench::tensors::WriteDtype;
use fathom_model::candle_core::quantized::gguf_file::{self, Value};
use fathom_store::{Basis, BasisKind, Dims, KeyStore};

fn keys(n: usize, row: usize, seed: usize) -> Vec<f32> {
    (0..n * row)
        .map(|i| (((i * 37 + seed * 11) % 101) as f32 - 50.0) / 10.0)
        .collect()
}

fn put(dir: &Path, name: &str, bytes: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join(format!("seed-{name}")), bytes).unwrap();
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    // Stores: raw with a tail, whole blocks, squeezed, KLT-like basis, empty.
    let st = root.join("store");
    for (name, heads, ch, n) in [("raw-1x8-100", 1, 8, 100), ("raw-2x4-64", 2, 4, 64), ("raw-1x2-0", 1, 2, 0)] {
        let dims = Dims { heads, channels: ch };
        let s = KeyStore::from_keys(dims, &keys(n, heads * ch, 1), None).unwrap();
        put(&st, name, &fathom_store::file::to_bytes(&s.view()));
    }
    let dims = Dims { heads: 1, channels: 4 };
    let mut id = vec![0f32; 16];
    for i in 0..4 {
        id[i * 4 + 3 - i] = 1.0;
    }
    let b = Basis::new(BasisKind::Custom, 1, 4, id).unwrap();
    let s = KeyStore::from_keys(dims, &keys(70, 4, 2), Some(b)).unwrap();
    put(&st, "custom-1x4-70", &fathom_store::file::to_bytes(&s.view()));
    let mut s = KeyStore::from_keys(dims, &keys(3, 4, 3), None).unwrap();
    s.set_flags(fathom_store::file::FLAG_SQUEEZE_HEADS);
    put(&st, "squeezed-1x4-3", &fathom_store::file::to_bytes(&s.view()));

    // Captures: tiny synthetic, f32 and f16.
    let cap = root.join("capture");
    for (name, dt, layers, hkv, g, d, n, p) in [
        ("syn-f32", WriteDtype::F32, 2, 2, 2, 4, 8, 2),
        ("syn-f16", WriteDtype::F16, 1, 1, 3, 2, 5, 1),
        ("syn-calib", WriteDtype::F16, 2, 1, 2, 4, 48, 2),
    ] {
        let (info, data) = generate(&SyntheticParams { layers, hkv, g, d, n, p, channel_sigma: 1.0, seed: 1 });
        put(&cap, name, &capture_bytes(&info, &data, dt).unwrap());
    }

    // GGUF metadata: a llama config with a gpt2 BPE tokenizer and one with an SPM tokenizer.
    let gg = root.join("gguf");
    let s = |x: &str| Value::String(x.into());
    let strs = |xs: &[&str]| Value::Array(xs.iter().map(|x| s(x)).collect());
    let common = vec![
        ("general.architecture", s("llama")),
        ("general.name", s("tiny")),
        ("llama.block_count", Value::U32(2)),
        ("llama.embedding_length", Value::U32(8)),
        ("llama.attention.head_count", Value::U32(2)),
        ("llama.attention.head_count_kv", Value::U32(1)),
        ("llama.feed_forward_length", Value::U32(16)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.rope.freq_base", Value::F32(10000.0)),
        ("llama.context_length", Value::U32(64)),
    ];
    let vocab = ["<s>", "</s>", "H", "e", "l", "o", "He", "ll", "Hell", "Hello", "Ġ", "w", "r", "d", ","];
    let mut gpt2 = common.clone();
    gpt2.push(("tokenizer.ggml.model", s("gpt2")));
    gpt2.push(("tokenizer.ggml.tokens", strs(&vocab)));
    gpt2.push(("tokenizer.ggml.merges", strs(&["H e", "l l", "He ll", "Hell o"])));
    gpt2.push(("tokenizer.ggml.bos_token_id", Value::U32(0)));
    gpt2.push(("tokenizer.ggml.eos_token_id", Value::U32(1)));
    let mut spm = common;
    let svocab = ["<unk>", "<s>", "</s>", "<0x48>", "▁", "H", "e", "l", "o", "▁H", "ll", "▁Hello"];
    spm.push(("tokenizer.ggml.model", s("llama")));
    spm.push(("tokenizer.ggml.tokens", strs(&svocab)));
    spm.push(("tokenizer.ggml.scores", Value::Array((0..svocab.len()).map(|i| Value::F32(-(i as f32))).collect())));
    spm.push(("tokenizer.ggml.token_type", Value::Array((0..svocab.len()).map(|i| Value::I32(if i < 3 { 3 } else if i == 3 { 6 } else { 1 })).collect())));
    spm.push(("tokenizer.ggml.unknown_token_id", Value::U32(0)));
    for (name, meta) in [("llama-gpt2", gpt2), ("llama-spm", spm)] {
        let refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        let mut buf = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut buf, &refs, &[]).unwrap();
        put(&gg, name, &buf.into_inner());
    }
    eprintln!("seeds written under {}", root.display());
}
