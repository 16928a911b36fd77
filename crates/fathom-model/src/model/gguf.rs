//! GGUF metadata: reading a file's header (after a pre-scan that refuses what candle's parser
//! would panic on) and the model [`Config`] its keys give.

use candle_core::quantized::gguf_file::Value;

use super::*;

pub(crate) fn gguf_err(what: &str, detail: impl std::fmt::Display) -> Error {
    Error::Gguf {
        what: what.into(),
        detail: detail.to_string(),
    }
}

fn get<'a>(c: &'a Content, key: &str) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| gguf_err(key, "missing metadata key"))
}

fn get_usize(c: &Content, key: &str) -> Result<usize> {
    let v = get(c, key)?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I32(x) => *x as u64,
        Value::I64(x) => *x as u64,
        _ => return Err(gguf_err(key, format!("expected an integer, got {v:?}"))),
    };
    Ok(n as usize)
}

fn get_f32(c: &Content, key: &str) -> Result<f32> {
    get(c, key)?.to_f32().map_err(|e| gguf_err(key, e))
}

/// Reads GGUF metadata and tensor infos (candle's parser), after a pre-scan of the metadata
/// that rejects what that parser would panic on (`general.alignment` = 0 divides by zero).
///
/// Found by the `gguf` fuzz target (`fuzz/`).
pub fn read_gguf<R: std::io::Read + std::io::Seek>(r: &mut R) -> Result<Content> {
    let start = r.stream_position().map_err(|e| gguf_err("header", e))?;
    if let Err(e) = gguf_prescan(r) {
        if e.kind() == std::io::ErrorKind::InvalidData {
            return Err(gguf_err("general.alignment", e));
        }
    }
    r.seek(std::io::SeekFrom::Start(start))
        .map_err(|e| gguf_err("header", e))?;
    Content::read(r).map_err(|e| gguf_err("header", e))
}

