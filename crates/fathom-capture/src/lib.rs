//! The docs/SPEC.md §8 capture schema: one definition of the layer kinds, the metadata keys and
//! the tensor layout, and the one safetensors writer, shared by the model runtime that writes
//! captures and the harness that reads them.
//!
//! A capture holds, per captured layer `l`, `layers.{l}.q` and `layers.{l}.o` `[P, Hq, D]` and
//! `layers.{l}.k`, `layers.{l}.v` `[N, Hkv, D]`, with string metadata: `positions` (JSON list),
//! `model`, `qk_norm` (`true`/`false`), `layer_kinds` (JSON list over all model layers,
//! `global` / `local:W`), `layers` (the captured indices), `softcap` (absent when none) and any
//! keys the writer adds.
//!
//! ```
//! use fathom_capture::{encode, tensor_name, CaptureMeta, Dtype, LayerKind, Part};
//! let meta = CaptureMeta {
//!     model: "toy".into(),
//!     positions: vec![3],
//!     qk_norm: false,
//!     softcap: None,
//!     layer_kinds: Some(vec![LayerKind::Global, LayerKind::Local(2)]),
//!     layers: Some(vec![1]),
//! };
//! let q = [0.5f32; 2];
//! let k = [1.0f32; 8];
//! let (qn, kn, vn) = (tensor_name(1, Part::Q), tensor_name(1, Part::K), tensor_name(1, Part::V));
//! let bytes = encode(
//!     &[(qn.as_str(), &q, &[1, 1, 2]), (kn.as_str(), &k, &[4, 1, 2]), (vn.as_str(), &k, &[4, 1, 2])],
//!     Dtype::F16,
//!     Some(meta.to_map()),
//! )?;
//! let (_, st) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
//! let back = CaptureMeta::from_map(st.metadata().as_ref().unwrap())?;
//! assert_eq!(back, meta);
//! # Ok::<(), fathom_capture::SchemaError>(())
//! ```

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use half::{bf16, f16};
use safetensors::tensor::{Dtype as StDtype, View};

/// A metadata value or a tensor that does not follow the schema.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct SchemaError(pub String);

/// Metadata key: the query positions (JSON list of integers).
pub const POSITIONS: &str = "positions";
/// Metadata key: the model's name.
pub const MODEL: &str = "model";
/// Metadata key: whether the model applies QK-norm (`true` / `false`).
pub const QK_NORM: &str = "qk_norm";
/// Metadata key: the attention-logit softcap (absent when none).
pub const SOFTCAP: &str = "softcap";
/// Metadata key: the kind of every model layer (JSON list of `global` / `local:W`).
pub const LAYER_KINDS: &str = "layer_kinds";
/// Metadata key: the captured layer indices (JSON list).
pub const LAYERS: &str = "layers";

/// How a layer attends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
pub enum LayerKind {
    /// Full causal attention.
    Global,
    /// Sliding window of `W` keys (`pos+1−W..=pos`).
    Local(usize),
}

impl LayerKind {
    /// The window, if any.
    pub fn window(self) -> Option<usize> {
        match self {
            LayerKind::Global => None,
            LayerKind::Local(w) => Some(w),
        }
    }
}

impl std::fmt::Display for LayerKind {
    /// The schema's spelling: `global` or `local:W`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LayerKind::Global => f.write_str("global"),
            LayerKind::Local(w) => write!(f, "local:{w}"),
        }
    }
}

impl std::str::FromStr for LayerKind {
    type Err = SchemaError;
    fn from_str(s: &str) -> Result<Self, SchemaError> {
        if s == "global" {
            return Ok(LayerKind::Global);
        }
        s.strip_prefix("local:")
            .and_then(|w| w.parse().ok())
            .filter(|w| *w > 0)
            .map(LayerKind::Local)
            .ok_or_else(|| SchemaError(format!("{s:?}; expected \"global\" or \"local:W\"")))
    }
}

/// One of a layer's tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Queries `[P, Hq, D]`.
    Q,
    /// Keys `[N, Hkv, D]`.
    K,
    /// Values `[N, Hkv, D]`.
    V,
    /// The model's attention output `[P, Hq, D]`.
    O,
}

