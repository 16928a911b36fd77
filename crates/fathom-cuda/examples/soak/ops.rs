//! The seeded operation generator and its driver: draws a cache shape, then random session
//! operations (create, fork, truncate, free, ragged reserves with appends of every layer,
//! attends of every method, and refusals), applies each to the subject and the twin alike,
//! and checks every output against the twin.

use std::collections::BTreeMap;

use fathom_cuda::cache::{AttendMethod, CacheConfig};
use fathom_cuda::pages::{PageConfig, SessionId};
use fathom_cuda::{CudaError, HostPages, Method, ModelShape, Residency};
use fathom_plan::scanner::HeadCalib;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

use crate::subject::Subject;
use crate::twin::{bf, Twin};
// The steps and refusals (`step.rs`) extend `Soak`.

/// Live sessions at most (the cache's session slots and batch size).
pub const MAX_LIVE: usize = 6;
/// Twin elements per session and layer at most, `tokens · Hkv · D`: with [`MAX_LIVE`] sessions
/// it bounds the twin's memory and the CPU work of a check (`max_tokens` is this over `Hkv·D`,
/// within `MAX_K..=4096`).
pub const MAX_ROW_ELEMS: usize = 1 << 20;
/// The largest top-k an attend draws.
pub const MAX_K: usize = 64;

/// What a soak counted and found.
#[derive(Debug, Default)]
pub struct Tally {
    /// Operations by name (`attend:<method>`, `refusal:<kind>`, …).
    pub counts: BTreeMap<String, u64>,
    /// Query heads whose attend output was checked.
    pub heads_checked: u64,
    /// (session, every layer) stores checked.
    pub stores_checked: u64,
    /// Every mismatch, named.
    pub mismatches: Vec<String>,
    /// Faults the cache counted (`KvCache::faults`, summed over layers).
    pub faults: u64,
}

impl Tally {
    pub(crate) fn add(&mut self, what: impl Into<String>) {
        *self.counts.entry(what.into()).or_default() += 1;
    }
}

/// A cache configuration drawn from `rng` for `residency`, serving `methods` (returned): the
/// shape (D, G, Hkv, layers), the page size, the row cache; sized so that [`MAX_LIVE`]
/// sessions of `max_tokens` never exhaust the pool.
pub fn draw_config(
    rng: &mut StdRng,
    residency: Residency,
    max_row_elems: usize,
) -> (CacheConfig, Vec<String>) {
    let d = [64, 128, 128, 256][rng.gen_range(0..4)];
    let kv_heads = rng.gen_range(1..=3);
    let group = [1, 3, 4, 8][rng.gen_range(0..4)];
    let layers = rng.gen_range(2..=3);
    let page_tokens = [64, 128, 256, 2048][rng.gen_range(0..4)];
    let max_tokens = (max_row_elems / (kv_heads * d)).clamp(MAX_K, 4096);
    let pages = MAX_LIVE * max_tokens.div_ceil(page_tokens) + 2;
    let methods: Vec<String> = vec![
        "dense".to_string(),
        "exact".into(),
        "fathom:32".into(),
        "fathom:48".into(),
        "fathom:92".into(),
        format!("sparq:{}", d / 8),
        format!("ds:{}", d / 8),
        format!("loki:{}", d / 4),
        "thumb2".into(),
        "landmark".into(),
        "quest".into(),
    ];
    let parsed: Vec<Method> = methods.iter().filter_map(|m| scan_method(m, d)).collect();
    let cfg = CacheConfig {
        shape: ModelShape {
            layers,
            kv_heads,
            group,
            dim: d,
        },
        pages: PageConfig {
            page_tokens,
            pages,
            max_sessions: MAX_LIVE,
            max_tokens,
        },
        max_batch: MAX_LIVE,
        max_k: MAX_K,
        row_cache: [0, 64][rng.gen_range(0..2)],
        residency,
        pca_index: false,
        block_tables: false,
        host_pages: HostPages::Driver,
        // Head groups and scan loads change no bit (the outputs and the debug readback the
        // twin checks are the same), so each epoch draws them too.
        options: fathom_cuda::cache::CacheOptions {
            attend_groups: rng.gen_range(1..=kv_heads),
            scan_vector_words: rng.gen_range(1..=2),
            ..Default::default()
        },
    }
    .serving(&parsed);
    (cfg, methods)
}

