//! Concurrency stress: 16 sessions append tokens to their own `KeyStore` and scan it
//! with `scan::scan`, while observer threads scan random sessions at the same time. Every scan
//! is checked against a single-thread replay (a store built at once from the same keys and
//! scanned on a one-thread pool): scores bit for bit, and every plane word and scale of the
//! view (a torn or lost word shows up as a mismatch). At the end every appended token must
//! have been covered by a verified scan.
//!
//! The contract exercised (docs/RELIABILITY.md): `KeyStore` is `Send + Sync`; `append` needs
//! `&mut`, so a session that is appended to while others read sits behind a lock (here an
//! `RwLock`); `StoreView` is `Copy + Send + Sync` and `scan` takes it by shared reference.
//!
//! Duration: `FATHOM_STRESS_SECS` (default 2 s, so CI stays fast); `cargo xtask stress
//! --seconds 600` runs the 10-minute version in release.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::RwLock;
use std::time::{Duration, Instant};

use fathom_plan::scan::scan;
use fathom_store::{Dims, KeyStore, StoreView};

const SESSIONS: usize = 16;
const OBSERVERS: usize = 4;
const DIMS: Dims = Dims {
    heads: 2,
    channels: 32,
};
const G: usize = 3;
/// Tokens a session holds before it starts a new store (bounds the replay cost).
const MAX_TOKENS: usize = 2048;

