//! A CPU subject for the soak's unit tests: one `PagedStoreRef` per layer (the paged
//! appends' CPU reference), the cache's page tables for reserves and its written-prefix rule
//! (`StepLedger`) for refusals, and attends by the per-head CPU protocol over the records it
//! holds. The tests run the generator and the twin against it, seeded, at two sizes, and
//! check that the twin catches a subject with a flaw.

use fathom_cuda::cache::{
    check_select, AppendBatch, AttendDebug, AttendMethod, CacheConfig, StepLedger,
};
use fathom_cuda::pages::{CacheSessions, SessionId};
use fathom_cuda::{CudaError, Method, PagedExport, PagedStoreRef, Result};
use fathom_plan::scanner::HeadCalib;
use fathom_plan::SelectParams;
use fathom_store::{Dims, KeyStore};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::ops::{draw_config, Soak, Tally};
use crate::subject::Subject;
use crate::twin::{attend_ref, select, RefScores, Stores, Twin};

/// A defect a test plants, to see the twin find it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flaw {
    /// Every attend's first output element moved by 1 %.
    Output,
    /// The last appended value of each append of layer 0 stored 1 % off.
    Record,
}

fn invalid(what: &'static str, detail: impl Into<String>) -> CudaError {
    CudaError::Invalid {
        what,
        detail: detail.into(),
    }
}

struct CpuCache {
    cfg: CacheConfig,
    sessions: CacheSessions,
    layers: Vec<PagedStoreRef>,
    ledger: StepLedger,
    step: u64,
    refs: Option<Twin>,
    last: Vec<AttendDebug>,
    flaw: Option<Flaw>,
}

impl CpuCache {
    fn new(cfg: CacheConfig, flaw: Option<Flaw>) -> CpuCache {
        let cfg = cfg.validate().unwrap();
        let s = cfg.shape;
        let dims = Dims {
            heads: s.kv_heads,
            channels: s.dim,
        };
        CpuCache {
            cfg,
            sessions: CacheSessions::new(cfg.pages).unwrap(),
            layers: (0..s.layers)
                .map(|_| PagedStoreRef::new(dims, cfg.pages).unwrap())
                .collect(),
            ledger: StepLedger::new(s.layers),
            step: 0,
            refs: None,
            last: Vec::new(),
            flaw,
        }
    }

    /// Session `s`'s rows of layer `l` from its records, `[n][Hkv][D]` keys and values.
    fn rows(&self, s: SessionId, l: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let (hkv, d) = (self.cfg.shape.kv_heads, self.cfg.shape.dim);
        let rec = self.layers[l].records(s)?;
        let n = rec.len() / (hkv * 2 * d);
        let (mut k, mut v) = (vec![0f32; n * hkv * d], vec![0f32; n * hkv * d]);
        for h in 0..hkv {
            for i in 0..n {
                let r = &rec[(h * n + i) * 2 * d..(h * n + i + 1) * 2 * d];
                for c in 0..d {
                    k[(i * hkv + h) * d + c] = r[c].to_f32();
                    v[(i * hkv + h) * d + c] = r[d + c].to_f32();
                }
            }
        }
        Ok((k, v))
    }

    /// One batch member's attend by the CPU protocol over its records.
    fn attend_one(
        &self,
        s: SessionId,
        l: usize,
        m: AttendMethod,
        p: &SelectParams,
        q: &[f32],
    ) -> Result<(Vec<f32>, AttendDebug)> {
        let sh = self.cfg.shape;
        let (hkv, g, d) = (sh.kv_heads, sh.group, sh.dim);
        let (kb, vb) = self.rows(s, l)?;
        let n = kb.len() / (hkv * d);
        let refs = self.refs.as_ref().expect("set up");
        let err = |e: String| invalid("cpu attend", e);
        let st = Stores::new(refs, m, l, &kb).map_err(err)?;
        let mut dbg = AttendDebug {
            depths: vec![0; hkv * d],
            scores: vec![0.0; hkv * g * n],
            winners: vec![Vec::new(); hkv * g],
        };
        let mut out = vec![0f32; hkv * g * d];
        for h in 0..hkv {
            let qh = &q[h * g * d..(h + 1) * g * d];
            let r = match m {
                AttendMethod::Scan(mm) => {
                    Some(refs.reference(mm, l, &st, &kb, qh, h).map_err(err)?)
                }
                AttendMethod::Dense => None,
            };
            if let Some(dep) = r.as_ref().and_then(|r| r.depths.as_ref()) {
                dbg.depths[h * d..(h + 1) * d].copy_from_slice(dep);
            }
            for gg in 0..g {
                let row = &mut dbg.scores[(h * g + gg) * n..(h * g + gg + 1) * n];
                let set = match &r {
                    Some(r) => {
                        match &r.scores {
                            RefScores::Approx(x, _) => row
                                .iter_mut()
                                .zip(&x[gg * n..])
                                .for_each(|(o, &x)| *o = x as f32),
                            RefScores::Exact(x) => row.copy_from_slice(&x[gg * n..(gg + 1) * n]),
                        }
                        let (set, mid) = select(row, p).map_err(err)?;
                        dbg.winners[h * g + gg] = mid;
                        set
                    }
                    None => (0..n as u32).collect(),
                };
                let o = attend_ref(&qh[gg * d..(gg + 1) * d], (&kb, &vb), (hkv, d, h), &set)
                    .map_err(err)?;
                out[(h * g + gg) * d..(h * g + gg + 1) * d].copy_from_slice(&o);
            }
        }
        Ok((out, dbg))
    }
}

