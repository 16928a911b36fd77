use fathom_plan::calib::ds_order;
use fathom_plan::method::MethodSpec;
use fathom_plan::scan::scan;
use fathom_plan::scanner::{
    check_head_store, check_score_args, rotated_store, HeadInput, HeadScanner, Held, Scanner,
    ScannerError,
};
use fathom_plan::{plan_bits, KeyTiles};
use fathom_store::{BasisKind, StoreView};
use half::f16;

/// The `r` channels of largest weight, ties to the lower channel: the one ordering rule of
/// `fathom_plan::calib::ds_order`, truncated.
fn top_channels(weights: &[f64], r: usize) -> Vec<usize> {
    let mut idx = ds_order(weights);
    idx.truncate(r);
    idx
}

fn depths_for(d: usize, channels: &[usize], t: u8) -> Vec<u8> {
    let mut depths = vec![0u8; d];
    for &c in channels {
        depths[c] = t;
    }
    depths
}

fn check_r(name: &str, r: usize, d: usize) -> Result<(), ScannerError> {
    if r == 0 || r > d {
        return Err(ScannerError::Invalid(format!(
            "{name}: r = {r} channels is out of range 1..={d}"
        )));
    }
    Ok(())
}

/// SparQ (docs/SPEC.md §4): per KV head, the `r` channels with the largest `Σ_h |q_{h,c}|` over the
/// group, read at 4 bits; no mean-value reallocation.
#[derive(Debug, Clone)]
pub struct SparQ {
    /// Channels read.
    pub r: usize,
}

struct StoreHead<'a> {
    store: StoreView<'a>,
}

impl SparQ {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::SparQ { r: self.r }
    }
}

impl Scanner for SparQ {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        check_r("sparq", self.r, input.keys.dim)?;
        check_head_store(input)?;
        Ok(Box::new(SparQHead {
            inner: StoreHead { store: input.store },
            r: self.r,
        }))
    }
}

struct SparQHead<'a> {
    inner: StoreHead<'a>,
    r: usize,
}

impl HeadScanner for SparQHead<'_> {
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError> {
        let d = self.inner.store.dims().channels;
        check_score_args(queries, g, d, out, self.inner.store.tokens())?;
        let w: Vec<f64> = (0..d)
            .map(|c| (0..g).map(|h| queries[h * d + c].abs() as f64).sum())
            .collect();
        let depths = depths_for(d, &top_channels(&w, self.r), 4);
        scan(&self.inner.store, 0, queries, g, &depths, out)?;
        Ok(plan_bits(&depths))
    }
}

/// SparQ per-head union (ablation): each query head picks its own top-`r` channels by
/// `|q_{h,c}|` and scores with them; the union of the heads' channels is what is read.
#[derive(Debug, Clone)]
pub struct SparQUnion {
    /// Channels per head.
    pub r: usize,
}

impl SparQUnion {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::SparQUnion { r: self.r }
    }
}

impl Scanner for SparQUnion {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        check_r("sparq-union", self.r, input.keys.dim)?;
        check_head_store(input)?;
        Ok(Box::new(SparQUnionHead {
            store: input.store,
            r: self.r,
        }))
    }
}

struct SparQUnionHead<'a> {
    store: StoreView<'a>,
    r: usize,
}

impl HeadScanner for SparQUnionHead<'_> {
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError> {
        let d = self.store.dims().channels;
        let n = self.store.tokens();
        check_score_args(queries, g, d, out, n)?;
        let mut union = vec![0u8; d];
        for h in 0..g {
            let q = &queries[h * d..(h + 1) * d];
            let w: Vec<f64> = q.iter().map(|x| x.abs() as f64).collect();
            let depths = depths_for(d, &top_channels(&w, self.r), 4);
            scan(&self.store, 0, q, 1, &depths, &mut out[h * n..(h + 1) * n])?;
            for (u, t) in union.iter_mut().zip(&depths) {
                *u = (*u).max(*t);
            }
        }
        Ok(plan_bits(&union))
    }
}

/// Double Sparsity (docs/SPEC.md §4): `r` channels per head chosen offline by
/// `mean|q_c|·mean|k_c|` on calibration text, read from the 4-bit label cache.
#[derive(Debug, Clone)]
pub struct DoubleSparsity {
    /// Channels read.
    pub r: usize,
}

