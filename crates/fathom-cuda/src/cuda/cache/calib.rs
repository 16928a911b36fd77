//! Calibrations and static plans (docs/SPEC.md §4): σ², Double Sparsity's channels and the PCA
//! basis per layer, the static depth tables of the methods that have one, and the check that a
//! method can attend a layer.

#[allow(unused_imports)]
use super::*;

/// Per-layer calibration the planners read.
pub(super) struct Calib {
    /// σ² tiled for the batch, `[max_batch][Hkv][D]` f32, per layer (`None`: not loaded).
    pub(super) sigma2: Vec<Option<DevBuf>>,
    /// Double Sparsity channels, best first, per layer and KV head.
    pub(super) ds_channels: Vec<Option<Vec<Vec<u16>>>>,
    /// Static plans, `[L][Hkv][D]` depths, keyed by method label.
    pub(super) statics: std::collections::HashMap<String, DevBuf>,
    /// The PCA index's basis per layer, `[Hkv][D][D]` f32 (`HeadCalib::loki`), on the host (to
    /// compare a reload with) and in HBM; `None`: not loaded (the layer's PCA index is not
    /// written, and `loki:R` refuses it).
    pub(super) pca: Vec<Option<(Vec<f32>, DevBuf)>>,
    /// Whether the layer has had an append: its basis may not change after.
    pub(super) appended: Vec<bool>,
}

impl PagedCache {
    /// [`crate::api::KvCache::load_calibration`].
    pub(crate) fn load_calibration(
        &mut self,
        layer: usize,
        heads: &[fathom_plan::scanner::HeadCalib],
    ) -> Result<()> {
        self.not_capturing("load_calibration")?;
        let s = self.cfg.shape;
        if layer >= s.layers {
            return Err(CudaError::invalid(
                "layer",
                format!("{layer} (the cache has {} layers)", s.layers),
            ));
        }
        if heads.len() != s.kv_heads {
            return Err(CudaError::invalid(
                "calibration",
                format!("{} heads for Hkv = {}", heads.len(), s.kv_heads),
            ));
        }
        let mut tiled = Vec::with_capacity(self.cfg.max_batch * s.kv_heads * s.dim);
        for (h, hc) in heads.iter().enumerate() {
            if hc.sigma2.len() != s.dim {
                return Err(CudaError::invalid(
                    "calibration",
                    format!("head {h}: {} σ² for D = {}", hc.sigma2.len(), s.dim),
                ));
            }
            if let Some(x) = hc.sigma2.iter().find(|x| !x.is_finite() || **x < 0.0) {
                return Err(CudaError::invalid(
                    "calibration",
                    format!("head {h}: σ² {x} is not a finite non-negative number"),
                ));
            }
            crate::cache::check_ds_channels(h, &hc.ds_channels, s.dim)?;
        }
        let pca = if self.cfg.pca_index {
            let mut u = Vec::with_capacity(s.kv_heads * s.dim * s.dim);
            for (h, hc) in heads.iter().enumerate() {
                if hc.loki.len() != s.dim * s.dim {
                    return Err(CudaError::invalid(
                        "calibration",
                        format!(
                            "head {h}: a PCA basis of {} entries for D = {} (the cache has the PCA index: D² wanted)",
                            hc.loki.len(),
                            s.dim
                        ),
                    ));
                }
                if let Some(x) = hc.loki.iter().find(|x| !x.is_finite()) {
                    return Err(CudaError::invalid(
                        "calibration",
                        format!("head {h}: PCA basis entry {x} is not finite"),
                    ));
                }
                u.extend_from_slice(&hc.loki);
            }
            let same = self.calib.pca[layer]
                .as_ref()
                .is_some_and(|(old, _)| old == &u);
            if same {
                None
            } else if self.calib.appended[layer] {
                return Err(CudaError::invalid(
                    "calibration",
                    format!(
                        "layer {layer} already holds appended tokens: its PCA basis is loaded before the layer's first append (the index of those tokens would be in another basis)"
                    ),
                ));
            } else {
                let dev = DevBuf::from_slice(&u, "PCA basis")?;
                Some((u, dev))
            }
        } else {
            None
        };
        for _ in 0..self.cfg.max_batch {
            for hc in heads {
                tiled.extend_from_slice(&hc.sigma2);
            }
        }
        // Every allocation before any change.
        let sigma2 = DevBuf::from_slice(&tiled, "calibration σ²")?;
        if let Some(p) = pca {
            self.calib.pca[layer] = Some(p);
        }
        self.calib.sigma2[layer] = Some(sigma2);
        self.calib.ds_channels[layer] = Some(heads.iter().map(|h| h.ds_channels.clone()).collect());
        // A static plan made before this calibration is stale, and so is a graph captured
        // before it (it reads the σ² and depth buffers just replaced).
        self.calib.statics.retain(|k, _| !k.starts_with("ds:"));
        self.settings += 1;
        Ok(())
    }