impl Subject for CpuCache {
    fn config(&self) -> CacheConfig {
        self.cfg
    }
    fn setup(&mut self, calib: &[Vec<HeadCalib>], _methods: &[Method]) -> Result<()> {
        self.refs = Some(Twin::new(self.cfg, calib.to_vec()));
        Ok(())
    }
    fn create(&mut self) -> Result<SessionId> {
        let id = self.sessions.create()?;
        for l in &mut self.layers {
            assert_eq!(l.create()?, id, "the layers' page tables agree");
        }
        self.ledger.created(id);
        Ok(id)
    }
    fn fork(&mut self, parent: SessionId) -> Result<SessionId> {
        let id = self.sessions.fork(parent)?;
        for l in &mut self.layers {
            assert_eq!(l.fork(parent)?, id, "the layers' page tables agree");
        }
        self.ledger.forked(parent, id);
        Ok(id)
    }
    fn free(&mut self, s: SessionId) -> Result<()> {
        self.sessions.free(s)?;
        self.layers.iter_mut().try_for_each(|l| l.free(s))?;
        self.ledger.freed(s);
        Ok(())
    }
    fn truncate(&mut self, s: SessionId, len: usize) -> Result<()> {
        self.sessions.check_truncate(s, len)?;
        self.ledger.check_grow(&[(s, len)], "truncate")?;
        self.sessions.truncate(s, len)?;
        for l in &mut self.layers {
            let to = len.min(l.sessions().len(s)?);
            l.truncate(s, to)?;
        }
        self.ledger.truncated(s, len);
        Ok(())
    }
    fn len(&self, s: SessionId) -> Result<usize> {
        Ok(self.sessions.len(s)?)
    }
    fn reserve(&mut self, batch: &[(SessionId, usize)]) -> Result<AppendBatch> {
        let lens = batch
            .iter()
            .map(|&(s, _)| Ok((s, self.sessions.len(s)?)))
            .collect::<Result<Vec<_>>>()?;
        self.ledger.check_grow(&lens, "reserve")?;
        let plans = self.sessions.reserve_many(batch)?;
        self.step += 1;
        let b = AppendBatch::new(plans, self.step);
        self.ledger.reserved(&b);
        Ok(b)
    }
    fn append(&mut self, b: &AppendBatch, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        if layer >= self.layers.len() {
            return Err(invalid("layer", format!("{layer}")));
        }
        self.ledger.check_append(b, layer, "append")?;
        let row = self.cfg.shape.kv_heads * self.cfg.shape.dim;
        if k.len() != b.rows * row || v.len() != k.len() {
            return Err(invalid(
                "append",
                format!("{} keys, want [{}]", k.len(), b.rows),
            ));
        }
        let mut v = v.to_vec();
        if self.flaw == Some(Flaw::Record) && layer == 0 {
            *v.last_mut().unwrap() *= 1.01;
        }
        for (p, &r0) in b.plans.iter().zip(&b.row0) {
            let (lo, hi) = (r0 * row, (r0 + p.tokens) * row);
            self.layers[layer].append(p.session, &k[lo..hi], &v[lo..hi])?;
        }
        self.ledger.appended(b, layer);
        Ok(())
    }
    fn attend(
        &mut self,
        b: &AppendBatch,
        layer: usize,
        m: AttendMethod,
        p: &SelectParams,
        q: &[f32],
    ) -> Result<Vec<f32>> {
        self.ledger.check_read(b, layer, "attend")?;
        check_select(&self.cfg, p)?;
        let hd = self.cfg.shape.kv_heads * self.cfg.shape.group * self.cfg.shape.dim;
        if q.len() != b.plans.len() * hd {
            return Err(invalid(
                "queries",
                format!("{} for {} sessions", q.len(), b.plans.len()),
            ));
        }
        let mut out = Vec::new();
        self.last.clear();
        for (i, plan) in b.plans.iter().enumerate() {
            let (o, dbg) = self.attend_one(plan.session, layer, m, p, &q[i * hd..(i + 1) * hd])?;
            out.extend(o);
            self.last.push(dbg);
        }
        if self.flaw == Some(Flaw::Output) {
            out[0] = out[0] * 1.01 + 1e-3;
        }
        Ok(out)
    }
    fn readback(&self, _b: &AppendBatch, i: usize) -> Result<AttendDebug> {
        Ok(self.last[i].clone())
    }
    fn export(&self, s: SessionId, layer: usize) -> Result<PagedExport> {
        self.ledger
            .check_written(s, layer, self.sessions.len(s)?, "export")?;
        self.layers[layer].export(s)
    }
    fn export_pca(&self, s: SessionId, layer: usize) -> Result<PagedExport> {
        let refs = self.refs.as_ref().expect("set up");
        let (k, _) = self.rows(s, layer)?;
        let store = KeyStore::from_keys(refs.dims(), &k, Some(refs.bases[layer].clone()))?;
        let (view, dims) = (store.view(), refs.dims());
        let n = store.tokens();
        let nb = n.div_ceil(64);
        let (mut planes, mut scales): (Vec<u64>, Vec<f16>) = (Vec::new(), Vec::new());
        for h in 0..dims.heads {
            for c in 0..dims.channels {
                for pl in 0..4 {
                    planes.extend_from_slice(&view.plane(h, c, pl)[..nb]);
                }
            }
        }
        for h in 0..dims.heads {
            for c in 0..dims.channels {
                scales.extend_from_slice(&view.channel_scales(h, c)[..nb]);
            }
        }
        Ok(PagedExport {
            dims,
            tokens: n,
            planes,
            scales,
        })
    }
    fn records(&self, s: SessionId, layer: usize) -> Result<Vec<bf16>> {
        self.layers[layer].records(s)
    }
    fn faults(&self) -> Result<Vec<u32>> {
        Ok(vec![0; self.layers.len()])
    }
}

