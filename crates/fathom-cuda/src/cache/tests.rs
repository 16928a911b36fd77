#[test]
fn stage_marks_add_up_to_each_stage_and_count_attends() {
    use super::{AttendStage as S, AttendStages};
    let mut a = AttendStages::default();
    // A scan attend, then a dense one (queries, then all of its attention).
    for (stage, ms) in [
        (S::Start, 9.0),
        (S::Plan, 0.5),
        (S::Scan, 2.0),
        (S::TopK, 0.25),
        (S::Union, 0.125),
        (S::Fetch, 1.0),
        (S::Attention, 0.5),
        (S::Start, 7.0),
        (S::Plan, 0.25),
        (S::Attention, 4.0),
    ] {
        a.add(stage, ms);
    }
    assert_eq!(a.attends, 2);
    assert_eq!(a.values(), [0.75, 2.0, 0.25, 0.125, 1.0, 4.5]);
    assert_eq!(a.total_ms(), 8.625);
    assert_eq!(AttendStages::NAMES.len(), a.values().len());
}

#[test]
fn table_scan_groups_fit_shared_memory_at_every_shape() {
    for dim in [64, 128, 256] {
        for g in 1..=8 {
            let t = super::table_scan_groups(dim, g);
            assert!(t.is_power_of_two() && t <= 64, "D {dim} G {g}: {t}");
            let bytes = g * (dim + 1) * 4 + g * 1024 * 4 + 64 + t * (2 * dim / 8 + 1) * 16;
            assert!(bytes <= 48 << 10, "D {dim} G {g}: {bytes} bytes");
            // The next power of two would not fit (or the cap holds).
            let more = g * (dim + 1) * 4 + g * 1024 * 4 + 64 + 2 * t * (2 * dim / 8 + 1) * 16;
            assert!(
                t == 64 || more > 48 << 10,
                "D {dim} G {g}: {t} is not the most"
            );
        }
    }
    assert_eq!(super::table_scan_groups(128, 4), 32);
    assert_eq!(super::table_scan_groups(256, 8), 4);
}

use super::*;

fn cfg() -> CacheConfig {
    CacheConfig {
        shape: ModelShape {
            layers: 2,
            kv_heads: 2,
            group: 4,
            dim: 128,
        },
        pages: PageConfig {
            page_tokens: 128,
            pages: 8,
            max_sessions: 4,
            max_tokens: 512,
        },
        max_batch: 4,
        max_k: 64,
        row_cache: 0,
        residency: crate::config::Residency::Host,
        pca_index: false,
        block_tables: false,
        host_pages: crate::HostPages::Driver,
        options: Default::default(),
    }
}

#[test]
fn attend_groups_are_between_one_and_the_kv_heads() {
    let c = cfg();
    assert!(check_attend_groups(&c, 1).is_ok());
    assert!(check_attend_groups(&c, 2).is_ok());
    for bad in [0, 3, 100] {
        let e = check_attend_groups(&c, bad).unwrap_err().to_string();
        assert!(
            e.contains("attend groups") && e.contains("1..=2"),
            "{bad}: {e}"
        );
    }
}

/// The selection's limits, Double Sparsity's channels and a hand-built method are checked
/// on the host, so a model's decode step can run them before its reserve.
#[test]
fn selections_channels_and_methods_are_checked_on_the_host() {
    let c = cfg();
    let p = |sink, local, k| fathom_plan::SelectParams { sink, local, k };
    assert!(check_select(&c, &p(4, 32, 64)).is_ok());
    for (bad, what) in [
        (p(4, 32, 0), "k"),
        (p(4, 32, 65), "max_k"),
        (p(40, 40, 8), "sink 40"),
        (p(usize::MAX - 10, 20, 8), "sink"),
    ] {
        let e = check_select(&c, &bad).unwrap_err().to_string();
        assert!(e.contains(what), "{bad:?}: {e}");
    }
    assert!(check_ds_channels(0, &[0, 5, 127], 128).is_ok());
    let e = check_ds_channels(1, &[3, 128], 128)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("head 1") && e.contains("128 is out of range"),
        "{e}"
    );
    let e = check_ds_channels(0, &[3, 3], 128).unwrap_err().to_string();
    assert!(e.contains("listed twice"), "{e}");
    use crate::config::Method;
    for ok in [Method::Fathom(48.0), Method::SparQ(16), Method::Exact] {
        assert!(ok.validate(128).is_ok(), "{ok:?}");
    }
    for bad in [
        Method::Fathom(f32::NAN),
        Method::Fathom(-1.0),
        Method::Fathom(1e9),
        Method::SparQ(0),
        Method::DoubleSparsity(129),
        Method::Loki(0),
    ] {
        assert!(bad.validate(128).is_err(), "{bad:?}");
    }
}