impl DoubleSparsity {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::DoubleSparsity { r: self.r }
    }
}

impl Scanner for DoubleSparsity {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        let d = input.keys.dim;
        check_r("ds", self.r, d)?;
        check_head_store(input)?;
        let calib = input
            .calib
            .filter(|c| c.ds_channels.len() >= self.r)
            .ok_or_else(|| ScannerError::MissingCalibration {
                method: self.name(),
                what: "ds_channels",
            })?;
        let chans: Vec<usize> = calib.ds_channels[..self.r]
            .iter()
            .map(|&c| c as usize)
            .collect();
        if let Some(&c) = chans.iter().find(|&&c| c >= d) {
            return Err(ScannerError::Invalid(format!("ds channel {c} ≥ D = {d}")));
        }
        Ok(Box::new(FixedHead {
            store: Held::Borrowed(input.store),
            depths: depths_for(d, &chans, 4),
        }))
    }
}

/// A fixed channel set at fixed depths (DS, Loki, thumbnail).
struct FixedHead<'a> {
    store: Held<'a>,
    depths: Vec<u8>,
}

impl HeadScanner for FixedHead<'_> {
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError> {
        let view = self.store.view();
        let d = view.dims().channels;
        check_score_args(queries, g, d, out, view.tokens())?;
        let mut q = vec![0f32; g * d];
        for h in 0..g {
            view.rotate_query(0, &queries[h * d..(h + 1) * d], &mut q[h * d..(h + 1) * d]);
        }
        scan(&view, 0, &q, g, &self.depths, out)?;
        Ok(plan_bits(&self.depths))
    }
}

/// Checks `r` and returns the calibration's Loki basis (`[D][D]`) for this head.
fn loki_basis<'a>(
    input: &HeadInput<'a>,
    kind: &str,
    name: &str,
    r: usize,
) -> Result<&'a [f32], ScannerError> {
    let d = input.keys.dim;
    check_r(kind, r, d)?;
    input
        .calib
        .filter(|c| c.loki.len() == d * d)
        .map(|c| c.loki.as_slice())
        .ok_or_else(|| ScannerError::MissingCalibration {
            method: name.to_string(),
            what: "loki",
        })
}

/// Loki (docs/SPEC.md §4): the first `r` coordinates of the calibration PCA basis (ordered by
/// calibration score variance), read at 4 bits from a store in that basis.
#[derive(Debug, Clone)]
pub struct Loki {
    /// Coordinates read.
    pub r: usize,
}

impl Loki {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::Loki { r: self.r }
    }
}

impl Scanner for Loki {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        let d = input.keys.dim;
        let loki = loki_basis(input, "loki", &self.name(), self.r)?;
        let store = rotated_store(&input.keys, loki, BasisKind::Custom)?;
        let chans: Vec<usize> = (0..self.r).collect();
        Ok(Box::new(FixedHead {
            store: Held::Owned(store),
            depths: depths_for(d, &chans, 4),
        }))
    }
}

/// Loki with fp16 coordinates (ablation): the same `r` PCA coordinates read at fp16
/// instead of 4 bits (`16·r` bits per token).
#[derive(Debug, Clone)]
pub struct LokiF16 {
    /// Coordinates read.
    pub r: usize,
}

impl LokiF16 {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::LokiF16 { r: self.r }
    }
}

impl Scanner for LokiF16 {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        let d = input.keys.dim;
        let u = loki_basis(input, "loki-f16", &self.name(), self.r)?;
        let n = input.keys.rows();
        let mut coords = vec![0f32; n * self.r];
        for i in 0..n {
            let k = input.keys.row(i).expect("i < rows");
            for j in 0..self.r {
                let x: f64 = (0..d).map(|c| u[c * d + j] as f64 * k[c] as f64).sum();
                // Through f32, as landmark_mean: `half`'s f64 → fp16 differs by platform.
                coords[i * self.r + j] = f16::from_f32(x as f32).to_f32();
            }
        }
        Ok(Box::new(LokiF16Head {
            coords,
            basis: u.to_vec(),
            r: self.r,
            d,
        }))
    }
}

struct LokiF16Head {
    coords: Vec<f32>,
    basis: Vec<f32>,
    r: usize,
    d: usize,
}

