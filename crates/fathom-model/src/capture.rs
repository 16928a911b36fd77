//! Activation capture in the docs/SPEC.md §8 safetensors schema.
//!
//! For a context of `N` tokens and `P` query positions (the last `P` tokens), each captured
//! layer `l` gets
//!
//! * `layers.{l}.q` `[P, Hq, D]`: queries after RoPE and any QK-norm, unscaled;
//! * `layers.{l}.k`, `layers.{l}.v` `[N, Hkv, D]`: the whole KV cache (k after RoPE/QK-norm);
//! * `layers.{l}.o` `[P, Hq, D]`: the model's own attention output (before `Wo`), i.e. dense
//!   softmax attention with scale `1/√D` over keys `0..=pos` (or `pos−W+1..=pos` on a `local:W`
//!   layer).
//!
//! Metadata (string values): `positions` (JSON list), `model`, `qk_norm`, `layer_kinds` (JSON
//! list over **all** model layers, `global` / `local:W`), `layers` (JSON list of the captured
//! layer indices), `rope_channel_order`, `head_dim`, `n_heads`, `n_kv_heads`, plus whatever the
//! caller adds (corpus, split, documents, …). No supported model has an attention softcap, so
//! `softcap` is absent.
//!
//! **Channel order.** As computed by the runtime: for llama GGUFs (SmolLM2) RoPE rotates adjacent
//! pairs `(2i, 2i+1)` because the GGUF converter permuted the q/k weight rows; the Hugging Face
//! order (`rotate_half`, pairs `(i, i+D/2)`) is that permutation undone. Gemma 3 is in its native
//! NEOX order. `rope_channel_order` says which (`interleaved-pairs` or `neox-halves`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use crate::error::{Error, Result};
use crate::model::{AttentionHook, Model, RopeStyle};

/// Storage precision of the captured tensors (the capture schema's own type).
pub use fathom_capture::Dtype as CaptureDtype;

/// What to capture.
#[derive(Clone, Debug)]
pub struct CaptureOptions {
    /// Query positions: the last `positions` tokens of the context.
    pub positions: usize,
    /// Layers to keep (`None`: all).
    pub layers: Option<Vec<usize>>,
    /// Prefill chunk size.
    pub chunk: usize,
}

impl Default for CaptureOptions {
    fn default() -> Self {
        CaptureOptions {
            positions: 128,
            layers: None,
            chunk: 512,
        }
    }
}

/// Captured activations of some layers (f32 in memory).
#[derive(Clone, Debug)]
pub struct Capture {
    /// The token index of each query row.
    pub positions: Vec<usize>,
    /// Context length `N`.
    pub n_tokens: usize,
    /// Per captured layer: (layer index, q, k, v, o), shapes as in the module docs.
    pub layers: Vec<LayerCapture>,
    /// `Hq`, `Hkv`, `D`.
    pub shape: (usize, usize, usize),
    /// Metadata (docs/SPEC.md §8 keys and extras).
    pub metadata: BTreeMap<String, String>,
}

/// One layer of a [`Capture`].
#[derive(Clone, Debug)]
pub struct LayerCapture {
    /// Layer index in the model.
    pub layer: usize,
    /// `[P, Hq, D]`.
    pub q: Vec<f32>,
    /// `[N, Hkv, D]`.
    pub k: Vec<f32>,
    /// `[N, Hkv, D]`.
    pub v: Vec<f32>,
    /// `[P, Hq, D]`.
    pub o: Vec<f32>,
}

struct Collector {
    wanted: Vec<bool>,
    first: usize,
    row: usize,
    q: HashMap<usize, Vec<f32>>,
    o: HashMap<usize, Vec<f32>>,
}

impl AttentionHook for Collector {
    fn on_attention(&mut self, layer: usize, pos0: usize, q: &[f32], o: &[f32]) {
        if !self.wanted[layer] {
            return;
        }
        let t = q.len() / self.row;
        for ti in 0..t {
            let pos = pos0 + ti;
            if pos >= self.first {
                self.q
                    .entry(layer)
                    .or_default()
                    .extend_from_slice(&q[ti * self.row..(ti + 1) * self.row]);
                self.o
                    .entry(layer)
                    .or_default()
                    .extend_from_slice(&o[ti * self.row..(ti + 1) * self.row]);
            }
        }
    }
}

/// Run a dense prefill of `tokens` and capture the docs/SPEC.md §8 tensors.
pub fn capture(
    model: &Model,
    model_name: &str,
    tokens: &[u32],
    opts: &CaptureOptions,
) -> Result<Capture> {
    capture_with_progress(model, model_name, tokens, opts, &|_, _| {})
}

