//! Tokenizer round trips and ids checked against llama.cpp (xllamacpp) by hand.

mod common;

fn check_roundtrip(name: &str, m: &fathom_model::Model, text: &str) {
    let t = m.tokenizer();
    let ids = t.encode_raw(text).unwrap();
    let back = t.decode(&ids).unwrap();
    assert_eq!(back, text, "{name}: round trip of {text:?} via {ids:?}");
}

const TEXTS: &[&str] = &[
    "The capital of France is",
    "Hello, world! 12345 + 678 = 13023.",
    "fn main() {\n    println!(\"{}\", 1 << 4);\n}\n",
    "  leading spaces,\ttabs\n\n\nand newlines  ",
    "naïve café — “quotes”, 日本語のテキスト, emoji 🦀🚀",
    "def f(x):\n\treturn x ** 2  # comment\n",
];

#[test]
fn round_trips() {
    for (name, m) in common::both() {
        for text in TEXTS {
            check_roundtrip(name, m, text);
        }
        check_roundtrip(name, m, &common::LONG_TEXT[..4000]);
    }
}

#[test]
fn ids_match_llama_cpp() {
    // Observed with xllamacpp (llama.cpp) on the same GGUFs: SmolLM2 adds no BOS and no prefix
    // space; Gemma 3 adds BOS (2).
    if let Some(m) = common::smollm2() {
        assert_eq!(
            m.tokenizer().encode("The capital of France is").unwrap(),
            vec![504, 3575, 282, 4649, 314]
        );
        assert_eq!(
            m.tokenizer().encode_raw("<|im_start|>user").unwrap()[0],
            1,
            "control token recognised"
        );
    }
    if let Some(m) = common::gemma3() {
        assert_eq!(
            m.tokenizer().encode("The capital of France is").unwrap(),
            vec![2, 818, 5279, 529, 7001, 563]
        );
    }
}
