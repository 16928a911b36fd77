//! Capture and replay of a decode step as a CUDA graph (docs/SPEC.md §6.1).

#[allow(unused_imports)]
use super::*;

impl PagedCache {
    /// [`crate::api::KvCache::capture`].
    pub(crate) fn capture(
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

    /// [`crate::api::KvCache::begin_capture`].
    pub(crate) fn begin_capture(&mut self, batch: &AppendBatch) -> Result<()> {
        self.start_capture(batch, false)
    }

    /// [`crate::api::KvCache::begin_caller_capture`].
    pub(crate) fn begin_caller_capture(&mut self, batch: &AppendBatch) -> Result<()> {
        self.start_capture(batch, true)
    }

    /// The capture's checks and bookkeeping; the cache's stream starts capturing unless the
    /// capture is the caller's.
    fn start_capture(&mut self, batch: &AppendBatch, caller: bool) -> Result<()> {
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
        if !caller {
            self.stream
                .begin_capture(
                    cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                )
                .map_err(drv("begin_capture"))?;
        }
        self.caller_capture = caller;
        self.fixed_grids = true;
        self.capturing = Some((self.plans_counted, batch.sessions(), self.settings));
        self.ledger.begin_capture();
        Ok(())
    }

    /// [`crate::api::KvCache::end_capture`].
    pub(crate) fn end_capture(&mut self) -> Result<DecodeGraph> {
        let (plans0, sessions, settings0) = self
            .capturing
            .take()
            .ok_or_else(|| CudaError::invalid("capture", "no capture under way"))?;
        let caller = std::mem::take(&mut self.caller_capture);
        let graph = if caller {
            Ok(None)
        } else {
            self.stream
                .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0))
        };
        self.fixed_grids = false;
        // The capture is over whatever follows: the layers it appended go with its graph.
        let appended = self.ledger.end_capture();
        // Nothing ran while capturing: the plans are counted when the graph is replayed.
        let plans = self.plans_counted - plans0;
        self.plans_counted = plans0;
        let graph = match graph.map_err(drv("end_capture"))? {
            Some(g) => Some(g),
            None if caller => None,
            None => return Err(CudaError::invalid("capture", "the step launched nothing")),
        };
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

    /// [`crate::api::KvCache::replay`].
    pub(crate) fn replay(&mut self, batch: &AppendBatch, graph: &DecodeGraph) -> Result<()> {
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
        if let Some(g) = &graph.graph {
            g.launch().map_err(drv("graph launch"))?;
        }
        self.ledger.replayed(batch, &graph.appended);
        self.plans_counted += graph.plans;
        Ok(())
    }

    /// [`crate::api::KvCache::check_graph`].
    pub(crate) fn check_graph(&self, graph: &DecodeGraph) -> Result<()> {
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

/// A captured decode step ([`crate::api::KvCache::capture`]).
pub struct DecodeGraph {
    /// The instantiated graph; none for the caller's own capture (it replays its graph itself).
    graph: Option<cudarc::driver::CudaGraph>,
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
