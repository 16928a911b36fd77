//! Reading activation captures (docs/SPEC.md §8): `layers.{l}.q` `[P, Hq, D]`, `layers.{l}.k` and
//! `layers.{l}.v` `[N, Hkv, D]`, optional `layers.{l}.o` `[P, Hq, D]`, and metadata
//! `positions`, `model`, `qk_norm`, `softcap`, `layer_kinds`.
//!
//! Layers are decoded on demand, one at a time, so a 28-layer 32k capture never has to sit
//! in memory as f32 all at once.

use std::collections::BTreeSet;
use std::path::Path;

use crate::tensors::{TensorError, TensorFile};

/// How a layer attends (the capture schema's own type).
pub use fathom_capture::LayerKind;

/// Capture-wide facts, validated against every layer.
#[derive(Debug, Clone)]
pub struct CaptureInfo {
    /// Model name from the metadata.
    pub model: String,
    /// Whether the model applies QK-norm.
    pub qk_norm: bool,
    /// Attention-logit softcap, if any.
    pub softcap: Option<f32>,
    /// Query positions (query `p` attends to keys `0..=positions[p]`).
    pub positions: Vec<usize>,
    /// Layer indices present, ascending.
    pub layers: Vec<usize>,
    /// Kind of each layer in `layers` (Global when the metadata has no `layer_kinds`).
    pub kinds: Vec<LayerKind>,
    /// Tokens `N`.
    pub n: usize,
    /// Query heads.
    pub hq: usize,
    /// KV heads.
    pub hkv: usize,
    /// Channels per head.
    pub d: usize,
}

impl CaptureInfo {
    /// Query heads per KV head.
    pub fn g(&self) -> usize {
        self.hq / self.hkv
    }
}

/// One layer's tensors, f32.
#[derive(Debug, Clone)]
pub struct LayerData {
    /// Layer index.
    pub index: usize,
    /// Attention kind.
    pub kind: LayerKind,
    /// Queries `[P, Hq, D]`.
    pub q: Vec<f32>,
    /// Keys `[N, Hkv, D]`.
    pub k: Vec<f32>,
    /// Values `[N, Hkv, D]`.
    pub v: Vec<f32>,
    /// The model's own attention output `[P, Hq, D]`, if captured.
    pub o: Option<Vec<f32>>,
}

/// An open capture file.
#[derive(Debug)]
pub struct Capture {
    file: TensorFile,
    info: CaptureInfo,
}

fn invalid(path: &Path, reason: String) -> TensorError {
    TensorError::Invalid {
        path: path.to_path_buf(),
        reason,
    }
}

impl Capture {
    /// Opens a capture and checks the schema: every layer has q, k and v with consistent
    /// shapes, heads divide, positions lie below `N`, metadata parses.
    pub fn open(path: &Path) -> Result<Self, TensorError> {
        Self::from_file(TensorFile::open(path)?)
    }

    /// A capture held in memory (an embedded fixture), checked as [`Capture::open`] checks a
    /// file; `name` stands for the path in errors.
    pub fn from_bytes(name: &str, bytes: &'static [u8]) -> Result<Self, TensorError> {
        Self::from_file(TensorFile::from_bytes(name, bytes)?)
    }

    /// A capture in bytes the caller owns (one about to be written), checked as
    /// [`Capture::open`] checks a file; [`Capture::into_bytes`] gives the bytes back.
    pub fn from_vec(name: &str, bytes: Vec<u8>) -> Result<Self, TensorError> {
        Self::from_file(TensorFile::from_vec(name, bytes)?)
    }

    /// The capture's bytes (those given to [`Capture::from_vec`], without a copy).
    pub fn into_bytes(self) -> Vec<u8> {
        self.file.into_bytes()
    }