/// `layers.{l}.{q,k,v,o}`.
pub fn tensor_name(layer: usize, part: Part) -> String {
    let p = match part {
        Part::Q => "q",
        Part::K => "k",
        Part::V => "v",
        Part::O => "o",
    };
    format!("layers.{layer}.{p}")
}

/// The schema's metadata (other keys pass through the writer and reader untouched).
#[derive(Clone, Debug, PartialEq)]
pub struct CaptureMeta {
    /// `model`.
    pub model: String,
    /// `positions`.
    pub positions: Vec<usize>,
    /// `qk_norm`.
    pub qk_norm: bool,
    /// `softcap`.
    pub softcap: Option<f32>,
    /// `layer_kinds`, over all model layers (`None`: every layer global).
    pub layer_kinds: Option<Vec<LayerKind>>,
    /// `layers`, the captured indices (`None`: read them from the tensor names).
    pub layers: Option<Vec<usize>>,
}

impl CaptureMeta {
    /// The metadata as safetensors string pairs.
    pub fn to_map(&self) -> HashMap<String, String> {
        let mut m = HashMap::new();
        let js = |v: &serde_json::Value| v.to_string();
        m.insert(POSITIONS.into(), js(&serde_json::json!(self.positions)));
        m.insert(MODEL.into(), self.model.clone());
        m.insert(QK_NORM.into(), self.qk_norm.to_string());
        if let Some(c) = self.softcap {
            m.insert(SOFTCAP.into(), c.to_string());
        }
        if let Some(k) = &self.layer_kinds {
            let names: Vec<String> = k.iter().map(LayerKind::to_string).collect();
            m.insert(LAYER_KINDS.into(), js(&serde_json::json!(names)));
        }
        if let Some(l) = &self.layers {
            m.insert(LAYERS.into(), js(&serde_json::json!(l)));
        }
        m
    }

    /// Parses the schema's keys, each error naming the key and what it should be.
    pub fn from_map(m: &HashMap<String, String>) -> Result<Self, SchemaError> {
        let err = |s: String| SchemaError(s);
        let positions: Vec<usize> = match m.get(POSITIONS) {
            None => {
                return Err(err(
                    "metadata `positions` is missing (docs/SPEC.md §8)".into()
                ))
            }
            Some(s) => serde_json::from_str(s).map_err(|e| {
                err(format!(
                    "metadata `positions` is not a JSON list of integers: {e}"
                ))
            })?,
        };
        let qk_norm = match m.get(QK_NORM).map(String::as_str) {
            None | Some("false") => false,
            Some("true") => true,
            Some(x) => {
                return Err(err(format!(
                    "metadata `qk_norm` = {x:?}; expected true or false"
                )))
            }
        };
        let softcap = match m.get(SOFTCAP).map(String::as_str) {
            None | Some("") | Some("null") | Some("none") => None,
            Some(x) => Some(
                x.parse::<f32>()
                    .ok()
                    .filter(|c| c.is_finite() && *c > 0.0)
                    .ok_or_else(|| {
                        err(format!(
                            "metadata `softcap` = {x:?} is not a positive number"
                        ))
                    })?,
            ),
        };
        let layer_kinds = match m.get(LAYER_KINDS) {
            None => None,
            Some(s) => {
                let all: Vec<String> = serde_json::from_str(s).map_err(|e| {
                    err(format!(
                        "metadata `layer_kinds` is not a JSON list of strings: {e}"
                    ))
                })?;
                let mut kinds = Vec::with_capacity(all.len());
                for (l, k) in all.iter().enumerate() {
                    kinds.push(
                        k.parse()
                            .map_err(|e| err(format!("metadata `layer_kinds`[{l}] = {e}")))?,
                    );
                }
                Some(kinds)
            }
        };
        let layers = match m.get(LAYERS) {
            None => None,
            Some(s) => Some(serde_json::from_str(s).map_err(|e| {
                err(format!(
                    "metadata `layers` is not a JSON list of integers: {e}"
                ))
            })?),
        };
        Ok(CaptureMeta {
            model: m.get(MODEL).cloned().unwrap_or_default(),
            positions,
            qk_norm,
            softcap,
            layer_kinds,
            layers,
        })
    }
}