/// The ledger's rule: the current batch only, unchanged; a layer read only after its
/// append in the same step; captured appends count inside the capture and, at replay,
/// for the replayed batch; a new reserve starts over.
#[test]
fn the_step_ledger_refuses_reads_before_appends_and_edited_batches() {
    let c = cfg();
    let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
    let a = s.create().unwrap();
    let mut led = StepLedger::new(2);
    let b1 = AppendBatch::new(s.reserve_many(&[(a, 1)]).unwrap(), 1);
    assert!(
        led.check_current(&b1, "append").is_err(),
        "nothing reserved yet"
    );
    led.reserved(&b1);
    led.check_current(&b1, "append").unwrap();
    let e = led.check_read(&b1, 0, "attend").unwrap_err().to_string();
    assert!(e.contains("layer 0 has not been appended"), "{e}");
    led.appended(&b1, 0);
    led.check_read(&b1, 0, "attend").unwrap();
    assert!(led.check_read(&b1, 1, "read_rows").is_err());
    led.appended(&b1, 1);
    let mut edited = b1.clone();
    edited.rows += 1;
    let e = led
        .check_read(&edited, 0, "attend")
        .unwrap_err()
        .to_string();
    assert!(e.contains("last reserve returned"), "{e}");
    // The next step: layer 0's append of step 1 does not count for step 2.
    let b2 = AppendBatch::new(s.reserve_many(&[(a, 1)]).unwrap(), 2);
    led.reserved(&b2);
    assert!(led.check_read(&b2, 0, "attend").is_err());
    assert!(led.check_current(&b1, "append").is_err(), "the old batch");
    // A capture: its appends count for its own reads, not for the live cache.
    led.begin_capture();
    assert!(led.check_read(&b2, 1, "attend").is_err());
    led.appended(&b2, 1);
    led.check_read(&b2, 1, "attend").unwrap();
    let captured = led.end_capture();
    assert_eq!(captured, vec![false, true]);
    assert!(
        led.check_read(&b2, 1, "attend").is_err(),
        "recorded, not run"
    );
    led.replayed(&b2, &captured);
    led.check_read(&b2, 1, "attend").unwrap();
    assert!(led.check_read(&b2, 0, "attend").is_err());
}