/// `ops` operations on caches drawn from `seed` with at most `elems` rows·Hkv·D per session.
fn soak_cpu(seed: u64, elems: usize, ops: u64, flaw: Option<Flaw>) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut tally = Tally::default();
    for residency in [fathom_cuda::Residency::Host, fathom_cuda::Residency::Hbm] {
        let (cfg, methods) = draw_config(&mut rng, residency, elems);
        let subj = CpuCache::new(cfg, flaw);
        let epoch = StdRng::seed_from_u64(rng.gen());
        let mut soak = Soak::new(subj, epoch, &methods, &mut tally).unwrap();
        soak.run(|n| n < ops);
    }
    tally
}

#[test]
fn the_generator_and_the_twin_agree_with_the_paged_reference() {
    for (seed, elems, ops) in [(1, 1 << 13, 300), (2, 1 << 15, 120)] {
        let t = soak_cpu(seed, elems, ops, None);
        eprintln!(
            "seed {seed}: {} heads, {} stores checked; {:?}",
            t.heads_checked, t.stores_checked, t.counts
        );
        assert!(t.mismatches.is_empty(), "seed {seed}: {:?}", t.mismatches);
        let c = |k: &str| t.counts.get(k).copied().unwrap_or(0);
        for op in ["create", "fork", "truncate", "free", "reserve", "append"] {
            assert!(c(op) > 0, "seed {seed}: no {op} in {:?}", t.counts);
        }
        let refusals: u64 = t
            .counts
            .iter()
            .filter(|(k, _)| k.starts_with("refusal:"))
            .map(|(_, v)| v)
            .sum();
        assert!(
            refusals > 0 && t.heads_checked > 0 && t.stores_checked > 0,
            "seed {seed}: {t:?}"
        );
    }
}

#[test]
fn the_twin_finds_a_flawed_subject() {
    for flaw in [Flaw::Output, Flaw::Record] {
        let t = soak_cpu(3, 1 << 13, 60, Some(flaw));
        assert!(!t.mismatches.is_empty(), "{flaw:?} went unseen");
    }
}

#[test]
fn arguments_are_parsed_or_refused() {
    let a = crate::parse_args(
        ["--seed", "7", "--seconds", "5", "--residency", "hbm"]
            .map(String::from)
            .into_iter(),
    )
    .unwrap();
    assert_eq!((a.seed, a.seconds, a.residencies.len()), (7, 5, 1));
    assert!(crate::parse_args(["--seed", "7"].map(String::from).into_iter()).is_err());
    assert!(crate::parse_args(
        ["--seed", "x", "--seconds", "1"]
            .map(String::from)
            .into_iter()
    )
    .is_err());
}
