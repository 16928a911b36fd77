//! Capture and replay of a decode step as a CUDA graph (docs/SPEC.md §6.1).

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// Captures one decode step into a CUDA graph: `step` is called once, on this cache, and
    /// must only [`PagedCache::append`] and [`PagedCache::attend`] (device pointers; the model's
    /// own kernels may run on [`PagedCache::stream`] too) for `batch`, a decode batch (one
    /// token per session). While capturing, the scan's grid covers `max_tokens`, so the graph
    /// stays valid as the sessions grow. Replay it with [`PagedCache::replay`] after each
    /// [`PagedCache::reserve`] of the same sessions, with this step's K, V and queries written
    /// to the same device buffers.
    ///
    /// # Errors
    /// A batch that is not a decode batch; whatever `step` returns; a failed capture.
    pub fn capture(
        &mut self,
        batch: &AppendBatch,
        step: impl FnOnce(&mut PagedCache) -> Result<()>,
    ) -> Result<DecodeGraph> {
        self.begin_capture(batch)?;
        let ran = step(self);
        let graph = self.end_capture();
        ran?;
        graph
    }

    /// [`PagedCache::capture`] in two calls, for a caller whose step is not a closure over
    /// the cache (a model whose forward owns it): from here until [`PagedCache::end_capture`]
    /// everything queued on [`PagedCache::stream`] is recorded, not run, and attends size
    /// their grids for `max_tokens`. Nothing in between may wait for the stream, and the
    /// calls that would change what the graph reads (a setting, a calibration, a `prepare`, a
    /// new session) are refused by name. The graph replays only on this cache, and only while
    /// its settings are those of the capture ([`PagedCache::check_graph`]).
    ///
    /// # Errors
    /// A batch that is not the current decode batch; a capture already under way; a driver
    /// failure (nothing is left capturing).
    pub fn begin_capture(&mut self, batch: &AppendBatch) -> Result<()> {
        if batch.plans.iter().any(|p| p.tokens != 1) || batch.step != self.step {
            return Err(CudaError::invalid(
                "capture",
                "capture needs the current decode batch (one token per session)",
            ));
        }
        if self.capturing.is_some() {
            return Err(CudaError::invalid(
                "capture",
                "a capture is already under way",
            ));
        }
        self.sync()?;
        self.stream
            .begin_capture(
                cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
            .map_err(drv("begin_capture"))?;
        self.fixed_grids = true;
        self.capturing = Some((self.plans_counted, batch.sessions(), self.settings));
        self.ledger.begin_capture();
        Ok(())
    }

    /// Ends the capture [`PagedCache::begin_capture`] started and instantiates the graph.
    ///
    /// # Errors
    /// No capture under way; a failed capture (a launch that may not be captured, a wait for
    /// the stream in between) or nothing captured.
    pub fn end_capture(&mut self) -> Result<DecodeGraph> {
        let (plans0, sessions, settings0) = self
            .capturing
            .take()
            .ok_or_else(|| CudaError::invalid("capture", "no capture under way"))?;
        let graph = self
            .stream
            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
        self.fixed_grids = false;
        // The capture is over whatever follows: the layers it appended go with its graph.
        let appended = self.ledger.end_capture();
        // Nothing ran while capturing: the plans are counted when the graph is replayed.
        let plans = self.plans_counted - plans0;
        self.plans_counted = plans0;
        let graph = graph
            .map_err(drv("end_capture"))?
            .ok_or_else(|| CudaError::invalid("capture", "the step launched nothing"))?;
        if self.settings != settings0 {
            return Err(CudaError::invalid(
                "capture",
                "a setting of the cache changed during the capture: capture the step again",
            ));
        }
        Ok(DecodeGraph {
            graph,
            cache: self.id,
            sessions,
            plans,
            settings: self.settings,
            appended,
        })
    }

    /// Replays a captured decode step for `batch`, the current reserve of the same sessions
    /// (one token each), on the cache's stream.
    ///
    /// # Errors
    /// A stale batch, or one whose sessions or token counts differ from the captured one's; a
    /// graph captured before a setting changed (it would run the old step); a session whose
    /// earlier rows no append wrote in a layer the graph appends.
    pub fn replay(&mut self, batch: &AppendBatch, graph: &DecodeGraph) -> Result<()> {
        self.check_graph(graph)?;
        if batch.step != self.step
            || batch.sessions() != graph.sessions
            || batch.plans.iter().any(|p| p.tokens != 1)
        {
            return Err(CudaError::invalid(
                "replay",
                "the graph replays the decode step of the sessions it was captured for, after their current reserve",
            ));
        }
        self.ledger.check_replay(batch, &graph.appended, "replay")?;
        graph.graph.launch().map_err(drv("graph launch"))?;
        self.ledger.replayed(batch, &graph.appended);
        self.plans_counted += graph.plans;
        Ok(())
    }

    /// Whether `graph` may still be replayed on this cache: refused when a setting changed
    /// since its capture (its kernels were recorded with other settings, and buffers it reads,
    /// such as the host gather's or a replaced calibration's, may be freed). A caller that
    /// reserves before [`PagedCache::replay`] checks this first, so a stale graph changes
    /// nothing.
    ///
    /// # Errors
    /// The stale graph.
    pub fn check_graph(&self, graph: &DecodeGraph) -> Result<()> {
        if graph.cache != self.id {
            return Err(CudaError::invalid(
                "replay",
                "the graph was captured on another cache (its kernels read that cache's buffers)",
            ));
        }
        if graph.settings != self.settings {
            return Err(CudaError::invalid(
                "replay",
                "a setting of the cache changed since the capture (select path, head groups, scan loads, host gather, a calibration, a static method's depths): capture the step again",
            ));
        }
        Ok(())
    }
}

/// A captured decode step ([`PagedCache::capture`]).
pub struct DecodeGraph {
    graph: cudarc::driver::CudaGraph,
    /// The cache that captured it ([`PagedCache`]'s id).
    cache: u64,
    sessions: Vec<SessionId>,
    plans: u64,
    /// The cache's settings generation at the capture (a change since makes it stale).
    settings: u64,
    /// The layers the step appends (a replay writes their rows for the batch it replays).
    appended: Vec<bool>,
}

impl std::fmt::Debug for DecodeGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DecodeGraph")
            .field("sessions", &self.sessions)
            .finish_non_exhaustive()
    }
}