    fn from_file(file: TensorFile) -> Result<Self, TensorError> {
        let path = &file.path().to_path_buf();
        let meta = file.metadata()?;
        let layers = captured_layers(path, &file.names()?)?;
        let (p, hq, n, hkv, d) = layer_shapes(&file, path, &layers)?;
        let schema =
            fathom_capture::CaptureMeta::from_map(&meta).map_err(|e| invalid(path, e.0))?;
        let positions = schema.positions;
        if positions.len() != p {
            return Err(invalid(
                path,
                format!(
                    "metadata `positions` has {} entries but layers.*.q has P = {p}",
                    positions.len()
                ),
            ));
        }
        if let Some((i, &pos)) = positions.iter().enumerate().find(|(_, &x)| x >= n) {
            return Err(invalid(
                path,
                format!("positions[{i}] = {pos} is beyond the {n} captured keys (must be < N)"),
            ));
        }
        let kinds = layer_kinds(path, schema.layer_kinds, &layers)?;
        let info = CaptureInfo {
            model: meta
                .get("model")
                .cloned()
                .unwrap_or_else(|| "unknown".into()),
            qk_norm: schema.qk_norm,
            softcap: schema.softcap,
            positions,
            layers,
            kinds,
            n,
            hq,
            hkv,
            d,
        };
        Ok(Self { file, info })
    }