/// [`capture`], calling `progress(done, total)` with the tokens prefilled after each chunk of
/// `opts.chunk` (a 32k-token capture is minutes of prefill on a CPU).
pub fn capture_with_progress(
    model: &Model,
    model_name: &str,
    tokens: &[u32],
    opts: &CaptureOptions,
    progress: &dyn Fn(usize, usize),
) -> Result<Capture> {
    let cfg = model.config();
    let n = tokens.len();
    if opts.positions == 0 || opts.positions > n {
        return Err(Error::Invalid(format!(
            "positions {} must be in 1..={n}",
            opts.positions
        )));
    }
    let layers: Vec<usize> = opts
        .layers
        .clone()
        .unwrap_or_else(|| (0..cfg.n_layers).collect());
    if let Some(&bad) = layers.iter().find(|&&l| l >= cfg.n_layers) {
        return Err(Error::Invalid(format!(
            "layer {bad} ≥ {} layers",
            cfg.n_layers
        )));
    }
    let mut wanted = vec![false; cfg.n_layers];
    layers.iter().for_each(|&l| wanted[l] = true);
    let first = n - opts.positions;
    let mut col = Collector {
        wanted,
        first,
        row: cfg.n_heads * cfg.head_dim,
        q: HashMap::new(),
        o: HashMap::new(),
    };
    let mut cache = model.new_cache(n);
    let chunk = opts.chunk.max(1);
    for (i, c) in tokens.chunks(chunk).enumerate() {
        model.prefill(c, &mut cache, chunk, Some(&mut col))?;
        progress((i * chunk + c.len()).min(n), n);
    }
    let mut out = Vec::with_capacity(layers.len());
    for &l in &layers {
        out.push(LayerCapture {
            layer: l,
            q: col.q.remove(&l).unwrap_or_default(),
            k: cache.keys(l).data.to_vec(),
            v: cache.values(l).data.to_vec(),
            o: col.o.remove(&l).unwrap_or_default(),
        });
    }
    let positions: Vec<usize> = (first..n).collect();
    let mut metadata: BTreeMap<String, String> = fathom_capture::CaptureMeta {
        model: model_name.to_string(),
        positions: positions.clone(),
        qk_norm: cfg.qk_norm,
        softcap: cfg.attn_softcap,
        layer_kinds: Some(cfg.layer_kinds.clone()),
        layers: Some(layers.clone()),
    }
    .to_map()
    .into_iter()
    .collect();
    metadata.insert(
        "rope_channel_order".into(),
        match cfg.rope_style {
            RopeStyle::Interleaved => "interleaved-pairs".into(),
            RopeStyle::Neox => "neox-halves".into(),
        },
    );
    metadata.insert("n_heads".into(), cfg.n_heads.to_string());
    metadata.insert("n_kv_heads".into(), cfg.n_kv_heads.to_string());
    metadata.insert("head_dim".into(), cfg.head_dim.to_string());
    metadata.insert("n_tokens".into(), n.to_string());
    Ok(Capture {
        positions,
        n_tokens: n,
        layers: out,
        shape: (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim),
        metadata,
    })
}

impl Capture {
    /// Write as safetensors with `__metadata__` = [`Capture::metadata`], atomically
    /// (temporary file, fsync, rename: a crash never leaves a partial capture at `path`).
    pub fn write_safetensors(&self, path: &Path, dtype: CaptureDtype) -> Result<()> {
        use fathom_capture::{tensor_name, Part};
        let (hq, hkv, d) = self.shape;
        let p = self.positions.len();
        let n = self.n_tokens;
        let (qs, ks) = ([p, hq, d], [n, hkv, d]);
        let names: Vec<[String; 4]> = self
            .layers
            .iter()
            .map(|lc| [Part::Q, Part::K, Part::V, Part::O].map(|x| tensor_name(lc.layer, x)))
            .collect();
        let mut tensors: Vec<(&str, &[f32], &[usize])> = Vec::new();
        for (lc, nm) in self.layers.iter().zip(&names) {
            tensors.push((&nm[0], &lc.q, &qs));
            tensors.push((&nm[1], &lc.k, &ks));
            tensors.push((&nm[2], &lc.v, &ks));
            tensors.push((&nm[3], &lc.o, &qs));
        }
        let meta: HashMap<String, String> = self.metadata.clone().into_iter().collect();
        crate::fetch::write_atomic_with(path, |tmp| {
            fathom_capture::write_file(tmp, &tensors, dtype, Some(meta)).map_err(|e| {
                Error::Safetensors {
                    path: path.to_path_buf(),
                    detail: e.to_string(),
                }
            })
        })
    }
}

/// Recompute the dense attention output of a captured query row and compare with `o`:
/// returns `max_p ‖o_re − o‖ / ‖o‖` over all heads and positions of one layer. Used by tests
/// and by anyone checking a capture's consistency.
pub fn max_relative_o_error(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    positions: &[usize],
    (hq, hkv, d): (usize, usize, usize),
    window: Option<usize>,
) -> f32 {
    let g = hq / hkv;
    let scale = 1.0 / (d as f32).sqrt();
    let n = k.len() / (hkv * d);
    let ks = crate::KvSlice {
        data: k,
        n,
        n_kv_heads: hkv,
        head_dim: d,
    };
    let vs = crate::KvSlice {
        data: v,
        n,
        n_kv_heads: hkv,
        head_dim: d,
    };
    let mut worst = 0f32;
    let mut scores = Vec::new();
    let mut re = vec![0f32; d];
    for (pi, &pos) in positions.iter().enumerate() {
        for h in 0..hq {
            let qrow: Vec<f32> = q[(pi * hq + h) * d..][..d]
                .iter()
                .map(|x| x * scale)
                .collect();
            let lo = crate::attention::window_start(pos, window);
            crate::attention::attend_one(&qrow, ks, vs, h / g, lo, pos, &mut scores, &mut re);
            let orow = &o[(pi * hq + h) * d..][..d];
            let num: f32 = re
                .iter()
                .zip(orow)
                .map(|(a, b)| (a - b) * (a - b))
                .sum::<f32>()
                .sqrt();
            let den: f32 = orow.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
            worst = worst.max(num / den);
        }
    }
    worst
}