    /// [`crate::api::KvCache::prepare`].
    pub(crate) fn prepare(&mut self, method: crate::config::Method) -> Result<()> {
        use crate::config::Method as M;
        self.not_capturing("prepare")?;
        method.validate(self.cfg.shape.dim)?;
        self.check_tables(method)?;
        let s = self.cfg.shape;
        let (hkv, d) = (s.kv_heads, s.dim);
        let depths: Vec<u8> = match method {
            M::Fathom(_) | M::SparQ(_) | M::Landmark | M::Quest => return Ok(()),
            M::Thumb2 => vec![2; s.layers * hkv * d],
            M::Exact => vec![4; s.layers * hkv * d],
            M::DoubleSparsity(r) => {
                // Layers without a calibration (a model's sliding-window layers, which never
                // attend through a method) keep zero depths; attend refuses them.
                let mut out = vec![0u8; s.layers * hkv * d];
                if self.calib.ds_channels.iter().all(Option::is_none) {
                    return Err(CudaError::invalid(
                        "method",
                        format!("{} needs a calibration (load_calibration)", method.label()),
                    ));
                }
                for l in 0..s.layers {
                    let Some(ch) = self.calib.ds_channels[l].as_ref() else {
                        continue;
                    };
                    for (h, c) in ch.iter().enumerate() {
                        for &x in c.iter().take(r) {
                            out[(l * hkv + h) * d + x as usize] = 4;
                        }
                    }
                }
                out
            }
            M::Loki(r) => {
                if !self.cfg.pca_index {
                    return Err(CudaError::invalid(
                        "method",
                        format!(
                            "{} scans the PCA index, which this cache does not keep (CacheConfig::pca_index)",
                            method.label()
                        ),
                    ));
                }
                if r == 0 || r > d {
                    return Err(CudaError::invalid(
                        "method",
                        format!("{}: r must be 1..={d}", method.label()),
                    ));
                }
                // The first r coordinates of the PCA basis, at 4 planes (docs/SPEC.md §4).
                (0..s.layers * hkv * d)
                    .map(|i| if i % d < r { 4 } else { 0 })
                    .collect()
            }
        };
        let buf = DevBuf::from_slice(&depths, "static plan")?;
        if self.calib.statics.insert(method.label(), buf).is_some() {
            // The old depths are freed: a graph that read them is stale.
            self.settings += 1;
        }
        Ok(())
    }

    /// [`crate::api::KvCache::is_prepared`].
    pub(crate) fn is_prepared(&self, method: crate::config::Method) -> bool {
        self.calib.statics.contains_key(&method.label())
    }

    /// [`crate::api::KvCache::check_method`].
    pub(crate) fn check_method(
        &self,
        method: crate::cache::AttendMethod,
        layer: usize,
    ) -> Result<()> {
        if layer >= self.cfg.shape.layers {
            return Err(CudaError::invalid(
                "layer",
                format!("{layer} (the cache has {})", self.cfg.shape.layers),
            ));
        }
        self.method_inputs(method, layer).map(|_| ())
    }

    /// Landmark and Quest read the block tables: refused by name in a cache without them.
    pub(super) fn check_tables(&self, method: crate::config::Method) -> Result<()> {
        use crate::config::Method as M;
        if matches!(method, M::Landmark | M::Quest) && !self.cfg.block_tables {
            return Err(CudaError::invalid(
                "method",
                format!(
                    "{} reads the block tables, which this cache does not keep (CacheConfig::block_tables)",
                    method.label()
                ),
            ));
        }
        Ok(())
    }

    /// The static depth table and the σ² a method reads at `layer` (device pointers).
    pub(super) fn method_inputs(
        &self,
        method: crate::cache::AttendMethod,
        layer: usize,
    ) -> Result<(Option<u64>, Option<u64>)> {
        use crate::cache::AttendMethod;
        use crate::config::Method as M;
        let s = self.cfg.shape;
        let (hkv, d) = (s.kv_heads, s.dim);
        if let AttendMethod::Scan(m) = method {
            m.validate(d)?;
        }
        // Where this method's depths come from (checked before any launch).
        if let AttendMethod::Scan(m @ M::DoubleSparsity(_)) = method {
            if self.calib.ds_channels[layer].is_none() {
                return Err(CudaError::invalid(
                    "method",
                    format!(
                        "{} needs layer {layer}'s calibration (load_calibration)",
                        m.label()
                    ),
                ));
            }
        }
        if let AttendMethod::Scan(m @ M::Loki(_)) = method {
            if self.calib.pca[layer].is_none() {
                return Err(CudaError::invalid(
                    "method",
                    format!(
                        "{} needs layer {layer}'s PCA basis, loaded before its first append (load_calibration)",
                        m.label()
                    ),
                ));
            }
        }
        if let AttendMethod::Scan(m) = method {
            self.check_tables(m)?;
        }
        let static_depths = match method {
            AttendMethod::Dense
            | AttendMethod::Scan(M::Fathom(_) | M::SparQ(_) | M::Landmark | M::Quest) => None,
            AttendMethod::Scan(m) => {
                let buf = self.calib.statics.get(&m.label()).ok_or_else(|| {
                    CudaError::invalid(
                        "method",
                        format!("{} was not prepared (PagedCache::prepare)", m.label()),
                    )
                })?;
                Some(buf.ptr + (layer * hkv * d) as u64)
            }
        };
        let sigma = match method {
            AttendMethod::Scan(M::Fathom(_)) => Some(
                self.calib.sigma2[layer]
                    .as_ref()
                    .ok_or_else(|| {
                        CudaError::invalid(
                            "method",
                            format!("fathom needs layer {layer}'s σ² (load_calibration)"),
                        )
                    })?
                    .ptr,
            ),
            _ => None,
        };
        Ok((static_depths, sigma))
    }
}