impl HeadScanner for LokiF16Head {
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError> {
        let (d, r) = (self.d, self.r);
        let n = self.coords.len() / r;
        check_score_args(queries, g, d, out, n)?;
        for h in 0..g {
            let q = &queries[h * d..(h + 1) * d];
            let qr: Vec<f32> = (0..r)
                .map(|j| {
                    (0..d)
                        .map(|c| self.basis[c * d + j] as f64 * q[c] as f64)
                        .sum::<f64>() as f32
                })
                .collect();
            for i in 0..n {
                out[h * n + i] = dot(&qr, &self.coords[i * r..(i + 1) * r]);
            }
        }
        Ok(16.0 * r as f32)
    }
}

/// The 2-bit thumbnail (FFD-style, docs/SPEC.md §4): every channel at 2 planes.
#[derive(Debug, Clone, Default)]
pub struct Thumbnail;

impl Thumbnail {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::Thumb2
    }
}

impl Scanner for Thumbnail {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        check_head_store(input)?;
        Ok(Box::new(FixedHead {
            store: Held::Borrowed(input.store),
            depths: vec![2; input.keys.dim],
        }))
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| *x as f64 * *y as f64)
        .sum::<f64>() as f32
}

/// The block landmark (ShadowKV-style, docs/SPEC.md §4): the fp16 mean key of each 8-token block;
/// a token's score is its block's.
#[derive(Debug, Clone, Default)]
pub struct Landmark;

/// Tokens per landmark block.
pub const LANDMARK_BLOCK: usize = 8;

impl Landmark {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::Landmark
    }
}

impl Scanner for Landmark {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        let (n, d) = (input.keys.rows(), input.keys.dim);
        let nb = n.div_ceil(LANDMARK_BLOCK);
        let mut means = vec![0f32; nb * d];
        for b in 0..nb {
            let (lo, hi) = (b * LANDMARK_BLOCK, ((b + 1) * LANDMARK_BLOCK).min(n));
            for c in 0..d {
                means[b * d + c] =
                    landmark_mean((lo..hi).map(|i| input.keys.row(i).expect("row")[c]));
            }
        }
        Ok(Box::new(PageHead {
            tables: vec![means],
            page: LANDMARK_BLOCK,
            n,
            d,
            bits: 2.0 * d as f32,
            quest: false,
        }))
    }
}

/// Quest (docs/SPEC.md §4): per 16-token page, channel-wise fp16 min and max; page score
/// `Σ_c max(q_c·min_c, q_c·max_c)`, an upper bound on every key's score in the page.
#[derive(Debug, Clone, Default)]
pub struct Quest;

/// Tokens per Quest page.
pub const QUEST_PAGE: usize = 16;

impl Quest {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::Quest
    }
}

impl Scanner for Quest {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        let (n, d) = (input.keys.rows(), input.keys.dim);
        let np = n.div_ceil(QUEST_PAGE);
        let mut mins = vec![0f32; np * d];
        let mut maxs = vec![0f32; np * d];
        for p in 0..np {
            let (lo, hi) = (p * QUEST_PAGE, ((p + 1) * QUEST_PAGE).min(n));
            for c in 0..d {
                let (mn, mx) = quest_bounds((lo..hi).map(|i| input.keys.row(i).expect("row")[c]));
                mins[p * d + c] = mn;
                maxs[p * d + c] = mx;
            }
        }
        Ok(Box::new(PageHead {
            tables: vec![mins, maxs],
            page: QUEST_PAGE,
            n,
            d,
            bits: 2.0 * d as f32,
            quest: true,
        }))
    }
}

/// One channel of one landmark block: the mean of its keys (summed in f64 in order), rounded
/// to f32 and then to fp16 (each to nearest, ties to even). The one rule for the CPU scanner
/// and the GPU tables: the two roundings are spelled out because `half`'s own f64 → fp16
/// conversion differs by platform (through f32 with F16C, a direct rounding that ignores the
/// low 32 mantissa bits without it).
pub fn landmark_mean(xs: impl Iterator<Item = f32>) -> f32 {
    let (s, n) = xs.fold((0f64, 0usize), |(s, n), x| (s + x as f64, n + 1));
    f16::from_f32((s / n.max(1) as f64) as f32).to_f32()
}

