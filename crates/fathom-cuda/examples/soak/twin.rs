//! The CPU twin: every key and value each live session holds, per layer (bf16, as stored), and
//! the checks of a subject against it: its stores equal `fathom_store::KeyStore` of the kept
//! keys bit for bit (and its PCA index the store in the calibration basis), its records are
//! the bf16 rows, and each query head's attend output follows the per-head CPU protocol of
//! docs/SPEC.md §5 (`fathom-plan`'s references), as `tests/cache_gpu.rs` checks it.

use std::collections::BTreeMap;

use fathom_cuda::cache::{AppendBatch, AttendDebug, AttendMethod, CacheConfig};
use fathom_cuda::pages::SessionId;
use fathom_cuda::Method;
use fathom_plan::scanner::{HeadCalib, HeadInput, Scanner};
use fathom_plan::{KvView, SelectParams};
use fathom_store::{Basis, BasisKind, Dims, KeyStore, StoreView};
use half::bf16;

use crate::subject::Subject;

/// f32 accumulation of ≤ D = 256 products on the GPU against f64 on the CPU: |error| ≤
/// D·ε·Σ|terms| ≈ 1.5e-5 of the magnitude in the worst case; 2e-5 leaves headroom (the
/// device tests' bound).
pub const SCORE_TOL: f64 = 2e-5;
/// bf16 rows, f32 online softmax on the GPU against the CPU's f64 (the device tests' bound).
pub const ATTN_TOL: f64 = 1e-3;