/// Deterministic key of (session, generation, token, slot): the replay regenerates it.
fn key(session: usize, generation: u64, token: usize, slot: usize) -> f32 {
    let mut x = (session as u64) << 48 ^ generation << 32 ^ (token as u64) << 8 ^ slot as u64;
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^= x >> 33;
    // Heavy-ish tails so that blocks get different scales.
    let u = (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
    (u * (1.0 + (slot % 7) as f64)) as f32
}

fn keys(session: usize, generation: u64, from: usize, to: usize) -> Vec<f32> {
    let row = DIMS.row();
    let mut v = Vec::with_capacity((to - from) * row);
    for t in from..to {
        for s in 0..row {
            v.push(key(session, generation, t, s));
        }
    }
    v
}

fn queries(seed: usize) -> (Vec<f32>, Vec<u8>) {
    let d = DIMS.channels;
    let q = (0..G * d).map(|i| key(seed, 99, i, 1)).collect();
    let depths = (0..d).map(|c| ((c + seed) % 5) as u8).collect();
    (q, depths)
}

fn scan_all(view: &StoreView<'_>, q: &[f32], depths: &[u8]) -> Vec<f32> {
    let n = view.tokens();
    let mut out = vec![0f32; DIMS.heads * G * n];
    for h in 0..DIMS.heads {
        scan(view, h, q, G, depths, &mut out[h * G * n..(h + 1) * G * n]).expect("scan");
    }
    out
}

struct Session {
    store: RwLock<(u64, KeyStore)>,
}

/// Scans `s` under a read lock and checks it against the single-thread replay; returns the
/// tokens covered.
fn verify(id: usize, s: &Session, seed: usize, replay_pool: &rayon::ThreadPool) -> usize {
    let guard = s.store.read().expect("no poisoned lock");
    let (generation, store) = (&guard.0, &guard.1);
    let view = store.view();
    let n = view.tokens();
    let (q, depths) = queries(seed);
    let got = scan_all(&view, &q, &depths);
    assert_eq!(
        got.len(),
        DIMS.heads * G * n,
        "every appended token is scanned"
    );
    let replay = KeyStore::from_keys(DIMS, &keys(id, *generation, 0, n), None).expect("replay");
    let rv = replay.view();
    let want = replay_pool.install(|| scan_all(&rv, &q, &depths));
    for h in 0..DIMS.heads {
        for c in 0..DIMS.channels {
            for p in 0..4 {
                assert_eq!(
                    view.plane(h, c, p),
                    rv.plane(h, c, p),
                    "session {id}: torn or lost plane word (h {h}, c {c}, p {p}, n {n})"
                );
            }
            assert!(
                view.channel_scales(h, c)
                    .iter()
                    .zip(rv.channel_scales(h, c))
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "session {id}: scale mismatch (h {h}, c {c}, n {n})"
            );
        }
    }
    assert!(
        got.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "session {id}: scores differ from the single-thread replay at n = {n}"
    );
    n
}

#[test]
fn sixteen_sessions_append_and_scan_concurrently() {
    let secs: f64 = std::env::var("FATHOM_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let sessions: Vec<Session> = (0..SESSIONS)
        .map(|_| Session {
            store: RwLock::new((0, KeyStore::with_capacity(DIMS, MAX_TOKENS, None).unwrap())),
        })
        .collect();
    let appended = AtomicU64::new(0);
    let verified_final = AtomicU64::new(0);
    let scans = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let replay_pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    std::thread::scope(|sc| {
        for (id, s) in sessions.iter().enumerate() {
            let (appended, verified_final, scans, replay_pool) =
                (&appended, &verified_final, &scans, &replay_pool);
            sc.spawn(move || {
                let mut step = 0usize;
                loop {
                    // Append 1..=97 tokens (crossing block boundaries at every phase).
                    let m = 1 + (step * 31 + id * 7) % 97;
                    {
                        let mut g = s.store.write().unwrap();
                        let n = g.1.tokens();
                        if n + m > MAX_TOKENS {
                            g.0 += 1;
                            g.1 = KeyStore::with_capacity(DIMS, MAX_TOKENS, None).unwrap();
                        }
                        let (generation, n) = (g.0, g.1.tokens());
                        g.1.append(&keys(id, generation, n, n + m)).unwrap();
                    }
                    appended.fetch_add(m as u64, Ordering::Relaxed);
                    // Scan what this session appended (and verify it).
                    verify(id, s, step, replay_pool);
                    scans.fetch_add(1, Ordering::Relaxed);
                    step += 1;
                    if Instant::now() >= deadline {
                        break;
                    }
                }
                // The last scan covered every token of the current generation; earlier
                // generations were covered by the scan right after each of their appends.
                let n = verify(id, s, step, replay_pool);
                verified_final.fetch_add(n as u64, Ordering::Relaxed);
            });
        }
        for o in 0..OBSERVERS {
            let (sessions, scans, stop, replay_pool) = (&sessions, &scans, &stop, &replay_pool);
            sc.spawn(move || {
                let mut i = o;
                while !stop.load(Ordering::Relaxed) {
                    let id = (i * 7 + o) % SESSIONS;
                    verify(id, &sessions[id], i, replay_pool);
                    scans.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                    if Instant::now() >= deadline {
                        break;
                    }
                }
            });
        }
        // Observers stop at the deadline too; the flag is for early exit on a failure.
        let _ = &stop;
    });
    stop.store(true, Ordering::Relaxed);
    let (a, s) = (
        appended.load(Ordering::Relaxed),
        scans.load(Ordering::Relaxed),
    );
    eprintln!(
        "stress: {SESSIONS} sessions + {OBSERVERS} observers for {secs} s: {a} tokens appended, {s} verified scans, {} tokens in the final stores",
        verified_final.load(Ordering::Relaxed)
    );
    assert!(a > 0 && s >= SESSIONS as u64);
}

/// The thread-safety contract, checked at compile time.
#[test]
fn public_types_are_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    fn copy<T: Copy>() {}
    send_sync::<KeyStore>();
    send_sync::<StoreView<'static>>();
    copy::<StoreView<'static>>();
    send_sync::<fathom_store::MappedStore>();
    send_sync::<fathom_store::Basis>();
    send_sync::<fathom_plan::Plan>();
    send_sync::<fathom_plan::scanner::Fathom>();
    send_sync::<fathom_plan::KvView<'static>>();
    send_sync::<fathom_plan::SelectParams>();
    send_sync::<fathom_plan::MeanAccumulator>();
    send_sync::<fathom_plan::LayerBudgetParams>();
    send_sync::<fathom_plan::scanner::HeadCalib>();
    send_sync::<fathom_plan::scanner::HeadInput<'static>>();
    send_sync::<Box<dyn fathom_plan::scanner::Scanner>>();
    send_sync::<Box<dyn fathom_plan::scanner::HeadScanner>>();
    send_sync::<fathom_plan::PlanError>();
    send_sync::<fathom_plan::scan::ScanError>();
    send_sync::<fathom_plan::scanner::ScannerError>();
    send_sync::<fathom_store::StoreError>();
    send_sync::<fathom_store::file::FileHeader>();
    copy::<Dims>();
    send_sync::<Dims>();
}
