//! Shapes, methods, residencies and host pages shared by the CUDA and the stub backends.

use serde::{Deserialize, Serialize};

use fathom_plan::method::{FathomVariant, MethodSpec};

use crate::error::{CudaError, Result};

/// Per-layer attention shape (docs/SPEC.md §1): `L` layers, `Hkv` KV heads, `G` query heads per KV
/// head, `D` channels per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    /// Layers `L`.
    pub layers: usize,
    /// KV heads `Hkv`.
    pub kv_heads: usize,
    /// Query heads per KV head `G`.
    pub group: usize,
    /// Channels per head `D`.
    pub dim: usize,
}

impl ModelShape {
    /// Parses `qwen3-8b`, `llama3.1-8b`, `qwen2.5-7b` or `L,HKV,G,D` (docs/SPEC.md §6 shapes).
    ///
    /// ```
    /// let s = fathom_cuda::ModelShape::parse("qwen3-8b")?;
    /// assert_eq!((s.layers, s.kv_heads, s.group, s.dim), (36, 8, 4, 128));
    /// assert_eq!(fathom_cuda::ModelShape::parse("2,4,7,64")?.group, 7);
    /// # Ok::<(), fathom_cuda::CudaError>(())
    /// ```
    pub fn parse(s: &str) -> Result<Self> {
        let shape = match s.to_ascii_lowercase().as_str() {
            "qwen3-8b" => ModelShape {
                layers: 36,
                kv_heads: 8,
                group: 4,
                dim: 128,
            },
            "llama3.1-8b" | "llama-3.1-8b" => ModelShape {
                layers: 32,
                kv_heads: 8,
                group: 4,
                dim: 128,
            },
            "qwen2.5-7b" => ModelShape {
                layers: 28,
                kv_heads: 4,
                group: 7,
                dim: 128,
            },
            other => {
                let v: Vec<usize> = other
                    .split(',')
                    .map(|x| x.trim().parse::<usize>())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|e| {
                        CudaError::invalid(
                            "shape",
                            format!("`{s}`: {e} (want a name or L,HKV,G,D)"),
                        )
                    })?;
                if v.len() != 4 {
                    return Err(CudaError::invalid(
                        "shape",
                        format!("`{s}`: want L,HKV,G,D"),
                    ));
                }
                ModelShape {
                    layers: v[0],
                    kv_heads: v[1],
                    group: v[2],
                    dim: v[3],
                }
            }
        };
        shape.validate()
    }

    /// Checks the limits the kernels assume: `D` a multiple of 32 in `32..=256`, `1 ≤ G ≤ 16`.
    pub fn validate(self) -> Result<Self> {
        if self.layers == 0 || self.kv_heads == 0 {
            return Err(CudaError::invalid(
                "shape",
                "layers and KV heads must be positive",
            ));
        }
        if self.dim % 32 != 0 || !(32..=256).contains(&self.dim) {
            return Err(CudaError::invalid(
                "shape",
                format!(
                    "D = {} (kernels need a multiple of 32 in 32..=256)",
                    self.dim
                ),
            ));
        }
        if !(1..=16).contains(&self.group) {
            return Err(CudaError::invalid(
                "shape",
                format!("G = {} (kernels take 1..=16)", self.group),
            ));
        }
        Ok(self)
    }

    /// Bytes of one K/V record: a token's K and V of one KV head in bf16 (`4·D`).
    pub fn record_bytes(&self) -> usize {
        4 * self.dim
    }
}

/// A scan method of docs/SPEC.md §4, as the offload step runs it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Method {
    /// Fathom at a budget of `B` bits: GPU importance + water-filling per query group.
    Fathom(f32),
    /// SparQ: the `r` channels with largest `Σ_h |q_hc|`, chosen on the GPU, at 4 planes.
    SparQ(usize),
    /// Double Sparsity: `r` channels per head fixed offline (calibration), at 4 planes.
    DoubleSparsity(usize),
    /// Loki: the first `r` coordinates of the PCA basis, at 4 planes.
    Loki(usize),
    /// All channels at 2 planes (FFD-style thumbnail).
    Thumb2,
    /// ShadowKV-style block landmarks: fp16 mean key per 8 tokens, read from its own table.
    Landmark,
    /// Quest: per 16-token page channel-wise fp16 min and max, from its own table.
    Quest,
    /// The full 4-bit store (all channels, 4 planes): the scan an exact-store method reads.
    Exact,
}