fn scan_method(m: &str, d: usize) -> Option<Method> {
    match AttendMethod::parse(m, d).expect("a method of the grammar") {
        AttendMethod::Scan(s) => Some(s),
        AttendMethod::Dense => None,
    }
}

/// Per layer and KV head, a calibration from 512 keys drawn as the appends draw them and
/// random queries: σ² (Fathom), Double Sparsity's channels, Loki's PCA basis.
pub fn draw_calibration(rng: &mut StdRng, cfg: &CacheConfig) -> Vec<Vec<HeadCalib>> {
    let s = cfg.shape;
    let (hkv, d) = (s.kv_heads, s.dim);
    (0..s.layers)
        .map(|_| {
            let keys: Vec<f32> = (0..512 * hkv * d)
                .map(|i| bf(key_elem(rng, i % d, d)))
                .collect();
            let qs: Vec<f32> = (0..16 * s.group * d)
                .map(|_| rng.gen_range(-1.0..1.0))
                .collect();
            (0..hkv)
                .map(|h| {
                    let kv = fathom_plan::KvView::head(&keys, hkv, d, h);
                    fathom_plan::calib::head_calib(&kv, &qs).expect("a drawn calibration")
                })
                .collect()
        })
        .collect()
}

/// One key element of channel `c`: a per-channel scale (as real keys have) and an occasional
/// outlier.
pub(crate) fn key_elem(rng: &mut StdRng, c: usize, d: usize) -> f32 {
    let x = rng.gen_range(-1.0f32..1.0) * (0.1 + c as f32 / d as f32);
    if rng.gen_ratio(1, 500) {
        x * 40.0
    } else {
        x
    }
}

/// A refusal is a typed error of the checks before any launch, never a driver failure.
pub(crate) fn refused<T>(r: fathom_cuda::Result<T>, what: &str) -> Result<(), String> {
    match r {
        Ok(_) => Err(format!("{what}: accepted, want a refusal")),
        Err(
            CudaError::Invalid { .. }
            | CudaError::Page(_)
            | CudaError::Store(_)
            | CudaError::Plan(_),
        ) => Ok(()),
        Err(e) => Err(format!("{what}: refused with an untyped failure: {e}")),
    }
}

/// One epoch's soak of one subject.
pub struct Soak<'t, S: Subject> {
    /// The cache under test.
    pub subj: S,
    /// Its CPU twin.
    pub twin: Twin,
    pub(crate) rng: StdRng,
    pub(crate) methods: Vec<(String, AttendMethod)>,
    pub(crate) tally: &'t mut Tally,
    /// Whether a step appended every layer (a layer no append wrote is exempt from the
    /// written-prefix rule of a reserve).
    pub(crate) appended_once: bool,
    ops: u64,
}

impl<'t, S: Subject> Soak<'t, S> {
    /// Loads a drawn calibration into every layer and prepares every method of `methods`.
    ///
    /// # Errors
    /// The subject's refusal, named.
    pub fn new(
        mut subj: S,
        mut rng: StdRng,
        methods: &[String],
        tally: &'t mut Tally,
    ) -> Result<Self, String> {
        let cfg = subj.config();
        let calib = draw_calibration(&mut rng, &cfg);
        let d = cfg.shape.dim;
        let scans: Vec<Method> = methods.iter().filter_map(|m| scan_method(m, d)).collect();
        subj.setup(&calib, &scans)
            .map_err(|e| format!("setup: {e}"))?;
        let methods = methods
            .iter()
            .map(|m| (m.clone(), AttendMethod::parse(m, d).expect("parsed above")))
            .collect();
        Ok(Soak {
            subj,
            twin: Twin::new(cfg, calib),
            rng,
            methods,
            tally,
            ops: 0,
            appended_once: false,
        })
    }

    /// One random operation, checked; every 16th, every live session's store too.
    ///
    /// # Errors
    /// A mismatch or an unexpected failure, named (the caller ends the epoch).
    pub fn op(&mut self) -> Result<(), String> {
        self.ops += 1;
        let live = self.twin.live();
        let what = match self.rng.gen_range(0..100) {
            _ if live.is_empty() => self.create(),
            0..=7 => self.create(),
            8..=13 => self.fork(),
            14..=23 => self.truncate(),
            24..=28 if live.len() > 1 => self.free(),
            29..=33 => self.refusal(),
            _ => self.step(None),
        };
        what?;
        if self.ops % 16 == 0 {
            self.check_all()?;
        }
        Ok(())
    }