/// One channel of one Quest page: its keys' min and max in fp16, rounded outward so that the
/// bounds still bound every key. The one rule for the CPU scanner and the GPU tables.
pub fn quest_bounds(xs: impl Iterator<Item = f32>) -> (f32, f32) {
    let (mn, mx) = xs.fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), x| {
        (a.min(x), b.max(x))
    });
    (round_down_f16(mn), round_up_f16(mx))
}

fn round_down_f16(x: f32) -> f32 {
    let h = f16::from_f32(x);
    if h.to_f32() > x {
        f16::from_bits(if x > 0.0 {
            h.to_bits() - 1
        } else {
            h.to_bits() + 1
        })
        .to_f32()
    } else {
        h.to_f32()
    }
}

fn round_up_f16(x: f32) -> f32 {
    -round_down_f16(-x)
}

struct PageHead {
    tables: Vec<Vec<f32>>,
    page: usize,
    n: usize,
    d: usize,
    bits: f32,
    quest: bool,
}

impl HeadScanner for PageHead {
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError> {
        let (n, d) = (self.n, self.d);
        check_score_args(queries, g, d, out, n)?;
        let np = n.div_ceil(self.page);
        for h in 0..g {
            let q: Vec<f64> = queries[h * d..(h + 1) * d]
                .iter()
                .map(|&x| x as f64)
                .collect();
            // PAGE_LANES pages at a time: independent sums that overlap in the pipeline, each
            // still accumulated channel by channel in order.
            for p0 in (0..np).step_by(PAGE_LANES) {
                let lanes = PAGE_LANES.min(np - p0);
                let mut acc = [0f64; PAGE_LANES];
                if self.quest {
                    let (mn, mx) = (&self.tables[0], &self.tables[1]);
                    for (c, &qc) in q.iter().enumerate() {
                        for (j, a) in acc.iter_mut().enumerate().take(lanes) {
                            let at = (p0 + j) * d + c;
                            *a += (qc * mn[at] as f64).max(qc * mx[at] as f64);
                        }
                    }
                } else {
                    let t = &self.tables[0];
                    for (c, &qc) in q.iter().enumerate() {
                        for (j, a) in acc.iter_mut().enumerate().take(lanes) {
                            *a += qc * t[(p0 + j) * d + c] as f64;
                        }
                    }
                }
                for (j, &a) in acc.iter().enumerate().take(lanes) {
                    let p = p0 + j;
                    let (lo, hi) = (p * self.page, ((p + 1) * self.page).min(n));
                    out[h * n + lo..h * n + hi].fill(a as f32);
                }
            }
        }
        Ok(self.bits)
    }
}

/// Pages [`PageHead`] scores together.
const PAGE_LANES: usize = 8;

/// Exact top-k (oracle): exact scores `q·k` from the full-precision keys.
#[derive(Debug, Clone, Default)]
pub struct Exact;

struct ExactHead {
    /// The keys, transposed for fast exact dot products.
    tiles: KeyTiles,
}

impl Exact {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::Exact
    }
}

impl Scanner for Exact {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        Ok(Box::new(ExactHead {
            tiles: KeyTiles::new(input.keys),
        }))
    }
}

impl HeadScanner for ExactHead {
    fn score(&self, queries: &[f32], g: usize, out: &mut [f32]) -> Result<f32, ScannerError> {
        let (n, d) = (self.tiles.rows(), self.tiles.dim());
        check_score_args(queries, g, d, out, n)?;
        for h in 0..g {
            let q = &queries[h * d..(h + 1) * d];
            self.tiles.scores(q, &mut out[h * n..(h + 1) * n])?;
        }
        Ok(16.0 * d as f32)
    }
}

/// Dense attention: every key, no selection (error 0 by construction).
#[derive(Debug, Clone, Default)]
pub struct Dense;

impl Dense {
    /// This method in the one grammar (`fathom_plan::method`).
    pub fn method(&self) -> MethodSpec {
        MethodSpec::Dense
    }
}

impl Scanner for Dense {
    fn name(&self) -> String {
        self.method().to_string()
    }
    fn spec(&self) -> Option<MethodSpec> {
        Some(self.method())
    }
    fn is_dense(&self) -> bool {
        true
    }
    fn prepare<'a>(
        &'a self,
        input: &HeadInput<'a>,
    ) -> Result<Box<dyn HeadScanner + 'a>, ScannerError> {
        Ok(Box::new(ExactHead {
            tiles: KeyTiles::new(input.keys),
        }))
    }
}