impl Method {
    /// Parses `fathom:48`, `sparq:16`, `ds:32`, `loki:32`, `thumb2`, `landmark`, `quest`, `exact`
    /// at head dimension `dim`, with the ranges of the one method grammar
    /// ([`fathom_plan::method::MethodSpec`]): a typo or an out-of-range argument is an error
    /// here, before any device is opened.
    ///
    /// ```
    /// use fathom_cuda::Method;
    /// assert_eq!(Method::parse("fathom:48", 128)?, Method::Fathom(48.0));
    /// assert_eq!(Method::parse("ds:32", 128)?.bits(128), 136.0);
    /// assert!(Method::parse("sparq:-3", 128).is_err());
    /// assert!(Method::parse("fathom-uniform:48", 128).is_err()); // not a GPU method
    /// # Ok::<(), fathom_cuda::CudaError>(())
    /// ```
    pub fn parse(s: &str, dim: usize) -> Result<Self> {
        let spec =
            MethodSpec::parse(s, dim).map_err(|e| CudaError::invalid("method", e.to_string()))?;
        Method::try_from(spec)
    }

    /// Checks a method built directly (its variants are public) against the grammar's ranges
    /// at head dimension `dim`, as [`Method::parse`] does: a budget that is not a finite
    /// number in range, or `r` of 0 or past D, would otherwise reach the kernels (a NaN
    /// budget plans every depth 0, and the top-k of all-zero scores is silently positional).
    ///
    /// ```
    /// use fathom_cuda::Method;
    /// assert!(Method::Fathom(48.0).validate(128).is_ok());
    /// assert!(Method::Fathom(f32::NAN).validate(128).is_err());
    /// assert!(Method::SparQ(0).validate(128).is_err());
    /// # Ok::<(), fathom_cuda::CudaError>(())
    /// ```
    ///
    /// # Errors
    /// The grammar's range error, naming the method.
    pub fn validate(&self, dim: usize) -> Result<()> {
        let label = self.label();
        let back = Method::parse(&label, dim)?;
        // Display is the shortest round trip of the f32, so only an out-of-range value differs.
        if back != *self {
            return Err(CudaError::invalid(
                "method",
                format!("{label} does not read back as itself"),
            ));
        }
        Ok(())
    }

    /// The method in the shared grammar.
    pub fn spec(&self) -> MethodSpec {
        match *self {
            Method::Fathom(budget) => MethodSpec::Fathom {
                variant: FathomVariant::Plan,
                budget,
            },
            Method::SparQ(r) => MethodSpec::SparQ { r },
            Method::DoubleSparsity(r) => MethodSpec::DoubleSparsity { r },
            Method::Loki(r) => MethodSpec::Loki { r },
            Method::Thumb2 => MethodSpec::Thumb2,
            Method::Landmark => MethodSpec::Landmark,
            Method::Quest => MethodSpec::Quest,
            Method::Exact => MethodSpec::Exact,
        }
    }

    /// The label used in reports (`fathom:48`, ...): the grammar's display.
    pub fn label(&self) -> String {
        self.spec().to_string()
    }

    /// Nominal scan bits per token per KV head at `D` channels (Fathom: its budget, an upper
    /// bound; the measured bits are reported separately).
    pub fn bits(&self, dim: usize) -> f32 {
        match *self {
            // The GPU's exact step scans the whole 4-bit store (all channels, 4 planes).
            Method::Exact => 4.25 * dim as f32,
            _ => self.spec().nominal_bits(dim),
        }
    }

    /// Whether the method scans the paged cache's PCA index
    /// ([`crate::cache::CacheConfig::pca_index`]): Loki.
    pub fn reads_pca_index(&self) -> bool {
        matches!(self, Method::Loki(_))
    }

    /// Whether the method reads the paged cache's block tables
    /// ([`crate::cache::CacheConfig::block_tables`]): landmark and Quest.
    pub fn reads_block_tables(&self) -> bool {
        matches!(self, Method::Landmark | Method::Quest)
    }

    /// Whether the method scans the bit-plane store (all but the table methods).
    pub fn uses_planes(&self) -> bool {
        !matches!(self, Method::Landmark | Method::Quest)
    }
}

impl TryFrom<MethodSpec> for Method {
    type Error = CudaError;
    /// The methods the GPU step implements; the CPU-only ablations are an error.
    fn try_from(m: MethodSpec) -> Result<Self> {
        Ok(match m {
            MethodSpec::Fathom {
                variant: FathomVariant::Plan,
                budget,
            } => Method::Fathom(budget),
            MethodSpec::SparQ { r } => Method::SparQ(r),
            MethodSpec::DoubleSparsity { r } => Method::DoubleSparsity(r),
            MethodSpec::Loki { r } => Method::Loki(r),
            MethodSpec::Thumb2 => Method::Thumb2,
            MethodSpec::Landmark => Method::Landmark,
            MethodSpec::Quest => Method::Quest,
            MethodSpec::Exact => Method::Exact,
            other => {
                return Err(CudaError::invalid(
                    "method",
                    format!(
                        "`{other}` is not a GPU step method (fathom:B, sparq:R, ds:R, loki:R, thumb2, landmark, quest, exact)"
                    ),
                ))
            }
        })
    }
}