/// A step that failed between its reserve and its appends leaves rows no append wrote:
/// that session is refused by name in that layer from then on (append, read, replay,
/// export), its other layers and other sessions go on, a fork inherits the hole, a free
/// forgets it; captured appends write their rows only when replayed.
#[test]
fn rows_no_append_wrote_are_never_read() {
    let c = cfg();
    let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
    let mut led = StepLedger::new(2);
    let (a, b) = (s.create().unwrap(), s.create().unwrap());
    led.created(a);
    led.created(b);
    let mut step = 0;
    let mut reserve = |s: &mut crate::pages::CacheSessions,
                       led: &mut StepLedger,
                       batch: &[(SessionId, usize)]| {
        step += 1;
        let ab = AppendBatch::new(s.reserve_many(batch).unwrap(), step);
        led.reserved(&ab);
        ab
    };
    // Step 1: a prompt of 3 tokens for a, 2 for b; layer 1 fails for both.
    let b1 = reserve(&mut s, &mut led, &[(a, 3), (b, 2)]);
    led.check_append(&b1, 0, "append").unwrap();
    led.appended(&b1, 0);
    led.check_read(&b1, 0, "attend").unwrap();
    assert_eq!(led.written_of(a), vec![3, 0]);
    // Step 2: layer 0 goes on; layer 1 is refused for a by name, before any launch.
    let b2 = reserve(&mut s, &mut led, &[(a, 1)]);
    led.check_append(&b2, 0, "append").unwrap();
    led.appended(&b2, 0);
    led.check_read(&b2, 0, "attend").unwrap();
    let e = led.check_append(&b2, 1, "append").unwrap_err().to_string();
    assert!(
        e.contains("session 0") && e.contains("rows 0..3 of layer 1 that no append wrote"),
        "{e}"
    );
    // Appended anyway (a caller that ignored the error): the hole stays, reads refuse.
    led.appended(&b2, 1);
    assert_eq!(led.written_of(a), vec![4, 0]);
    let e = led.check_read(&b2, 1, "attend").unwrap_err().to_string();
    assert!(e.contains("rows 0..4 of layer 1"), "{e}");
    assert!(led.check_written(a, 1, 4, "export").is_err());
    led.check_written(a, 0, 4, "export").unwrap();
    // A reserve refuses to grow it (its batch's appends would be refused, leaving a new
    // session's rows unwritten too); the new session alone grows.
    let c2 = s.create().unwrap();
    led.created(c2);
    let e = led
        .check_grow(&[(c2, 0), (a, s.len(a).unwrap())], "reserve")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("session 0") && e.contains("rows 0..4 of layer 1"),
        "{e}"
    );
    led.check_grow(&[(c2, 0)], "reserve").unwrap();
    // A fork inherits the hole; a free forgets the session; a new one starts whole.
    let f = s.fork(a).unwrap();
    led.forked(a, f);
    assert_eq!(led.written_of(f), vec![4, 0]);
    s.free(a).unwrap();
    led.freed(a);
    let n = s.create().unwrap();
    led.created(n);
    assert_eq!(led.written_of(n), vec![0, 0]);
    // Captured appends write nothing until replayed; a replay over a hole is refused.
    let b3 = reserve(&mut s, &mut led, &[(n, 1)]);
    led.begin_capture();
    led.check_append(&b3, 0, "append").unwrap();
    led.appended(&b3, 0);
    led.check_read(&b3, 0, "attend").unwrap();
    let g = led.end_capture();
    assert_eq!(led.written_of(n), vec![0, 0], "recorded, not run");
    led.check_replay(&b3, &g, "replay").unwrap();
    led.replayed(&b3, &g);
    assert_eq!(led.written_of(n), vec![1, 0]);
    let b4 = reserve(&mut s, &mut led, &[(b, 1)]);
    let e = led
        .check_replay(&b4, &[true, true], "replay")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("session 1") && e.contains("rows 0..2 of layer 1"),
        "{e}"
    );
    led.check_replay(&b4, &[true, false], "replay").unwrap();
}

