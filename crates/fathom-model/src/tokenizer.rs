//! Tokenizers built from GGUF metadata with the `tokenizers` crate.
//!
//! * `gpt2` (SmolLM2): byte-level BPE from `tokenizer.ggml.tokens` and `.merges`; pre-tokenizer
//!   = individual digits, then the GPT-2 regex with **no prefix space** (llama.cpp's `smollm`).
//! * `llama` (Gemma 3, SentencePiece-style): SentencePiece BPE rebuilt as a `tokenizers` BPE
//!   (see `spm_as_bpe`), byte fallback (`<0xNN>`), spaces normalised to `▁`, no dummy prefix.
//!
//! Control tokens (type 3) are added as special tokens and user-defined tokens (type 4, e.g.
//! Gemma's runs of newlines) as added tokens, so both are matched verbatim, as llama.cpp does.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::{AddedToken, Tokenizer as HfTokenizer};

use crate::error::{Error, Result};

/// A tokenizer plus the BOS/EOS conventions from the GGUF metadata.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: HfTokenizer,
    bos: Option<u32>,
    add_bos: bool,
    eos: Option<u32>,
    stop: Vec<u32>,
    vocab_size: usize,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

fn meta<'a>(c: &'a Content, key: &str) -> Option<&'a Value> {
    c.metadata.get(key)
}

fn meta_u32(c: &Content, key: &str) -> Option<u32> {
    match meta(c, key)? {
        Value::U8(v) => Some(*v as u32),
        Value::U16(v) => Some(*v as u32),
        Value::U32(v) => Some(*v),
        Value::U64(v) => Some(*v as u32),
        Value::I32(v) => Some(*v as u32),
        Value::I64(v) => Some(*v as u32),
        _ => None,
    }
}

fn meta_strings(c: &Content, key: &str) -> Result<Vec<String>> {
    let v = meta(c, key).ok_or_else(|| Error::Gguf {
        what: key.into(),
        detail: "missing".into(),
    })?;
    let arr = v.to_vec().map_err(|e| Error::Gguf {
        what: key.into(),
        detail: e.to_string(),
    })?;
    arr.iter()
        .map(|x| {
            x.to_string().cloned().map_err(|e| Error::Gguf {
                what: key.into(),
                detail: e.to_string(),
            })
        })
        .collect()
}

fn meta_ints(c: &Content, key: &str) -> Option<Vec<i64>> {
    let arr = meta(c, key)?.to_vec().ok()?;
    arr.iter()
        .map(|x| match x {
            Value::I32(v) => Some(*v as i64),
            Value::U32(v) => Some(*v as i64),
            Value::I8(v) => Some(*v as i64),
            Value::U8(v) => Some(*v as i64),
            Value::I64(v) => Some(*v),
            _ => None,
        })
        .collect()
}

fn meta_floats(c: &Content, key: &str) -> Option<Vec<f32>> {
    let arr = meta(c, key)?.to_vec().ok()?;
    arr.iter().map(|x| x.to_f32().ok()).collect()
}