    /// Operations while `more(ops so far)`, each followed by a read of the fault counters;
    /// ends early at the first mismatch (recorded) or fault (counted), else with a check of
    /// every live session. Returns the operations run.
    pub fn run(&mut self, mut more: impl FnMut(u64) -> bool) -> u64 {
        let mut ops = 0;
        while more(ops) {
            ops += 1;
            if let Err(e) = self.op() {
                self.tally.mismatches.push(format!("op {ops}: {e}"));
                return ops;
            }
            match self.subj.faults() {
                Ok(f) if f.iter().all(|&x| x == 0) => {}
                Ok(f) => {
                    self.tally.faults += f.iter().map(|&x| x as u64).sum::<u64>();
                    eprintln!("soak: op {ops}: faults per layer {f:?}");
                    return ops;
                }
                Err(e) => {
                    self.tally.mismatches.push(format!("op {ops}: faults: {e}"));
                    return ops;
                }
            }
        }
        if let Err(e) = self.check_all() {
            self.tally.mismatches.push(format!("final sweep: {e}"));
        }
        ops
    }

    /// Every live session's store, checked.
    ///
    /// # Errors
    /// The first mismatch.
    pub fn check_all(&mut self) -> Result<(), String> {
        for s in self.twin.live() {
            self.check(s)?;
        }
        Ok(())
    }

    pub(crate) fn check(&mut self, s: SessionId) -> Result<(), String> {
        self.twin
            .check_store(&self.subj, s)
            .map_err(|e| format!("session {s:?}: {e}"))?;
        self.tally.stores_checked += 1;
        Ok(())
    }

    pub(crate) fn pick(&mut self) -> SessionId {
        *self
            .twin
            .live()
            .choose(&mut self.rng)
            .expect("a live session")
    }

    fn create(&mut self) -> Result<(), String> {
        if self.twin.sessions.len() >= MAX_LIVE {
            self.tally.add("refusal:no free slot");
            return refused(self.subj.create(), "create past the session slots");
        }
        let s = self.subj.create().map_err(|e| format!("create: {e}"))?;
        self.twin.created(s);
        self.tally.add("create");
        self.check(s)
    }

    fn fork(&mut self) -> Result<(), String> {
        if self.twin.sessions.len() >= MAX_LIVE || self.twin.sessions.is_empty() {
            return self.create();
        }
        let p = self.pick();
        let c = self.subj.fork(p).map_err(|e| format!("fork: {e}"))?;
        self.twin.forked(p, c);
        self.tally.add("fork");
        self.check(c)?;
        self.check(p)
    }

    fn free(&mut self) -> Result<(), String> {
        let s = self.pick();
        self.subj.free(s).map_err(|e| format!("free: {e}"))?;
        self.twin.freed(s);
        self.tally.add("free");
        refused(self.subj.len(s), "len of a freed session")
    }

    pub(crate) fn truncate(&mut self) -> Result<(), String> {
        let s = self.pick();
        let n = self.twin.len(s);
        let page = self.twin.cfg.pages.page_tokens;
        let (kind, to) = match self.rng.gen_range(0..10) {
            0..=3 => (
                "inside a block",
                n.saturating_sub(self.rng.gen_range(1..=63)),
            ),
            4..=5 => (
                "at a block edge",
                if n % 64 == 0 {
                    n.saturating_sub(64)
                } else {
                    n - n % 64
                },
            ),
            6..=7 => (
                "across pages",
                n.saturating_sub(self.rng.gen_range(page..=page + 130)),
            ),
            8 => ("to zero", 0),
            _ => ("to its length", n),
        };
        self.subj
            .truncate(s, to)
            .map_err(|e| format!("truncate {n} → {to} ({kind}): {e}"))?;
        self.twin.truncated(s, to);
        self.tally.add("truncate");
        self.tally.add(format!("truncate:{kind}"));
        // A truncation copies pages a fork shares: every session keeps its own tokens.
        self.check_all()
    }
}