/// Walks the metadata key/values; `InvalidData` for an alignment of 0, any other error
/// (truncation, unknown types) is left for candle's parser to report.
fn gguf_prescan<R: std::io::Read>(r: &mut R) -> std::io::Result<()> {
    use std::io::{Error as E, ErrorKind, Read as _};
    fn u32_of<R: std::io::Read>(r: &mut R) -> std::io::Result<u32> {
        let mut b = [0u8; 4];
        r.read_exact(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn u64_of<R: std::io::Read>(r: &mut R) -> std::io::Result<u64> {
        let mut b = [0u8; 8];
        r.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }
    fn skip<R: std::io::Read>(r: &mut R, n: u64) -> std::io::Result<()> {
        let got = std::io::copy(&mut std::io::Read::take(&mut *r, n), &mut std::io::sink())?;
        if got != n {
            return Err(E::from(ErrorKind::UnexpectedEof));
        }
        Ok(())
    }
    /// Skips one value of type `t`; returns it when it is an integer.
    fn value<R: std::io::Read>(
        r: &mut R,
        t: u32,
        v1: bool,
        depth: u32,
    ) -> std::io::Result<Option<i128>> {
        let len = |r: &mut R| {
            if v1 {
                u32_of(r).map(u64::from)
            } else {
                u64_of(r)
            }
        };
        let mut int = |n: usize, signed: bool| -> std::io::Result<Option<i128>> {
            let mut b = [0u8; 8];
            r.read_exact(&mut b[..n])?;
            let u = u64::from_le_bytes(b);
            let v = if signed {
                let sh = 64 - 8 * n as u32;
                (((u << sh) as i64) >> sh) as i128
            } else {
                u as i128
            };
            Ok(Some(v))
        };
        match t {
            0 | 7 => int(1, false),
            1 => int(1, true),
            2 => int(2, false),
            3 => int(2, true),
            4 => int(4, false),
            5 => int(4, true),
            10 => int(8, false),
            11 => int(8, true),
            6 => int(4, false).map(|_| None),
            12 => int(8, false).map(|_| None),
            8 => {
                let n = len(r)?;
                skip(r, n).map(|_| None)
            }
            9 if depth < 8 => {
                let et = u32_of(r)?;
                let n = len(r)?;
                for _ in 0..n {
                    value(r, et, v1, depth + 1)?;
                }
                Ok(None)
            }
            _ => Err(E::from(ErrorKind::Unsupported)),
        }
    }
    if u32_of(r)? != 0x4655_4747 {
        return Ok(());
    }
    let v1 = u32_of(r)? == 1;
    let count = |r: &mut R| {
        if v1 {
            u32_of(r).map(u64::from)
        } else {
            u64_of(r)
        }
    };
    let _tensors = count(r)?;
    let kvs = count(r)?;
    for _ in 0..kvs {
        let klen = count(r)?;
        let mut key = Vec::new();
        if std::io::Read::take(&mut *r, klen.min(256)).read_to_end(&mut key)? as u64
            != klen.min(256)
        {
            return Err(E::from(ErrorKind::UnexpectedEof));
        }
        skip(r, klen - klen.min(256))?;
        let t = u32_of(r)?;
        let v = value(r, t, v1, 0)?;
        if key == b"general.alignment" && v == Some(0) {
            return Err(E::new(
                ErrorKind::InvalidData,
                "alignment 0 (must be positive)",
            ));
        }
    }
    Ok(())
}

impl Config {
    /// Read the config from GGUF metadata.
    pub fn from_gguf(c: &Content) -> Result<Config> {
        let arch_s = get(c, "general.architecture")?
            .to_string()
            .map_err(|e| gguf_err("general.architecture", e))?;
        let arch = match arch_s.as_str() {
            "llama" => Arch::Llama,
            "gemma3" => Arch::Gemma3,
            other => return Err(Error::UnsupportedArch(other.into())),
        };
        let p = arch_s.as_str();
        let k = |s: &str| format!("{p}.{s}");
        let n_layers = get_usize(c, &k("block_count"))?;
        let n_embd = get_usize(c, &k("embedding_length"))?;
        let n_heads = get_usize(c, &k("attention.head_count"))?;
        let n_kv_heads = get_usize(c, &k("attention.head_count_kv"))?;
        if n_heads == 0 {
            return Err(gguf_err(&k("attention.head_count"), "0 heads"));
        }
        let head_dim = get_usize(c, &k("attention.key_length")).unwrap_or(n_embd / n_heads);
        let n_ff = get_usize(c, &k("feed_forward_length"))?;
        let rms_eps = get_f32(c, &k("attention.layer_norm_rms_epsilon"))?;
        let rope_base = get_f32(c, &k("rope.freq_base")).unwrap_or(10_000.0);
        let context_length = get_usize(c, &k("context_length"))?;
        let vocab_size = get(c, "tokenizer.ggml.tokens")?
            .to_vec()
            .map_err(|e| gguf_err("tokens", e))?
            .len();
        let name = c
            .metadata
            .get("general.name")
            .and_then(|v| v.to_string().ok().cloned())
            .unwrap_or_else(|| arch_s.clone());
        // Plausibility bounds before anything is sized by these numbers (a corrupt header
        // claiming 10⁹ layers must be an error, not a 16 GB allocation; fuzz: gguf).
        for (key, v, max) in [
            ("block_count", n_layers, 1 << 12),
            ("attention.head_count", n_heads, 1 << 12),
            ("attention.head_count_kv", n_kv_heads, 1 << 12),
            ("embedding_length", n_embd, 1 << 20),
            ("attention.key_length", head_dim, 1 << 16),
            ("feed_forward_length", n_ff, 1 << 22),
        ] {
            if v > max {
                return Err(gguf_err(
                    &k(key),
                    format!("{v} is implausible (at most {max})"),
                ));
            }
        }
        if n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
            return Err(gguf_err(
                "attention.head_count_kv",
                format!("{n_heads} heads, {n_kv_heads} kv heads"),
            ));
        }
        let cfg = match arch {
            Arch::Llama => Config {
                arch,
                name,
                n_layers,
                n_embd,
                n_heads,
                n_kv_heads,
                head_dim,
                n_ff,
                vocab_size,
                rms_eps,
                rope_base,
                rope_base_local: rope_base,
                rope_style: RopeStyle::Interleaved,
                layer_kinds: vec![LayerKind::Global; n_layers],
                context_length,
                qk_norm: false,
                embed_scale: 1.0,
                attn_softcap: None,
            },
            Arch::Gemma3 => {
                let w = get_usize(c, &k("attention.sliding_window"))?;
                // llama.cpp: swa pattern 6 (every 6th layer global), local RoPE base 1e4.
                let layer_kinds = (0..n_layers)
                    .map(|l| {
                        if (l + 1) % 6 == 0 {
                            LayerKind::Global
                        } else {
                            LayerKind::Local(w)
                        }
                    })
                    .collect();
                Config {
                    arch,
                    name,
                    n_layers,
                    n_embd,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    n_ff,
                    vocab_size,
                    rms_eps,
                    rope_base,
                    rope_base_local: 10_000.0,
                    rope_style: RopeStyle::Neox,
                    layer_kinds,
                    context_length,
                    qk_norm: true,
                    embed_scale: (n_embd as f32).sqrt(),
                    attn_softcap: None,
                }
            }
        };
        Ok(cfg)
    }
}