/// Storage precision of the tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dtype {
    /// 32-bit float.
    #[default]
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

impl std::str::FromStr for Dtype {
    type Err = SchemaError;
    fn from_str(s: &str) -> Result<Self, SchemaError> {
        match s {
            "f32" => Ok(Dtype::F32),
            "f16" => Ok(Dtype::F16),
            "bf16" => Ok(Dtype::Bf16),
            o => Err(SchemaError(format!("unknown dtype {o:?} (f32, f16, bf16)"))),
        }
    }
}

/// One tensor converted to its storage dtype.
struct Blob {
    dtype: StDtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Blob {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn blobs(tensors: &[(&str, &[f32], &[usize])], dt: Dtype) -> Result<Vec<Blob>, SchemaError> {
    tensors
        .iter()
        .map(|(name, x, shape)| {
            if shape.iter().product::<usize>() != x.len() {
                return Err(SchemaError(format!(
                    "tensor {name}: {} values for shape {shape:?}",
                    x.len()
                )));
            }
            let (dtype, bytes) = match dt {
                Dtype::F32 => (
                    StDtype::F32,
                    x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
                Dtype::F16 => (
                    StDtype::F16,
                    x.iter()
                        .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                        .collect(),
                ),
                Dtype::Bf16 => (
                    StDtype::BF16,
                    x.iter()
                        .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                        .collect(),
                ),
            };
            Ok(Blob {
                dtype,
                shape: shape.to_vec(),
                bytes,
            })
        })
        .collect()
}

/// Serialises named f32 tensors (stored as `dtype`) with metadata to safetensors bytes.
pub fn encode(
    tensors: &[(&str, &[f32], &[usize])],
    dtype: Dtype,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>, SchemaError> {
    let b = blobs(tensors, dtype)?;
    safetensors::serialize(tensors.iter().map(|t| t.0).zip(b.iter()), &metadata)
        .map_err(|e| SchemaError(e.to_string()))
}

/// [`encode`] straight to a file (the caller makes the write atomic).
pub fn write_file(
    path: &Path,
    tensors: &[(&str, &[f32], &[usize])],
    dtype: Dtype,
    metadata: Option<HashMap<String, String>>,
) -> Result<(), SchemaError> {
    let b = blobs(tensors, dtype)?;
    safetensors::serialize_to_file(tensors.iter().map(|t| t.0).zip(b.iter()), &metadata, path)
        .map_err(|e| SchemaError(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_kinds_round_trip_and_bad_ones_are_named() {
        for k in [LayerKind::Global, LayerKind::Local(512)] {
            assert_eq!(k.to_string().parse::<LayerKind>().unwrap(), k);
        }
        for bad in ["local:0", "local:", "sliding", "Global"] {
            assert!(bad.parse::<LayerKind>().is_err(), "{bad}");
        }
    }

    #[test]
    fn metadata_errors_name_the_key() {
        let mut m = CaptureMeta {
            model: "m".into(),
            positions: vec![1, 2],
            qk_norm: true,
            softcap: Some(30.0),
            layer_kinds: Some(vec![LayerKind::Local(4)]),
            layers: None,
        }
        .to_map();
        assert_eq!(CaptureMeta::from_map(&m).unwrap().softcap, Some(30.0));
        m.insert(QK_NORM.into(), "yes".into());
        assert!(CaptureMeta::from_map(&m).unwrap_err().0.contains("qk_norm"));
        m.insert(QK_NORM.into(), "true".into());
        m.insert(LAYER_KINDS.into(), "[\"local:x\"]".into());
        assert!(CaptureMeta::from_map(&m)
            .unwrap_err()
            .0
            .contains("layer_kinds`[0]"));
        m.remove(LAYER_KINDS);
        m.remove(POSITIONS);
        assert!(CaptureMeta::from_map(&m)
            .unwrap_err()
            .0
            .contains("positions"));
    }

    #[test]
    fn a_shape_that_does_not_match_its_data_is_an_error() {
        let e = encode(&[("layers.0.q", &[1.0, 2.0], &[3])], Dtype::F32, None);
        assert!(e.unwrap_err().0.contains("layers.0.q"));
    }
}
