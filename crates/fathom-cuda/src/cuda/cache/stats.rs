//! What a cache reports on request: plan bits, row and select counters, stage times, and a
//! debug readback of one attend.

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// [`crate::api::KvCache::debug_readback`].
    pub(crate) fn debug_readback(&self, batch: &AppendBatch, b: usize) -> Result<AttendDebug> {
        self.sync()?;
        let s = self.cfg.shape;
        let (hkv, g, d, hq) = (s.kv_heads, s.group, s.dim, s.kv_heads * s.group);
        let p = batch.plans.get(b).ok_or_else(|| {
            CudaError::invalid("batch index", format!("{b} of {}", batch.plans.len()))
        })?;
        let n = p.end_token();
        // Session b's rows only (the score buffer holds max_batch · Hq · max_tokens).
        let depths: Vec<u8> = self.work.depths.read_at(b * hkv * d, hkv * d)?;
        let mt = self.cfg.pages.max_tokens;
        let scores: Vec<f32> = self.work.scores.read_at(b * hq * mt, hq * mt)?;
        let mk = self.cfg.max_k;
        let winners: Vec<u32> = self.work.winners.read_at(b * hq * mk, hq * mk)?;
        let counts: Vec<u32> = self.work.counts.read_at(b * hq, hq)?;
        let mut sc = Vec::with_capacity(hq * n);
        for r in 0..hq {
            sc.extend_from_slice(&scores[r * mt..r * mt + n]);
        }
        let win = (0..hq)
            .map(|r| {
                let mut v = winners[r * mk..r * mk + counts[r] as usize].to_vec();
                v.sort_unstable();
                v
            })
            .collect();
        let _ = g;
        Ok(AttendDebug {
            depths,
            scores: sc,
            winners: win,
        })
    }

    /// [`crate::api::KvCache::plan_bits`].
    pub(crate) fn plan_bits(&self) -> Result<(f64, u64)> {
        self.sync()?;
        let v: Vec<f32> = self.work.bits_acc.read(1)?;
        let n = self.plans_counted;
        Ok((if n > 0 { v[0] as f64 / n as f64 } else { 0.0 }, n))
    }

    /// [`crate::api::KvCache::row_counters`].
    pub(crate) fn row_counters(&self) -> Result<RowCounters> {
        self.sync()?;
        let v: Vec<u64> = self.work.counters.read(2)?;
        Ok(RowCounters {
            rows: v[0],
            hits: v[1],
        })
    }

    /// [`crate::api::KvCache::select_counters`].
    pub(crate) fn select_counters(&self) -> Result<SelectCounters> {
        self.sync()?;
        let v: Vec<u64> = self.work.counters.read(4)?;
        Ok(SelectCounters {
            filtered: v[2],
            fallbacks: v[3],
        })
    }

    /// [`crate::api::KvCache::stage_times`].
    pub(crate) fn stage_times(&mut self) -> Result<AttendStages> {
        self.sync()?;
        let mut out = AttendStages {
            untimed: self.stage_untimed,
            ..AttendStages::default()
        };
        let mut prev: Option<&CudaEvent> = None;
        for (stage, e) in &self.stage_marks {
            let ms = match (stage, prev) {
                (AttendStage::Start, _) | (_, None) => 0.0,
                (_, Some(p)) => f64::from(p.elapsed_ms(e).map_err(drv("stage elapsed"))?),
            };
            out.add(*stage, ms);
            prev = Some(e);
        }
        self.stage_marks.clear();
        self.stage_untimed = 0;
        Ok(out)
    }
}