impl Tokenizer {
    /// Build the tokenizer described by a GGUF's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(c: &Content) -> Result<Self> {
        let model = meta(c, "tokenizer.ggml.model")
            .and_then(|v| v.to_string().ok().cloned())
            .ok_or_else(|| Error::Gguf {
                what: "tokenizer.ggml.model".into(),
                detail: "missing".into(),
            })?;
        let tokens = meta_strings(c, "tokenizer.ggml.tokens")?;
        let types =
            meta_ints(c, "tokenizer.ggml.token_type").unwrap_or_else(|| vec![1; tokens.len()]);
        let mut inner = match model.as_str() {
            "gpt2" => {
                let merges_raw = meta_strings(c, "tokenizer.ggml.merges")?;
                let vocab: Vocab = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.clone(), i as u32))
                    .collect();
                let merges = merges_raw
                    .iter()
                    .map(|m| {
                        let (a, b) = m
                            .split_once(' ')
                            .ok_or_else(|| tok_err(format!("bad merge {m:?}")))?;
                        Ok((a.to_string(), b.to_string()))
                    })
                    .collect::<Result<Vec<_>>>()?;
                let bpe = BPE::builder()
                    .vocab_and_merges(vocab, merges)
                    .build()
                    .map_err(tok_err)?;
                let mut t = HfTokenizer::new(bpe);
                t.with_pre_tokenizer(Some(PreSequence::new(vec![
                    Digits::new(true).into(),
                    ByteLevel::new(false, false, true).into(),
                ])));
                t.with_decoder(Some(ByteLevelDecoder::new(false, false, true)));
                t
            }
            "llama" => {
                let scores =
                    meta_floats(c, "tokenizer.ggml.scores").ok_or_else(|| Error::Gguf {
                        what: "tokenizer.ggml.scores".into(),
                        detail: "missing".into(),
                    })?;
                if scores.len() != tokens.len() {
                    return Err(Error::Gguf {
                        what: "tokenizer.ggml.scores".into(),
                        detail: format!("{} scores for {} tokens", scores.len(), tokens.len()),
                    });
                }
                let unk = meta_u32(c, "tokenizer.ggml.unknown_token_id").unwrap_or(0) as usize;
                let bpe = spm_as_bpe(&tokens, &scores, &types, unk)?;
                let mut t = HfTokenizer::new(bpe);
                t.with_normalizer(Some(Replace::new(" ", "\u{2581}").map_err(tok_err)?))
                    .map_err(tok_err)?;
                let dec: Vec<DecoderWrapper> = vec![
                    Replace::new("\u{2581}", " ").map_err(tok_err)?.into(),
                    ByteFallback::new().into(),
                    Fuse::new().into(),
                ];
                t.with_decoder(Some(DecoderSequence::new(dec)));
                t
            }
            other => {
                return Err(Error::Tokenizer(format!(
                    "unsupported tokenizer model {other:?}"
                )))
            }
        };
        let mut special = Vec::new();
        let mut user = Vec::new();
        for (t, ty) in tokens.iter().zip(&types) {
            match ty {
                3 => special.push(AddedToken::from(t.clone(), true).normalized(false)),
                4 => user.push(AddedToken::from(t.clone(), false).normalized(false)),
                _ => {}
            }
        }
        inner.add_special_tokens(special).map_err(tok_err)?;
        inner.add_tokens(user).map_err(tok_err)?;
        let bos = meta_u32(c, "tokenizer.ggml.bos_token_id");
        let eos = meta_u32(c, "tokenizer.ggml.eos_token_id");
        let add_bos = meta(c, "tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false);
        let ids: HashMap<&str, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i as u32))
            .collect();
        let mut stop: Vec<u32> = eos.into_iter().collect();
        for name in ["<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<eos>"] {
            if let Some(&id) = ids.get(name) {
                if !stop.contains(&id) {
                    stop.push(id);
                }
            }
        }
        Ok(Tokenizer {
            inner,
            bos,
            add_bos,
            eos,
            stop,
            vocab_size: tokens.len(),
        })
    }

    /// Encode text; prepends BOS when the model's metadata asks for it (`add_bos_token`).
    /// Control tokens written in the text (e.g. `<|im_start|>`) are recognised.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend(self.encode_raw(text)?);
        Ok(ids)
    }

    /// Encode text without BOS.
    pub fn encode_raw(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode_fast(text, false).map_err(tok_err)?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode ids to text (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(tok_err)
    }

    /// The text of one token id as stored in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// BOS id, when the model has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// Whether [`encode`](Self::encode) prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// EOS id.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Ids that end a generation (EOS, end-of-turn markers).
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &HfTokenizer {
        &self.inner
    }
}

/// SentencePiece-BPE (llama.cpp's `llama`/SPM tokenizer) as a `tokenizers` BPE model.
///
/// llama.cpp starts from characters and repeatedly merges the adjacent pair whose
/// concatenation is a vocabulary piece with the **highest score** (leftmost on ties); unknown
/// characters fall back to `<0xNN>` byte tokens. The same result comes from a BPE model whose
/// merge list holds every split `piece = a + b` (`a`, `b` in the vocabulary), ranked by the
/// score of `piece`, descending. (A Unigram/Viterbi model over the same scores is *not*
/// equivalent: Gemma's scores are `−rank`, which Viterbi turns into a preference for short
/// pieces.)
fn spm_as_bpe(tokens: &[String], scores: &[f32], types: &[i64], unk: usize) -> Result<BPE> {
    let ids: std::collections::HashMap<&str, u32> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i as u32))
        .collect();
    // (score, left id, right id, left, right)
    let mut merges: Vec<(f32, u32, u32, &str, &str)> = Vec::new();
    for (i, piece) in tokens.iter().enumerate() {
        if types.get(i).copied().unwrap_or(1) != 1 {
            continue; // only normal pieces are reachable by merging
        }
        for (k, _) in piece.char_indices().skip(1) {
            let (a, b) = piece.split_at(k);
            if let (Some(&ia), Some(&ib)) = (ids.get(a), ids.get(b)) {
                merges.push((scores[i], ia, ib, a, b));
            }
        }
    }
    merges.sort_by(|x, y| y.0.total_cmp(&x.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2)));
    let merges: Vec<(String, String)> = merges
        .into_iter()
        .map(|m| (m.3.to_string(), m.4.to_string()))
        .collect();
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .unk_token(tokens.get(unk).cloned().unwrap_or_else(|| "<unk>".into()))
        .build()
        .map_err(tok_err)
}