/// The written-prefix rule against the ground truth, at several sizes: random creates,
/// forks, frees, reserves, appends of some layers only (failed steps), truncations and
/// reads, with a bitmap of the rows each append really wrote beside the ledger. Sound: a
/// read, append or reserve the ledger allows never touches a row no append wrote (a read
/// of a layer needs all its rows; an append the rows before its new ones; a reserve every
/// written layer's rows). Complete on healthy sessions: a read of a layer appended in the
/// step, whose rows are all written, is allowed. (Checked by mutation: dropping the
/// truncation's clamp, the append's prefix check or the reserve's check fails this test;
/// the read's own prefix check is defence in depth behind the other two.)
#[test]
// `l` indexes the ground truth's inner vectors and names the layer checked.
#[allow(clippy::needless_range_loop)]
fn the_written_prefix_never_lets_an_unwritten_row_be_read() {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use std::collections::BTreeMap;
    for (seed, layers, sessions, pages) in
        [(1u64, 1usize, 2usize, 8usize), (2, 2, 4, 8), (3, 4, 4, 32)]
    {
        let mut c = cfg();
        c.shape.layers = layers;
        c.pages.max_sessions = sessions;
        c.pages.pages = pages;
        let mut rng = StdRng::seed_from_u64(0x1ED6 + seed);
        let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
        let mut led = StepLedger::new(layers);
        // Ground truth: per live session, per layer, which rows an append wrote.
        let mut rows: BTreeMap<SessionId, Vec<Vec<bool>>> = BTreeMap::new();
        let mut batch: Option<AppendBatch> = None;
        let mut step = 0u64;
        let (mut refused, mut allowed_reads) = (0, 0);
        for _ in 0..3000 {
            let live: Vec<SessionId> = rows.keys().copied().collect();
            let pick = |rng: &mut StdRng| live[rng.gen_range(0..live.len())];
            match rng.gen_range(0..12) {
                0 => {
                    if let Ok(id) = s.create() {
                        led.created(id);
                        rows.insert(id, vec![Vec::new(); layers]);
                    }
                }
                1 if !live.is_empty() => {
                    let p = pick(&mut rng);
                    if let Ok(id) = s.fork(p) {
                        led.forked(p, id);
                        let r = rows[&p].clone();
                        rows.insert(id, r);
                    }
                }
                2 if !live.is_empty() && rng.gen_bool(0.3) => {
                    let id = pick(&mut rng);
                    s.free(id).unwrap();
                    led.freed(id);
                    rows.remove(&id);
                    batch = None;
                }
                3 if !live.is_empty() => {
                    // A truncation (the plain cut; a backend's re-append is appends).
                    let id = pick(&mut rng);
                    let n = s.len(id).unwrap();
                    let to = n.saturating_sub(rng.gen_range(0..=70));
                    s.truncate(id, to).unwrap();
                    led.truncated(id, to);
                    rows.get_mut(&id)
                        .unwrap()
                        .iter_mut()
                        .for_each(|r| r.truncate(to));
                    batch = None;
                }
                4..=6 if !live.is_empty() => {
                    let mut want: Vec<(SessionId, usize)> = Vec::new();
                    for _ in 0..rng.gen_range(1..=live.len()) {
                        let id = pick(&mut rng);
                        if want.iter().all(|(x, _)| *x != id) {
                            want.push((id, [1, 1, 3, 64, 65][rng.gen_range(0..5)]));
                        }
                    }
                    let lens: Vec<(SessionId, usize)> = want
                        .iter()
                        .map(|&(id, _)| (id, s.len(id).unwrap()))
                        .collect();
                    let ok = led.check_grow(&lens, "reserve").is_ok();
                    if ok {
                        // Sound: every written layer holds all of each session's rows.
                        for &(id, _) in &lens {
                            for l in led.appended_layers() {
                                assert!(rows[&id][l].iter().all(|&w| w), "reserve over a hole");
                            }
                        }
                        if let Ok(plans) = s.reserve_many(&want) {
                            step += 1;
                            let b = AppendBatch::new(plans, step);
                            led.reserved(&b);
                            for p in &b.plans {
                                for r in rows.get_mut(&p.session).unwrap() {
                                    r.resize(p.first_token + p.tokens, false);
                                }
                            }
                            batch = Some(b);
                        }
                    } else {
                        refused += 1;
                    }
                }
                7..=9 => {
                    // An append of one layer (a failed step skips some).
                    let Some(b) = &batch else { continue };
                    let l = rng.gen_range(0..layers);
                    if led.check_append(b, l, "append").is_ok() {
                        for p in &b.plans {
                            let r = &mut rows.get_mut(&p.session).unwrap()[l];
                            assert!(r[..p.first_token].iter().all(|&w| w), "append over a hole");
                            r[p.first_token..p.first_token + p.tokens].fill(true);
                        }
                        led.appended(b, l);
                    } else {
                        refused += 1;
                    }
                }
                _ => {
                    let Some(b) = &batch else { continue };
                    for l in 0..layers {
                        let whole = b
                            .plans
                            .iter()
                            .all(|p| rows[&p.session][l].iter().all(|&w| w));
                        let fresh = led.appended_at[l] == b.step;
                        match led.check_read(b, l, "attend") {
                            Ok(()) => {
                                assert!(whole, "a read of rows no append wrote");
                                allowed_reads += 1;
                            }
                            Err(_) => assert!(!(whole && fresh), "a healthy read refused"),
                        }
                    }
                }
            }
            s.check().unwrap();
        }
        assert!(
            refused > 20 && allowed_reads > 20,
            "seed {seed}: {refused} refused, {allowed_reads} reads"
        );
    }
}

