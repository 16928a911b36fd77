//! Inputs found by the `gguf` fuzz target (`fuzz/fuzz_targets/gguf.rs`), kept as regression
//! tests: the GGUF metadata path (`read_gguf`, `Config::from_gguf`, `Tokenizer::from_gguf`,
//! the first steps of `Model::load`) must reject each with an error, quickly, without a panic.

use std::io::Cursor;

use fathom_model::candle_core::quantized::gguf_file::{self, Value};
use fathom_model::model::read_gguf;
use fathom_model::{Config, Tokenizer};

fn s(x: &str) -> Value {
    Value::String(x.into())
}

/// A tiny llama GGUF (no tensors) with an SPM tokenizer; `edit` changes the metadata.
fn gguf(edit: impl FnOnce(&mut Vec<(&'static str, Value)>)) -> Vec<u8> {
    let vocab = [
        "<unk>", "<s>", "</s>", "▁", "H", "e", "l", "o", "▁H", "ll", "▁Hello",
    ];
    let mut meta: Vec<(&'static str, Value)> = vec![
        ("general.architecture", s("llama")),
        ("llama.block_count", Value::U32(2)),
        ("llama.embedding_length", Value::U32(8)),
        ("llama.attention.head_count", Value::U32(2)),
        ("llama.attention.head_count_kv", Value::U32(1)),
        ("llama.feed_forward_length", Value::U32(16)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", Value::U32(64)),
        ("tokenizer.ggml.model", s("llama")),
        (
            "tokenizer.ggml.tokens",
            Value::Array(vocab.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.scores",
            Value::Array((0..vocab.len()).map(|i| Value::F32(-(i as f32))).collect()),
        ),
    ];
    edit(&mut meta);
    let refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let mut buf = Cursor::new(Vec::new());
    gguf_file::write(&mut buf, &refs, &[]).unwrap();
    buf.into_inner()
}

fn set(meta: &mut [(&'static str, Value)], key: &str, v: Value) {
    meta.iter_mut().find(|(k, _)| *k == key).unwrap().1 = v;
}

#[test]
fn the_baseline_parses() {
    let c = read_gguf(&mut Cursor::new(gguf(|_| {}))).unwrap();
    assert_eq!(Config::from_gguf(&c).unwrap().n_layers, 2);
    let t = Tokenizer::from_gguf(&c).unwrap();
    assert!(!t.encode("Hello").unwrap().is_empty());
}

#[test]
fn alignment_zero_is_an_error_not_a_division_by_zero() {
    let b = gguf(|m| m.push(("general.alignment", Value::U32(0))));
    let e = read_gguf(&mut Cursor::new(b)).unwrap_err().to_string();
    assert!(e.contains("alignment"), "{e}");
}

#[test]
fn zero_heads_is_an_error_not_a_division_by_zero() {
    let c = read_gguf(&mut Cursor::new(gguf(|m| {
        set(m, "llama.attention.head_count", Value::U32(0))
    })))
    .unwrap();
    let e = Config::from_gguf(&c).unwrap_err().to_string();
    assert!(e.contains("head_count"), "{e}");
}

#[test]
fn implausible_sizes_are_errors_not_huge_allocations() {
    for key in [
        "llama.block_count",
        "llama.attention.head_count",
        "llama.embedding_length",
    ] {
        let c = read_gguf(&mut Cursor::new(gguf(|m| {
            set(m, key, Value::U32(0x3d00_0002))
        })))
        .unwrap();
        let e = Config::from_gguf(&c).unwrap_err().to_string();
        assert!(e.contains("implausible"), "{key}: {e}");
    }
    // The fuzzer's own input (block_count 0x3d000002 = 1 023 410 178 layers): it asked for
    // 16 GB before this check.
    let b = std::fs::read(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/fuzz/gguf-oom-block-count.gguf"
    ))
    .unwrap();
    let t = std::time::Instant::now();
    let c = read_gguf(&mut Cursor::new(b)).unwrap();
    assert!(Config::from_gguf(&c).is_err());
    let _ = Tokenizer::from_gguf(&c);
    assert!(t.elapsed().as_secs() < 20, "{:?}", t.elapsed());
}

#[test]
fn fewer_scores_than_tokens_is_an_error_not_an_index_panic() {
    let c = read_gguf(&mut Cursor::new(gguf(|m| {
        set(
            m,
            "tokenizer.ggml.scores",
            Value::Array(vec![Value::F32(0.0); 3]),
        )
    })))
    .unwrap();
    let e = Tokenizer::from_gguf(&c).unwrap_err().to_string();
    assert!(e.contains("scores"), "{e}");
}