/// Where the scan store and the K/V rows live during the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Residency {
    /// Pinned, mapped host memory; the GPU reads it over PCIe (zero-copy).
    Host,
    /// Device memory (HBM); no PCIe traffic in the step.
    Hbm,
    /// Split (the paged cache only, docs/SPEC.md §6.1): the index (bit planes and block
    /// scales) in HBM, the bf16 K|V records in pinned, mapped host memory. The scan reads HBM;
    /// only the rows the selection fetches (past the row cache) cross the link. Costs HBM for
    /// `4·D/8 + D/32` bytes per token and KV head of the index, not the `4·D` of the records.
    IndexHbm,
}

impl Residency {
    /// Parses `host`, `hbm` or `index-hbm`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "host" => Ok(Residency::Host),
            "hbm" => Ok(Residency::Hbm),
            "index-hbm" => Ok(Residency::IndexHbm),
            _ => Err(CudaError::invalid(
                "residency",
                format!("`{s}` (want host, hbm or index-hbm)"),
            )),
        }
    }
    /// `host`, `hbm` or `index-hbm`.
    pub fn label(&self) -> &'static str {
        match self {
            Residency::Host => "host",
            Residency::Hbm => "hbm",
            Residency::IndexHbm => "index-hbm",
        }
    }
    /// Whether the K|V records live in host memory (every row the step reads crosses the link
    /// unless the row cache holds it).
    pub fn records_on_host(&self) -> bool {
        matches!(self, Residency::Host | Residency::IndexHbm)
    }
}

/// What backs pinned, mapped host memory (docs/SPEC.md §6.1, "Host pages").
///
/// The GPU translates every zero-copy address through its own page tables; random reads of
/// 512-byte records spread over tens of GiB (the union fetch) touch a new host page per row.
/// `Huge` asks the kernel for 2 MiB transparent huge pages and registers them with the driver,
/// so that one translation covers 4096 records instead of 8; whether that is faster is a
/// measurement (`fathom-bench`'s `examples/row_sweep.rs`), not an assumption.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum HostPages {
    /// `cuMemHostAlloc(DEVICEMAP | PORTABLE)`: the driver's pages.
    #[default]
    Driver,
    /// Anonymous memory aligned to 2 MiB and advised `MADV_HUGEPAGE`, touched, then pinned and
    /// mapped by `cuMemHostRegister(DEVICEMAP | PORTABLE)`. Linux only (elsewhere a typed
    /// error); where the kernel has no huge page to give, the pages are ordinary ones (the
    /// sweep reports how many bytes huge pages back).
    Huge,
    /// The virtual memory API: `cuMemCreate` on the GPU's host NUMA node, mapped by
    /// `cuMemMap` at the driver's recommended granularity (at least 2 MiB) and opened to the
    /// device and the host by `cuMemSetAccess`, so the GPU's own mapping of the memory uses
    /// large pages whatever the kernel's pages are (on the H200 random record reads were no
    /// faster for it: they are bound per access on the host side). Needs a driver and OS that
    /// support host NUMA allocations (CUDA 12.2+ on Linux; elsewhere a typed error).
    Vmm,
}

impl HostPages {
    /// Every kind, in the order the sweeps report them.
    pub const ALL: [HostPages; 3] = [HostPages::Driver, HostPages::Huge, HostPages::Vmm];
    /// Parses `driver`, `huge` or `vmm`.
    pub fn parse(s: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|p| p.label().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                CudaError::invalid("host pages", format!("`{s}` (want driver, huge or vmm)"))
            })
    }
    /// `driver`, `huge` or `vmm`.
    pub fn label(&self) -> &'static str {
        match self {
            HostPages::Driver => "driver",
            HostPages::Huge => "huge",
            HostPages::Vmm => "vmm",
        }
    }
}

/// Bytes of this process's memory that transparent huge pages back (`AnonHugePages` of
/// `/proc/self/smaps_rollup`); `None` where the file is absent (not Linux, old kernels). How
/// [`HostPages::Huge`] is checked: the growth over an allocation is the bytes huge pages back.
pub fn anon_huge_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let line = s.lines().find(|l| l.starts_with("AnonHugePages:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn residencies_parse_and_label_each_other() {
        for r in [Residency::Host, Residency::Hbm, Residency::IndexHbm] {
            assert_eq!(Residency::parse(r.label()).unwrap(), r);
        }
        assert_eq!(Residency::parse("Index-HBM").unwrap(), Residency::IndexHbm);
        assert!(Residency::Host.records_on_host() && Residency::IndexHbm.records_on_host());
        assert!(!Residency::Hbm.records_on_host());
        let e = Residency::parse("split").unwrap_err().to_string();
        assert!(e.contains("index-hbm"), "{e}");
    }

    #[test]
    fn host_pages_parse_and_label_each_other() {
        for p in HostPages::ALL {
            assert_eq!(HostPages::parse(p.label()).unwrap(), p);
        }
        assert_eq!(HostPages::parse("HUGE").unwrap(), HostPages::Huge);
        assert_eq!(HostPages::default(), HostPages::Driver);
        let e = HostPages::parse("2m").unwrap_err().to_string();
        assert!(e.contains("driver, huge or vmm"), "{e}");
    }
}