#[test]
fn host_rows_past_the_stored_ranges_are_refused() {
    let c = cfg();
    let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
    let a = s.create().unwrap();
    let batch = AppendBatch::new(s.reserve_many(&[(a, 1)]).unwrap(), 1);
    let n = c.shape.kv_heads * c.shape.dim;
    let (k, v) = (vec![0.5f32; n], vec![0.5f32; n]);
    assert!(check_host_rows(&c, &batch, &k, &v).is_ok());
    let mut big = k.clone();
    // The largest bf16 below fp16's limit; 65504 itself rounds to the bf16 65536.
    big[130] = 65_280.0;
    assert!(check_host_rows(&c, &batch, &big, &v).is_ok());
    big[130] = 65_504.0;
    let e = check_host_rows(&c, &batch, &big, &v)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("keys") && e.contains("head 1, channel 2") && e.contains("fp16"),
        "{e}"
    );
    let mut vbig = v.clone();
    vbig[3] = 70_000.0;
    assert!(
        check_host_rows(&c, &batch, &k, &vbig).is_ok(),
        "values are bf16 records"
    );
    vbig[3] = f32::MAX;
    let e = check_host_rows(&c, &batch, &k, &vbig)
        .unwrap_err()
        .to_string();
    assert!(e.contains("values") && e.contains("bf16"), "{e}");
}

#[test]
fn configs_are_validated() {
    assert!(cfg().validate().is_ok());
    let mut c = cfg();
    c.shape.dim = 96;
    assert!(c.validate().unwrap_err().to_string().contains("D = 96"));
    let mut c = cfg();
    c.max_batch = 5;
    assert!(c.validate().unwrap_err().to_string().contains("max_batch"));
    let mut c = cfg();
    c.pages.page_tokens = 96;
    assert!(c.validate().is_err());
    let mut c = cfg();
    c.pages.page_tokens = MAX_PAGE_TOKENS * 2;
    c.pages.max_tokens = MAX_PAGE_TOKENS * 2;
    assert!(c
        .validate()
        .unwrap_err()
        .to_string()
        .contains("page_tokens"));
    // At the limit, one KV head's runs at D = 256 fit a 32-bit offset.
    let lay = crate::paged_layout::PagedLayout::new(
        fathom_store::Dims {
            heads: 1,
            channels: 256,
        },
        MAX_PAGE_TOKENS,
        1,
    )
    .unwrap();
    assert!(256 * lay.channel_run_bytes() < 1 << 32);
}

#[test]
fn rows_are_checked_against_the_batch() {
    let c = cfg();
    let mut s = crate::pages::CacheSessions::new(c.pages).unwrap();
    let (a, b) = (s.create().unwrap(), s.create().unwrap());
    let batch = AppendBatch::new(s.reserve_many(&[(a, 3), (b, 70)]).unwrap(), 1);
    assert_eq!(batch.row0, vec![0, 3]);
    assert_eq!(batch.rows, 73);
    let n = 73 * c.shape.kv_heads * c.shape.dim;
    // SAFETY: the views are only checked, never launched on.
    let (k, v, short, f32s) = unsafe {
        use crate::memory::DeviceView;
        (
            DeviceView::from_raw(16, n, KvDtype::Bf16),
            DeviceView::from_raw(32, n, KvDtype::Bf16),
            DeviceView::from_raw(48, n - 1, KvDtype::Bf16),
            DeviceView::from_raw(64, n, KvDtype::F32),
        )
    };
    let kv = KvRows { k, v, rows: 73 };
    assert!(check_rows(&c, &batch, 1, 1, &kv).is_ok());
    let e = check_rows(&c, &batch, 1, 2, &kv).unwrap_err().to_string();
    assert!(e.contains("2 layers"), "{e}");
    let e = check_rows(&c, &batch, 2, 0, &kv).unwrap_err().to_string();
    assert!(e.contains("stale"), "{e}");
    let e = check_rows(&c, &batch, 1, 0, &KvRows { rows: 72, ..kv })
        .unwrap_err()
        .to_string();
    assert!(e.contains("72 rows"), "{e}");
    let e = check_rows(&c, &batch, 1, 0, &KvRows { k: short, ..kv })
        .unwrap_err()
        .to_string();
    assert!(e.contains("keys") && e.contains("want at least"), "{e}");
    let e = check_rows(&c, &batch, 1, 0, &KvRows { v: f32s, ..kv })
        .unwrap_err()
        .to_string();
    assert!(e.contains("one dtype"), "{e}");
}
