//! The optional rotation basis (docs/SPEC.md §2, "Rotated variant (KLT)").
//!
//! For each KV head the store may hold planes of `k' = Uᵀk`, where the columns of the
//! orthogonal `D × D` matrix `U` are the calibration eigenvectors ordered by calibration
//! score variance. Queries are rotated the same way, so `q·k = q'·k'`. Nothing is
//! truncated: all `D` rotated coordinates are stored.

use crate::error::{Result, StoreError};

/// What kind of basis a store's channels are in. Stored in the file header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum BasisKind {
    /// The model's own channels (no rotation).
    Raw = 0,
    /// The KLT (eigenbasis of calibration key covariance).
    Klt = 1,
    /// Any other orthogonal basis supplied by the caller.
    Custom = 2,
}

impl BasisKind {
    /// Decodes the header field.
    pub fn from_u32(v: u32) -> Option<Self> {
        match v {
            0 => Some(Self::Raw),
            1 => Some(Self::Klt),
            2 => Some(Self::Custom),
            _ => None,
        }
    }
}

/// Per-head rotation matrices `U_h`, row-major `[heads][D][D]`: `u[h][i][j]` is component `i`
/// of basis vector `j`.
#[derive(Debug, Clone, PartialEq)]
pub struct Basis {
    kind: BasisKind,
    heads: usize,
    dim: usize,
    mats: Vec<f32>,
}

impl Basis {
    /// Builds a basis from row-major `[heads][D][D]` matrices whose columns are basis vectors.
    ///
    /// Checks the size and that every entry is finite; orthogonality is the caller's
    /// contract (calibration tests check `UᵀU = I`).
    pub fn new(kind: BasisKind, heads: usize, dim: usize, mats: Vec<f32>) -> Result<Self> {
        if kind == BasisKind::Raw {
            return Err(StoreError::Basis("a Raw basis has no matrices".into()));
        }
        let want = heads
            .checked_mul(dim)
            .and_then(|x| x.checked_mul(dim))
            .ok_or_else(|| StoreError::Basis("size overflow".into()))?;
        if mats.len() != want {
            return Err(StoreError::Shape {
                what: "basis matrices [heads][D][D]",
                expected: want,
                got: mats.len(),
            });
        }
        if let Some(i) = mats.iter().position(|x| !x.is_finite()) {
            return Err(StoreError::Basis(format!("entry {i} is not finite")));
        }
        Ok(Self {
            kind,
            heads,
            dim,
            mats,
        })
    }

    /// The kind recorded in the file header.
    pub fn kind(&self) -> BasisKind {
        self.kind
    }

    /// Row-major `[heads][D][D]` matrices.
    pub fn matrices(&self) -> &[f32] {
        &self.mats
    }

    /// Number of heads.
    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Channels per head.
    pub fn dim(&self) -> usize {
        self.dim
    }

    /// The matrix of one head, row-major `[D][D]`.
    ///
    /// # Panics
    /// If `head ≥ heads` (a programming error).
    pub fn matrix(&self, head: usize) -> &[f32] {
        assert!(
            head < self.heads,
            "basis head {head} out of range ({} heads)",
            self.heads
        );
        let d2 = self.dim * self.dim;
        &self.mats[head * d2..(head + 1) * d2]
    }

    /// Panics unless `x` and `out` are `D` long.
    #[track_caller]
    fn assert_vectors(&self, x: &[f32], out: &[f32]) {
        assert!(
            x.len() == self.dim && out.len() == self.dim,
            "basis: x ({}) and out ({}) must be D = {} long",
            x.len(),
            out.len(),
            self.dim
        );
    }

    /// `out = U_hᵀ x` (rotate a key or a query of head `head` into the store's basis).
    ///
    /// # Panics
    /// If `head ≥ heads` or `x` or `out` is not `D` long (a programming error: a short
    /// vector is never zero-padded, nor a short output cut, silently).
    pub fn rotate(&self, head: usize, x: &[f32], out: &mut [f32]) {
        self.assert_vectors(x, out);
        rotate_with(self.matrix(head), self.dim, x, out)
    }

    /// `out = U_h x'` (rotate back to the model's channels).
    ///
    /// # Panics
    /// As [`Basis::rotate`].
    pub fn unrotate(&self, head: usize, x: &[f32], out: &mut [f32]) {
        self.assert_vectors(x, out);
        let u = self.matrix(head);
        let d = self.dim;
        for (i, o) in out.iter_mut().enumerate().take(d) {
            let row = &u[i * d..(i + 1) * d];
            *o = row
                .iter()
                .zip(x)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>() as f32;
        }
    }
}

/// `out_j = Σ_i u[i][j] x_i` with f64 accumulation.
pub(crate) fn rotate_with(u: &[f32], d: usize, x: &[f32], out: &mut [f32]) {
    let mut acc = vec![0f64; d];
    for (i, &xi) in x.iter().enumerate().take(d) {
        let row = &u[i * d..(i + 1) * d];
        let xi = xi as f64;
        for (a, &uij) in acc.iter_mut().zip(row) {
            *a += uij as f64 * xi;
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = a as f32;
    }
}
