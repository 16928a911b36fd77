//! The soak's decode steps (a ragged reserve, appends of every layer, attends of drawn
//! methods) and its refusals (an over-full session, an attend over unwritten rows, bad
//! shapes), each checked against the twin; after a refusal the cache must go on serving.

use fathom_cuda::cache::{AppendBatch, AttendMethod};
use fathom_cuda::pages::SessionId;
use fathom_plan::SelectParams;
use rand::seq::SliceRandom;
use rand::Rng;

use crate::ops::{key_elem, refused, Soak, MAX_K, MAX_LIVE};
use crate::subject::Subject;

/// A bad call a step makes before its good one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// Layer 0's keys one row short.
    AppendShape,
    /// Queries one element short.
    QueryShape,
    /// A top-k past the cache's `max_k`.
    TopK,
}

impl<S: Subject> Soak<'_, S> {
    /// A ragged batch of live sessions: decode tokens, short chunks and prefill chunks, each
    /// within the session's room (full sessions sit out).
    fn draw_batch(&mut self) -> Vec<(SessionId, usize)> {
        let mut live = self.twin.live();
        live.shuffle(&mut self.rng);
        let take = self.rng.gen_range(1..=live.len().min(MAX_LIVE));
        let cap = self.twin.cfg.pages.max_tokens;
        let mut batch = Vec::new();
        for s in live.into_iter().take(take) {
            let m = match self.rng.gen_range(0..10) {
                0..=4 => 1,
                5..=7 => self.rng.gen_range(2..=70),
                _ => self.rng.gen_range(71..=600),
            };
            let m = m.min(cap - self.twin.len(s));
            if m > 0 {
                batch.push((s, m));
            }
        }
        batch
    }

    /// One layer's K and V rows for a batch; one row in 16 repeats the session's previous key
    /// (equal scores: ties in the top-k).
    fn rows(&mut self, b: &AppendBatch, layer: usize) -> (Vec<f32>, Vec<f32>) {
        let (row, d) = (self.twin.dims().row(), self.twin.cfg.shape.dim);
        let (mut k, mut v) = (
            Vec::with_capacity(b.rows * row),
            Vec::with_capacity(b.rows * row),
        );
        for p in &b.plans {
            let held = &self.twin.sessions[&p.session][layer].k;
            for i in 0..p.tokens {
                let repeat = self.rng.gen_ratio(1, 16);
                if repeat && i > 0 {
                    k.extend_from_within(k.len() - row..);
                } else if repeat && !held.is_empty() {
                    k.extend_from_slice(&held[held.len() - row..]);
                } else {
                    k.extend((0..row).map(|j| key_elem(&mut self.rng, j % d, d)));
                }
                v.extend((0..row).map(|_| self.rng.gen_range(-2.0f32..2.0)));
            }
        }
        (k, v)
    }

    /// Appends every layer of `b` except `skip`, to the subject and the twin.
    fn append_layers(
        &mut self,
        b: &AppendBatch,
        skip: Option<usize>,
        bad: Option<Bad>,
    ) -> Result<(), String> {
        let row = self.twin.dims().row();
        for l in (0..self.twin.cfg.shape.layers).filter(|&l| Some(l) != skip) {
            let (k, v) = self.rows(b, l);
            if l == 0 && bad == Some(Bad::AppendShape) {
                let short = k.len() - row;
                refused(
                    self.subj.append(b, 0, &k[..short], &v[..short]),
                    "append one row short",
                )?;
                self.tally.add("refusal:append shape");
            }
            self.subj
                .append(b, l, &k, &v)
                .map_err(|e| format!("append layer {l}: {e}"))?;
            self.twin.appended(b, l, &k, &v);
            self.tally.add("append");
        }
        Ok(())
    }

    /// A decode step: a ragged reserve, appends of every layer (each session's store then
    /// checked), and one to three attends of drawn methods per layer, each checked.
    pub(crate) fn step(&mut self, bad: Option<Bad>) -> Result<(), String> {
        let batch = self.draw_batch();
        if batch.is_empty() {
            // Every session drawn is full.
            return self.truncate();
        }
        let b = self
            .subj
            .reserve(&batch)
            .map_err(|e| format!("reserve {batch:?}: {e}"))?;
        self.tally.add("reserve");
        self.append_layers(&b, None, bad)?;
        self.appended_once = true;
        for &(s, _) in &batch {
            self.check(s)?;
        }
        for l in 0..self.twin.cfg.shape.layers {
            let n = if l == 0 && bad.is_some() {
                1
            } else {
                self.rng.gen_range(1..=3)
            };
            for _ in 0..n {
                self.attend(&b, l, if l == 0 { bad } else { None })?;
            }
        }
        Ok(())
    }

    /// One attend of a drawn method and selection at the batch's last tokens, checked.
    fn attend(&mut self, b: &AppendBatch, l: usize, bad: Option<Bad>) -> Result<(), String> {
        let sh = self.twin.cfg.shape;
        let q: Vec<f32> = (0..b.plans.len() * sh.kv_heads * sh.group * sh.dim)
            .map(|_| self.rng.gen_range(-1.0..1.0))
            .collect();
        let p = SelectParams {
            sink: 4,
            local: [16, 32][self.rng.gen_range(0..2)],
            k: [8, 40, MAX_K][self.rng.gen_range(0..3)],
        };
        let (name, m) = self.methods.choose(&mut self.rng).expect("methods").clone();
        match bad {
            Some(Bad::QueryShape) => {
                let r = self.subj.attend(b, l, m, &p, &q[..q.len() - 1]);
                refused(r, "queries one short")?;
                self.tally.add("refusal:query shape");
            }
            Some(Bad::TopK) => {
                let r = self
                    .subj
                    .attend(b, l, m, &SelectParams { k: MAX_K + 1, ..p }, &q);
                refused(r, "k past max_k")?;
                self.tally.add("refusal:top-k past max_k");
            }
            _ => {}
        }
        let out = self
            .subj
            .attend(b, l, m, &p, &q)
            .map_err(|e| format!("attend {name} layer {l}: {e}"))?;
        let heads = self
            .twin
            .check_attend(&self.subj, (b, l), (m, &p), &q, &out)
            .map_err(|e| format!("attend {name} layer {l} {p:?}: {e}"))?;
        self.tally.heads_checked += heads as u64;
        self.tally.add(format!("attend:{name}"));
        Ok(())
    }

    /// One refusal of a drawn kind; the sessions it touched keep their stores.
    pub(crate) fn refusal(&mut self) -> Result<(), String> {
        let s = self.pick();
        let n = self.twin.len(s);
        match self.rng.gen_range(0..7) {
            0 => {
                let m = self.twin.cfg.pages.max_tokens - n + 1 + self.rng.gen_range(0..64);
                refused(self.subj.reserve(&[(s, m)]), "reserve past max_tokens")?;
                self.tally.add("refusal:over-full session");
            }
            1 => {
                refused(self.subj.reserve(&[(s, 1), (s, 1)]), "a session twice")?;
                self.tally.add("refusal:session twice");
            }
            2 => {
                refused(self.subj.truncate(s, n + 1), "truncate past the length")?;
                self.tally.add("refusal:truncate past length");
            }
            3 => return self.unwritten(),
            4 => return self.step(Some(Bad::AppendShape)),
            5 => return self.step(Some(Bad::QueryShape)),
            _ => return self.step(Some(Bad::TopK)),
        }
        self.check(s)
    }

    /// A step that fails after its reserve (one layer never appended): an attend of that
    /// layer is refused, one of an appended layer is served and checked, a reserve that grows
    /// the sessions is refused, and a truncation to the written rows heals them.
    fn unwritten(&mut self) -> Result<(), String> {
        let batch = self.draw_batch();
        if batch.is_empty() {
            return self.truncate();
        }
        let layers = self.twin.cfg.shape.layers;
        let before: Vec<(SessionId, usize)> =
            batch.iter().map(|&(s, _)| (s, self.twin.len(s))).collect();
        let b = self
            .subj
            .reserve(&batch)
            .map_err(|e| format!("reserve {batch:?}: {e}"))?;
        self.tally.add("reserve");
        let skip = self.rng.gen_range(0..layers);
        self.append_layers(&b, Some(skip), None)?;
        let sh = self.twin.cfg.shape;
        let q = vec![0.25f32; b.plans.len() * sh.kv_heads * sh.group * sh.dim];
        let p = SelectParams {
            sink: 4,
            local: 32,
            k: 8,
        };
        let r = self.subj.attend(&b, skip, AttendMethod::Dense, &p, &q);
        refused(r, "attend over unwritten rows")?;
        self.tally.add("refusal:attend over unwritten rows");
        self.attend(&b, (skip + 1) % layers, None)?;
        if self.appended_once {
            let grow: Vec<(SessionId, usize)> = before.iter().map(|&(s, _)| (s, 1)).collect();
            refused(self.subj.reserve(&grow), "reserve over unwritten rows")?;
            self.tally.add("refusal:reserve over unwritten rows");
        }
        for (s, n) in before {
            self.subj
                .truncate(s, n)
                .map_err(|e| format!("heal by truncate to {n}: {e}"))?;
            self.twin.truncated(s, n);
            self.tally.add("truncate");
            self.tally.add("truncate:to the written rows");
            self.check(s)?;
        }
        Ok(())
    }
}
