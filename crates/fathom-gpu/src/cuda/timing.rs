//! Per-stage timing of instrumented decode steps (CUDA events around appends, attention and
//! sampling).

#[allow(unused_imports)]
use super::*;

impl GpuDecoder {
    /// Turns the per-stage timing of [`GpuDecoder::decode_greedy`] steps on or off (CUDA events
    /// around every append, attention and the sampling; leave it off for throughput). The
    /// split of each attend by stage comes from the cache, when it was made with
    /// [`fathom_cuda::cache::CacheOptions::stage_timing`] (`DecoderConfig::options`).
    pub fn set_instrument(&mut self, on: bool) {
        self.timing = on.then(Timing::default);
    }

    /// The stage times of the instrumented steps since the last call (waits for the stream).
    ///
    /// # Errors
    /// Instrumentation off; a driver failure.
    pub fn take_stage_times(&mut self) -> Result<StageTimes> {
        let tm = self.timing.replace(Timing::default()).ok_or_else(|| {
            GpuError::invalid("stage times", "instrumentation is off (set_instrument)")
        })?;
        self.stream.synchronize().map_err(drv("synchronize"))?;
        let sum = |v: &[(CudaEvent, CudaEvent)]| -> Result<f64> {
            let mut t = 0.0;
            for (a, b) in v {
                t += a.elapsed_ms(b).map_err(drv("event elapsed"))? as f64;
            }
            Ok(t)
        };
        let (total, attention, appends, sampling) = (
            sum(&tm.steps)?,
            sum(&tm.attention)?,
            sum(&tm.appends)?,
            sum(&tm.sampling)?,
        );
        Ok(StageTimes {
            steps: tm.steps.len(),
            total_ms: total,
            attention_ms: attention,
            appends_ms: appends,
            sampling_ms: sampling,
            weights_ms: (total - attention - appends - sampling).max(0.0),
            attend: self.cache.stage_times()?,
        })
    }

    /// A timing event recorded now when instrumenting.
    pub(super) fn mark(&self) -> Result<Option<CudaEvent>> {
        if self.timing.is_none() {
            return Ok(None);
        }
        Ok(Some(
            self.stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(drv("event record"))?,
        ))
    }

    /// Closes a `mark` into the stage list `pick` chooses (a function of the two fields, so
    /// that callers may hold other fields borrowed).
    pub(super) fn close(
        stream: &CudaStream,
        timing: &mut Option<Timing>,
        start: Option<CudaEvent>,
        pick: impl FnOnce(&mut Timing) -> &mut Vec<(CudaEvent, CudaEvent)>,
    ) -> Result<()> {
        let (Some(a), Some(tm)) = (start, timing.as_mut()) else {
            return Ok(());
        };
        let b = stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv("event record"))?;
        pick(tm).push((a, b));
        Ok(())
    }
}
