//! Reading and writing f32/f16/bf16 tensors in safetensors files, with errors that name
//! the file and the tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{tensor::TensorView, Dtype, SafeTensors};

/// Errors reading a tensor file.
#[derive(Debug, thiserror::Error)]
pub enum TensorError {
    /// I/O, with the path.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Not a valid safetensors file.
    #[error("{path}: not a valid safetensors file ({reason})")]
    Format {
        /// Path.
        path: PathBuf,
        /// Parser message.
        reason: String,
    },
    /// A tensor that is not in the file.
    #[error("{path}: tensor `{name}` not found (the file has: {available})")]
    Missing {
        /// Path.
        path: PathBuf,
        /// Tensor asked for.
        name: String,
        /// Names present (truncated).
        available: String,
    },
    /// Unsupported element type.
    #[error("{path}: tensor `{name}` has dtype {dtype}; expected f32, f16 or bf16")]
    Dtype {
        /// Path.
        path: PathBuf,
        /// Tensor.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// A wrong rank or shape.
    #[error("{path}: tensor `{name}` has shape {shape:?}; expected {expected}")]
    Shape {
        /// Path.
        path: PathBuf,
        /// Tensor.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
        /// What was expected.
        expected: String,
    },
    /// NaN or Inf in a tensor.
    #[error(
        "{path}: tensor `{name}` holds {value} at index {index:?} (NaN or Inf is not allowed)"
    )]
    NonFinite {
        /// Path.
        path: PathBuf,
        /// Tensor.
        name: String,
        /// Multi-index of the value.
        index: Vec<usize>,
        /// The value.
        value: f32,
    },
    /// Inconsistent metadata.
    #[error("{path}: {reason}")]
    Invalid {
        /// Path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// A decoded tensor: f32 data and its shape.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    /// Row-major values.
    pub data: Vec<f32>,
    /// Shape.
    pub shape: Vec<usize>,
}

/// A safetensors file held in memory: memory-mapped from disk, or bytes the caller holds (an
/// embedded fixture).
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    map: Backing,
}

#[derive(Debug)]
enum Backing {
    Mapped(memmap2::Mmap),
    Static(&'static [u8]),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Static(b) => b,
            Backing::Owned(v) => v,
        }
    }
}

impl TensorFile {
    /// Opens and validates the header.
    pub fn open(path: &Path) -> Result<Self, TensorError> {
        let io = |source| TensorError::Io {
            path: path.to_path_buf(),
            source,
        };
        let f = std::fs::File::open(path).map_err(io)?;
        // SAFETY: read-only map of a file we do not modify; a concurrent writer outside the
        // process is a misuse (our own writers replace files by rename).
        let map = unsafe { memmap2::Mmap::map(&f) }.map_err(io)?;
        let tf = Self {
            path: path.to_path_buf(),
            map: Backing::Mapped(map),
        };
        tf.st()?;
        Ok(tf)
    }

    /// Bytes already in memory (an embedded file), validated as [`TensorFile::open`] does;
    /// `name` stands for the path in errors.
    pub fn from_bytes(name: &str, bytes: &'static [u8]) -> Result<Self, TensorError> {
        let tf = Self {
            path: PathBuf::from(name),
            map: Backing::Static(bytes),
        };
        tf.st()?;
        Ok(tf)
    }

    /// Bytes the caller owns (a file about to be written), validated as
    /// [`TensorFile::open`] does; `name` stands for the path in errors.
    pub fn from_vec(name: &str, bytes: Vec<u8>) -> Result<Self, TensorError> {
        let tf = Self {
            path: PathBuf::from(name),
            map: Backing::Owned(bytes),
        };
        tf.st()?;
        Ok(tf)
    }

    /// The file's bytes, owned (moved out of [`TensorFile::from_vec`]'s buffer, else copied).
    pub fn into_bytes(self) -> Vec<u8> {
        match self.map {
            Backing::Owned(v) => v,
            other => other.to_vec(),
        }
    }