    /// Capture-wide facts.
    pub fn info(&self) -> &CaptureInfo {
        &self.info
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// Decodes layer `index` (an entry of `info().layers`), rejecting NaN/Inf by tensor name.
    pub fn layer(&self, index: usize) -> Result<LayerData, TensorError> {
        let slot = self
            .info
            .layers
            .iter()
            .position(|&l| l == index)
            .ok_or_else(|| invalid(self.path(), format!("layer {index} is not in the capture")))?;
        let r = |t: &str| {
            self.file
                .read(&format!("layers.{index}.{t}"), &[3])
                .map(|t| t.data)
        };
        let o = if self.file.contains(&format!("layers.{index}.o"))? {
            Some(r("o")?)
        } else {
            None
        };
        Ok(LayerData {
            index,
            kind: self.info.kinds[slot],
            q: r("q")?,
            k: r("k")?,
            v: r("v")?,
            o,
        })
    }
}

/// Serialises layers into a docs/SPEC.md §8 capture (safetensors bytes), e.g. for fixtures.
pub fn capture_bytes(
    info: &CaptureInfo,
    layers: &[LayerData],
    dtype: crate::tensors::WriteDtype,
) -> Result<Vec<u8>, fathom_capture::SchemaError> {
    use fathom_capture::{tensor_name, CaptureMeta, Part};
    let (p, hq, n, hkv, d) = (info.positions.len(), info.hq, info.n, info.hkv, info.d);
    let names: Vec<[String; 4]> = layers
        .iter()
        .map(|l| [Part::Q, Part::K, Part::V, Part::O].map(|x| tensor_name(l.index, x)))
        .collect();
    let qs = [p, hq, d];
    let ks = [n, hkv, d];
    let mut tensors: Vec<(&str, &[f32], &[usize])> = Vec::new();
    for (l, nm) in layers.iter().zip(&names) {
        tensors.push((&nm[0], &l.q, &qs));
        tensors.push((&nm[1], &l.k, &ks));
        tensors.push((&nm[2], &l.v, &ks));
        if let Some(od) = &l.o {
            tensors.push((&nm[3], od, &qs));
        }
    }
    let nl = layers.iter().map(|l| l.index + 1).max().unwrap_or(0);
    let mut kinds = vec![LayerKind::Global; nl];
    for l in layers {
        kinds[l.index] = l.kind;
    }
    let meta = CaptureMeta {
        model: info.model.clone(),
        positions: info.positions.clone(),
        qk_norm: info.qk_norm,
        softcap: info.softcap,
        layer_kinds: Some(kinds),
        layers: None,
    };
    crate::tensors::to_safetensors(&tensors, dtype, Some(meta.to_map()))
}

/// The captured layer indices, sorted: every `l` of a `layers.{l}.*` tensor.
fn captured_layers(path: &Path, names: &[String]) -> Result<Vec<usize>, TensorError> {
    let mut layers = BTreeSet::new();
    for n in names {
        if let Some(rest) = n.strip_prefix("layers.") {
            if let Some((l, _)) = rest.split_once('.') {
                if let Ok(l) = l.parse::<usize>() {
                    layers.insert(l);
                }
            }
        }
    }
    if layers.is_empty() {
        return Err(invalid(
            path,
            "no `layers.{l}.q/k/v` tensors: not a capture (docs/SPEC.md §8)".into(),
        ));
    }
    Ok(layers.into_iter().collect())
}

/// `(P, Hq, N, Hkv, D)`, the same for every layer: `q` is `[P, Hq, D]`, `k` and `v` are
/// `[N, Hkv, D]`, `Hkv` divides `Hq`, and an `o` has the shape of `q`.
fn layer_shapes(
    file: &TensorFile,
    path: &Path,
    layers: &[usize],
) -> Result<(usize, usize, usize, usize, usize), TensorError> {
    let mut dims: Option<(usize, usize, usize, usize, usize)> = None;
    for &l in layers {
        let shape = |t: &str| file.shape(&format!("layers.{l}.{t}"));
        let (q, k, v) = (shape("q")?, shape("k")?, shape("v")?);
        for (t, s) in [("q", &q), ("k", &k), ("v", &v)] {
            if s.len() != 3 {
                return Err(TensorError::Shape {
                    path: path.to_path_buf(),
                    name: format!("layers.{l}.{t}"),
                    shape: s.clone(),
                    expected: if t == "q" {
                        "[P, Hq, D]"
                    } else {
                        "[N, Hkv, D]"
                    }
                    .into(),
                });
            }
        }
        if k != v {
            return Err(TensorError::Shape {
                path: path.to_path_buf(),
                name: format!("layers.{l}.v"),
                shape: v,
                expected: format!("{k:?} (the shape of layers.{l}.k)"),
            });
        }
        if q[2] != k[2] {
            return Err(invalid(
                path,
                format!(
                    "layers.{l}.q has D = {} but layers.{l}.k has D = {}",
                    q[2], k[2]
                ),
            ));
        }
        if k[1] == 0 || q[1] % k[1] != 0 {
            return Err(invalid(
                path,
                format!(
                    "layers.{l}: {} query heads do not divide into {} KV heads",
                    q[1], k[1]
                ),
            ));
        }
        let this = (q[0], q[1], k[0], k[1], k[2]);
        match dims {
            None => dims = Some(this),
            Some(d) if d != this => {
                return Err(invalid(path, format!(
                    "layers.{l} has shapes q {q:?}, k {k:?}, unlike layer {} (P, Hq, N, Hkv, D) = {d:?}",
                    layers[0])));
            }
            _ => {}
        }
        if file.contains(&format!("layers.{l}.o"))? {
            let o = shape("o")?;
            if o != q {
                return Err(TensorError::Shape {
                    path: path.to_path_buf(),
                    name: format!("layers.{l}.o"),
                    shape: o,
                    expected: format!("{q:?} (the shape of layers.{l}.q)"),
                });
            }
        }
    }
    dims.ok_or_else(|| invalid(path, "no layers".into()))
}

/// The kind of each captured layer: from the metadata's `layer_kinds` (over every model
/// layer), or global when the capture has none.
fn layer_kinds(
    path: &Path,
    all: Option<Vec<LayerKind>>,
    layers: &[usize],
) -> Result<Vec<LayerKind>, TensorError> {
    let Some(all) = all else {
        return Ok(vec![LayerKind::Global; layers.len()]);
    };
    layers
        .iter()
        .map(|&l| {
            all.get(l).copied().ok_or_else(|| {
                invalid(
                    path,
                    format!(
                        "metadata `layer_kinds` has {} entries; layer {l} has none",
                        all.len()
                    ),
                )
            })
        })
        .collect()
}