/// `x` rounded to bf16 (what the cache stores).
pub fn bf(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// One (session, layer): the bf16 keys and values appended so far, `[n][Hkv][D]`.
#[derive(Debug, Clone, Default)]
pub struct Shadow {
    /// Keys.
    pub k: Vec<f32>,
    /// Values.
    pub v: Vec<f32>,
}

/// The CPU side of a cache: its sessions' rows, its calibration and PCA bases.
pub struct Twin {
    /// The cache's configuration.
    pub cfg: CacheConfig,
    /// Per live session, per layer.
    pub sessions: BTreeMap<SessionId, Vec<Shadow>>,
    /// Per layer, per KV head.
    pub calib: Vec<Vec<HeadCalib>>,
    /// Per layer, Loki's basis (the calibration's PCA).
    pub bases: Vec<Basis>,
}

/// A query head's reference scores: within [`SCORE_TOL`] of the magnitude, or bit for bit.
pub enum RefScores {
    /// `(scores, Σ|terms|)` of the bit-plane scan, f64.
    Approx(Vec<f64>, Vec<f64>),
    /// A block-table scanner's scores (landmark, Quest): the cache's bit for bit.
    Exact(Vec<f32>),
}

impl Twin {
    /// An empty twin of a cache.
    pub fn new(cfg: CacheConfig, calib: Vec<Vec<HeadCalib>>) -> Twin {
        let s = cfg.shape;
        let bases = calib
            .iter()
            .map(|c| {
                let mats = c.iter().flat_map(|h| h.loki.iter().copied()).collect();
                Basis::new(BasisKind::Custom, s.kv_heads, s.dim, mats).expect("a drawn basis")
            })
            .collect();
        Twin {
            cfg,
            sessions: BTreeMap::new(),
            calib,
            bases,
        }
    }

    /// `[Hkv][D]` of the cache.
    pub fn dims(&self) -> Dims {
        Dims {
            heads: self.cfg.shape.kv_heads,
            channels: self.cfg.shape.dim,
        }
    }

    /// Tokens of a live session.
    pub fn len(&self, s: SessionId) -> usize {
        self.sessions[&s][0].k.len() / self.dims().row()
    }

    /// The live sessions, in order.
    pub fn live(&self) -> Vec<SessionId> {
        self.sessions.keys().copied().collect()
    }

    /// A new empty session.
    pub fn created(&mut self, s: SessionId) {
        self.sessions
            .insert(s, vec![Shadow::default(); self.cfg.shape.layers]);
    }

    /// `child` holds `parent`'s rows.
    pub fn forked(&mut self, parent: SessionId, child: SessionId) {
        let rows = self.sessions[&parent].clone();
        self.sessions.insert(child, rows);
    }

    /// A freed session.
    pub fn freed(&mut self, s: SessionId) {
        self.sessions.remove(&s);
    }

    /// A session cut to `len` tokens in every layer.
    pub fn truncated(&mut self, s: SessionId, len: usize) {
        let row = self.dims().row();
        for sh in self.sessions.get_mut(&s).expect("a live session") {
            sh.k.truncate(len * row);
            sh.v.truncate(len * row);
        }
    }

    /// One layer's rows `[rows][Hkv][D]` of a batch, appended.
    pub fn appended(&mut self, b: &AppendBatch, layer: usize, k: &[f32], v: &[f32]) {
        let row = self.dims().row();
        for (p, &r0) in b.plans.iter().zip(&b.row0) {
            let sh = &mut self.sessions.get_mut(&p.session).expect("a live session")[layer];
            let (lo, hi) = (r0 * row, (r0 + p.tokens) * row);
            sh.k.extend(k[lo..hi].iter().map(|&x| bf(x)));
            sh.v.extend(v[lo..hi].iter().map(|&x| bf(x)));
        }
    }

    /// A session's length, stores (and PCA index), records in every layer against the twin.
    ///
    /// # Errors
    /// The first difference, named.
    pub fn check_store<S: Subject>(&self, subj: &S, s: SessionId) -> Result<(), String> {
        let dims = self.dims();
        let n = self.len(s);
        let got = subj.len(s).map_err(|e| format!("len: {e}"))?;
        if got != n {
            return Err(format!("length {got}, twin {n}"));
        }
        for (l, sh) in self.sessions[&s].iter().enumerate() {
            if n == 0 {
                let ex = subj.export(s, l).map_err(|e| format!("export: {e}"))?;
                if ex.tokens != 0 {
                    return Err(format!(
                        "layer {l}: an empty session exports {} tokens",
                        ex.tokens
                    ));
                }
                continue;
            }
            let store = KeyStore::from_keys(dims, &sh.k, None).map_err(|e| e.to_string())?;
            let ex = subj.export(s, l).map_err(|e| format!("export: {e}"))?;
            ex.compare(&store.view())
                .map_err(|e| format!("layer {l}, {n} tokens: store {e}"))?;
            if self.cfg.pca_index {
                let pca = KeyStore::from_keys(dims, &sh.k, Some(self.bases[l].clone()))
                    .map_err(|e| e.to_string())?;
                let ex = subj
                    .export_pca(s, l)
                    .map_err(|e| format!("export_pca: {e}"))?;
                ex.compare(&pca.view())
                    .map_err(|e| format!("layer {l}, {n} tokens: PCA index {e}"))?;
            }
            let rec = subj.records(s, l).map_err(|e| format!("records: {e}"))?;
            let d = dims.channels;
            for h in 0..dims.heads {
                for i in 0..n {
                    let r = &rec[(h * n + i) * 2 * d..(h * n + i + 1) * 2 * d];
                    let src = (i * dims.heads + h) * d;
                    let (kk, vv) = (&sh.k[src..src + d], &sh.v[src..src + d]);
                    let same = (0..d).all(|c| r[c].to_f32() == kk[c] && r[d + c].to_f32() == vv[c]);
                    if !same {
                        return Err(format!("layer {l}: K|V record of token {i}, head {h}"));
                    }
                }
            }
        }
        Ok(())
    }

    /// One attend's output `out` (queries `q`) against the per-head CPU protocol: per batch
    /// member and query head, the scores (within [`SCORE_TOL`], or bit for bit for the block
    /// tables), a GPU-planned method's depths, the top-k (the CPU selection over the
    /// subject's scores: ties to the lower index on both sides) and exact attention over that
    /// set within [`ATTN_TOL`]. Returns the query heads checked.
    ///
    /// # Errors
    /// The first difference, named.
    pub fn check_attend<S: Subject>(
        &self,
        subj: &S,
        (b, layer): (&AppendBatch, usize),
        (m, p): (AttendMethod, &SelectParams),
        q: &[f32],
        out: &[f32],
    ) -> Result<usize, String> {
        let sh = self.cfg.shape;
        let (hkv, g, d) = (sh.kv_heads, sh.group, sh.dim);
        let hq = hkv * g;
        if out.len() != b.plans.len() * hq * d {
            return Err(format!(
                "{} outputs for {} sessions",
                out.len(),
                b.plans.len()
            ));
        }
        let mut heads = 0;
        for (i, plan) in b.plans.iter().enumerate() {
            let rows = &self.sessions[&plan.session][layer];
            let (kb, vb) = (&rows.k[..], &rows.v[..]);
            let n = kb.len() / (hkv * d);
            let dbg = match m {
                AttendMethod::Dense => None,
                AttendMethod::Scan(_) => {
                    Some(subj.readback(b, i).map_err(|e| format!("readback: {e}"))?)
                }
            };
            let stores = match m {
                AttendMethod::Scan(_) => Some(Stores::new(self, m, layer, kb)?),
                AttendMethod::Dense => None,
            };
            for h in 0..hkv {
                let qh = &q[(i * hq + h * g) * d..(i * hq + (h + 1) * g) * d];
                for gg in 0..g {
                    let o = (i * hq + h * g + gg) * d;
                    let tag = format!("session {i} head {h} q {gg}");
                    let sel = match (&dbg, &stores, m) {
                        (Some(dbg), Some(st), AttendMethod::Scan(mm)) => {
                            let r = self.reference(mm, layer, st, kb, qh, h)?;
                            check_scan(dbg, &r, (h, g, gg, n), p, &tag)?
                        }
                        _ => (0..n as u32).collect(),
                    };
                    let want = attend_ref(&qh[gg * d..(gg + 1) * d], (kb, vb), (hkv, d, h), &sel)?;
                    let err = fathom_plan::relative_error(&out[o..o + d], &want);
                    if err.is_nan() || err > ATTN_TOL {
                        return Err(format!("{tag}: attention relative error {err}"));
                    }
                    heads += 1;
                }
            }
        }
        Ok(heads)
    }

    /// KV head `h`'s reference for `m` over keys `kb`: the GPU-planned depths (Fathom, SparQ)
    /// and the scores of the `G` queries `qh`.
    pub fn reference(
        &self,
        m: Method,
        layer: usize,
        st: &Stores,
        kb: &[f32],
        qh: &[f32],
        h: usize,
    ) -> Result<Reference, String> {
        let (hkv, g, d) = (
            self.cfg.shape.kv_heads,
            self.cfg.shape.group,
            self.cfg.shape.dim,
        );
        let calib = &self.calib[layer][h];
        let planned = matches!(m, Method::Fathom(_) | Method::SparQ(_));
        let scores = match m {
            Method::Landmark | Method::Quest => {
                let input = HeadInput {
                    layer,
                    keys: KvView::head(kb, hkv, d, h),
                    store: st.raw.view(),
                    calib: None,
                    klt_store: None,
                };
                let scanner = match m {
                    Method::Landmark => fathom_baselines::Landmark.prepare(&input),
                    _ => fathom_baselines::Quest.prepare(&input),
                }
                .map_err(|e| e.to_string())?;
                let mut want = vec![0f32; g * (kb.len() / (hkv * d))];
                scanner.score(qh, g, &mut want).map_err(|e| e.to_string())?;
                RefScores::Exact(want)
            }
            Method::Loki(r) => {
                let pca = st.pca.as_ref().ok_or("loki without a PCA store")?;
                let view = pca.view();
                let mut qr = vec![0f32; g * d];
                for gg in 0..g {
                    view.rotate_query(h, &qh[gg * d..(gg + 1) * d], &mut qr[gg * d..(gg + 1) * d]);
                }
                let depths: Vec<u8> = (0..d).map(|c| if c < r { 4 } else { 0 }).collect();
                scan_ref(&view, h, &qr, g, &depths)?
            }
            _ => {
                let depths = cpu_depths(m, calib, qh, g, d)?;
                let s = scan_ref(&st.raw.view(), h, qh, g, &depths)?;
                return Ok(Reference {
                    depths: planned.then_some(depths),
                    scores: s,
                });
            }
        };
        Ok(Reference {
            depths: None,
            scores,
        })
    }
}

/// One KV head's reference: the depths a GPU-planned method must have chosen, and the scores.
pub struct Reference {
    /// Fathom's and SparQ's plan, `[D]`.
    pub depths: Option<Vec<u8>>,
    /// `[G][n]`.
    pub scores: RefScores,
}

/// The stores an attend's reference reads: the raw store, and the PCA store for Loki.
pub struct Stores {
    raw: KeyStore,
    pca: Option<KeyStore>,
}

impl Stores {
    /// The stores of keys `kb` (bf16) of one (session, layer) that method `m` reads.
    pub fn new(t: &Twin, m: AttendMethod, layer: usize, kb: &[f32]) -> Result<Stores, String> {
        let raw = KeyStore::from_keys(t.dims(), kb, None).map_err(|e| e.to_string())?;
        let pca = match m {
            AttendMethod::Scan(Method::Loki(_)) => Some(
                KeyStore::from_keys(t.dims(), kb, Some(t.bases[layer].clone()))
                    .map_err(|e| e.to_string())?,
            ),
            _ => None,
        };
        Ok(Stores { raw, pca })
    }
}

fn scan_ref(
    view: &StoreView<'_>,
    h: usize,
    qh: &[f32],
    g: usize,
    depths: &[u8],
) -> Result<RefScores, String> {
    let (s, mag) =
        fathom_plan::scan::reference_scores(view, h, qh, g, depths).map_err(|e| e.to_string())?;
    Ok(RefScores::Approx(s, mag))
}

/// Query head `(h, gg)` of a scan attend: the subject's depths and scores against the
/// reference, and its winners against the CPU selection over its scores; returns that
/// selection (sink, local and the middle's top-k).
fn check_scan(
    dbg: &AttendDebug,
    r: &Reference,
    (h, g, gg, n): (usize, usize, usize, usize),
    p: &SelectParams,
    tag: &str,
) -> Result<Vec<u32>, String> {
    if let Some(dep) = &r.depths {
        let d = dep.len();
        if dbg.depths[h * d..(h + 1) * d] != dep[..] {
            return Err(format!("{tag}: depths"));
        }
    }
    let qrow = h * g + gg;
    let row = &dbg.scores[qrow * n..(qrow + 1) * n];
    match &r.scores {
        RefScores::Approx(s, mag) => {
            let off = gg * n;
            if let Some(i) = (0..n).find(|&i| {
                let (got, want) = (row[i] as f64, s[off + i]);
                got.is_nan() || (got - want).abs() > SCORE_TOL * mag[off + i] + 1e-30
            }) {
                return Err(format!(
                    "{tag} token {i}: score {} cpu {}",
                    row[i],
                    s[off + i]
                ));
            }
        }
        RefScores::Exact(s) => {
            if let Some(i) = (0..n).find(|&i| row[i].to_bits() != s[gg * n + i].to_bits()) {
                return Err(format!(
                    "{tag} token {i}: score {} cpu {}",
                    row[i],
                    s[gg * n + i]
                ));
            }
        }
    }
    let (sel, mid) = select(row, p)?;
    if dbg.winners[qrow] != mid {
        return Err(format!(
            "{tag}: top-k {:?} cpu {:?}",
            dbg.winners[qrow], mid
        ));
    }
    Ok(sel)
}

/// The §5 selection of a query row of scores (ties to the lower index): the whole set and
/// its middle's top-k, sorted.
pub fn select(row: &[f32], p: &SelectParams) -> Result<(Vec<u32>, Vec<u32>), String> {
    let n = row.len();
    let mut sel = Vec::new();
    fathom_plan::select_per_head(n - 1, row, p, &mut sel).map_err(|e| e.to_string())?;
    let mid = p.middle(n - 1);
    let top = sel
        .iter()
        .copied()
        .filter(|&i| mid.contains(&(i as usize)))
        .collect();
    Ok((sel, top))
}

/// Exact attention of one query over KV head `h`'s rows `set` (scale `1/√D`, no softcap).
pub fn attend_ref(
    q: &[f32],
    (kb, vb): (&[f32], &[f32]),
    (hkv, d, h): (usize, usize, usize),
    set: &[u32],
) -> Result<Vec<f32>, String> {
    let mut want = vec![0f32; d];
    fathom_plan::attend(
        q,
        KvView::head(kb, hkv, d, h),
        KvView::head(vb, hkv, d, h),
        set,
        1.0 / (d as f32).sqrt(),
        None,
        &mut want,
    )
    .map_err(|e| e.to_string())?;
    Ok(want)
}

/// The CPU plan of docs/SPEC.md §3–4 for one KV head's queries `qh` `[G][D]`: Fathom's
/// importance and water-filling, SparQ's top-r of `Σ_g |q_gc|`, Double Sparsity's calibrated
/// channels, the thumbnail's 2 planes, the full store's 4 (ties to the lower channel).
pub fn cpu_depths(
    m: Method,
    calib: &HeadCalib,
    qh: &[f32],
    g: usize,
    d: usize,
) -> Result<Vec<u8>, String> {
    let top = |score: &[f32], r: usize| {
        let mut o: Vec<usize> = (0..d).collect();
        o.sort_by(|&a, &b| score[b].total_cmp(&score[a]).then(a.cmp(&b)));
        let mut dep = vec![0u8; d];
        o.iter().take(r).for_each(|&c| dep[c] = 4);
        dep
    };
    Ok(match m {
        Method::Fathom(b) => {
            let w = fathom_plan::importance(&calib.sigma2, qh, g).map_err(|e| e.to_string())?;
            fathom_plan::water_fill(&w, b)
                .map_err(|e| e.to_string())?
                .depths
        }
        Method::SparQ(r) => {
            let s: Vec<f32> = (0..d)
                .map(|c| (0..g).map(|gg| qh[gg * d + c].abs()).sum())
                .collect();
            top(&s, r)
        }
        Method::DoubleSparsity(r) => {
            let mut dep = vec![0u8; d];
            calib
                .ds_channels
                .iter()
                .take(r)
                .for_each(|&c| dep[c as usize] = 4);
            dep
        }
        Method::Thumb2 => vec![2; d],
        Method::Exact => vec![4; d],
        other => return Err(format!("{other:?} has no static plan")),
    })
}