    /// The path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn st(&self) -> Result<SafeTensors<'_>, TensorError> {
        SafeTensors::deserialize(&self.map).map_err(|e| TensorError::Format {
            path: self.path.clone(),
            reason: e.to_string(),
        })
    }

    /// The `__metadata__` map (empty if absent).
    pub fn metadata(&self) -> Result<HashMap<String, String>, TensorError> {
        let (_, meta) = SafeTensors::read_metadata(&self.map).map_err(|e| TensorError::Format {
            path: self.path.clone(),
            reason: e.to_string(),
        })?;
        Ok(meta.metadata().clone().unwrap_or_default())
    }

    /// All tensor names.
    pub fn names(&self) -> Result<Vec<String>, TensorError> {
        let mut v: Vec<String> = self.st()?.names().into_iter().cloned().collect();
        v.sort();
        Ok(v)
    }

    /// Whether a tensor exists.
    pub fn contains(&self, name: &str) -> Result<bool, TensorError> {
        Ok(self.st()?.tensor(name).is_ok())
    }

    /// Shape of a tensor.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>, TensorError> {
        Ok(self.view(name)?.shape().to_vec())
    }

    fn view(&self, name: &str) -> Result<TensorView<'_>, TensorError> {
        let st = self.st()?;
        match st.tensor(name) {
            Ok(v) => {
                // Rebuild the view with the map's lifetime.
                let (dtype, shape, data) = (v.dtype(), v.shape().to_vec(), v.data());
                let ptr = data.as_ptr() as usize - self.map.as_ptr() as usize;
                let bytes = &self.map[ptr..ptr + data.len()];
                TensorView::new(dtype, shape, bytes).map_err(|e| TensorError::Format {
                    path: self.path.clone(),
                    reason: e.to_string(),
                })
            }
            Err(_) => {
                let mut names: Vec<String> = st.names().into_iter().cloned().collect();
                names.sort();
                let mut available = names
                    .iter()
                    .take(12)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ");
                if names.len() > 12 {
                    available.push_str(&format!(", … ({} in all)", names.len()));
                }
                if names.is_empty() {
                    available = "no tensors".into();
                }
                Err(TensorError::Missing {
                    path: self.path.clone(),
                    name: name.into(),
                    available,
                })
            }
        }
    }

    /// Reads a tensor as f32, checking its rank is one of `ranks` and every value is finite.
    pub fn read(&self, name: &str, ranks: &[usize]) -> Result<Tensor, TensorError> {
        let v = self.view(name)?;
        let shape = v.shape().to_vec();
        if !ranks.is_empty() && !ranks.contains(&shape.len()) {
            return Err(TensorError::Shape {
                path: self.path.clone(),
                name: name.into(),
                shape,
                expected: format!(
                    "rank {}",
                    ranks
                        .iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(" or ")
                ),
            });
        }
        let bytes = v.data();
        let data: Vec<f32> = match v.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(TensorError::Dtype {
                    path: self.path.clone(),
                    name: name.into(),
                    dtype: format!("{other:?}"),
                })
            }
        };
        if let Some(i) = data.iter().position(|x| !x.is_finite()) {
            return Err(TensorError::NonFinite {
                path: self.path.clone(),
                name: name.into(),
                index: unravel(i, &shape),
                value: data[i],
            });
        }
        Ok(Tensor { data, shape })
    }
}

/// Flat index → multi-index.
pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (k, &s) in shape.iter().enumerate().rev() {
        if s > 0 {
            idx[k] = i % s;
            i /= s;
        }
    }
    idx
}

/// Element type to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteDtype {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
}

/// Serialises named f32 tensors (converted to `dtype`) with metadata into safetensors bytes,
/// through the capture schema's one writer (`fathom_capture::encode`).
pub fn to_safetensors(
    tensors: &[(&str, &[f32], &[usize])],
    dtype: WriteDtype,
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>, fathom_capture::SchemaError> {
    let dt = match dtype {
        WriteDtype::F32 => fathom_capture::Dtype::F32,
        WriteDtype::F16 => fathom_capture::Dtype::F16,
    };
    fathom_capture::encode(tensors, dt, metadata)
}
