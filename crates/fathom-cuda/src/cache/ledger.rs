//! The step ledger (docs/SPEC.md §6.1): which batch is current, which layers its step has
//! appended, and the prefix of rows appends wrote per session and layer.

#[allow(unused_imports)]
use super::*;

/// What a cache knows of its current step on the host: the batch its last reserve returned,
/// per layer whether that step's rows are written, and per session and layer how many of its
/// rows are written. The paged cache's rule, pure CPU so that it is unit-tested without a GPU:
///
/// * a call that launches with the reserve's descriptors gets that batch, unchanged
///   ([`AppendBatch`]'s fields are public; an edited copy would size grids and buffers for
///   other rows);
/// * an attend or a row read of a layer reads the step's new rows, which only that layer's
///   append writes: refused until the append ran (or, inside a capture, was recorded before
///   it); a captured step's appends count for the batch it is replayed for;
/// * a reserve grows a session in every layer at once, so a step that failed between its
///   reserve and its last append leaves rows no append wrote: `written[s][l]`, the rows of
///   session `s` whose layer-`l` slots an append wrote (a prefix: appends write at the end),
///   then stays below the session's length. An append must start at the written prefix and
///   an attend, row read or export must find the whole session written, so such a session
///   is refused by name in that layer (never read), and a reserve refuses to grow it (its
///   batch's other sessions would be left unwritten too), until it is freed. A fork inherits
///   its parent's prefix.
#[derive(Debug, Clone)]
pub struct StepLedger {
    pub(super) current: Option<AppendBatch>,
    /// Per layer, the step whose rows its last append wrote (0: none; steps start at 1).
    pub(super) appended_at: Vec<u64>,
    /// Per layer, appended inside the capture under way (recorded, not yet run).
    pub(super) captured: Option<Vec<bool>>,
    /// Per live session, per layer: the rows written (a prefix of the session).
    pub(super) written: std::collections::HashMap<SessionId, Vec<usize>>,
}

impl StepLedger {
    /// A cache of `layers` layers, nothing reserved.
    pub fn new(layers: usize) -> StepLedger {
        StepLedger {
            current: None,
            appended_at: vec![0; layers],
            captured: None,
            written: std::collections::HashMap::new(),
        }
    }

    /// `session` was created (empty: nothing written).
    pub fn created(&mut self, session: SessionId) {
        self.written
            .insert(session, vec![0; self.appended_at.len()]);
    }

    /// `child` was forked from `parent` (it holds the parent's rows, written as far as the
    /// parent's were).
    pub fn forked(&mut self, parent: SessionId, child: SessionId) {
        let w = self.written_of(parent);
        self.written.insert(child, w);
    }

    /// `session` was freed.
    pub fn freed(&mut self, session: SessionId) {
        self.written.remove(&session);
    }

    /// `session` was cut to `len` tokens: no layer holds written rows past it.
    pub fn truncated(&mut self, session: SessionId, len: usize) {
        if let Some(w) = self.written.get_mut(&session) {
            w.iter_mut().for_each(|x| *x = (*x).min(len));
        }
    }

    /// The layers some append has written (the ones [`StepLedger::check_grow`] holds
    /// sessions to), in order.
    pub fn appended_layers(&self) -> Vec<usize> {
        (0..self.appended_at.len())
            .filter(|&l| self.appended_at[l] > 0)
            .collect()
    }

    /// Per layer, the rows of `session` its appends wrote (0s for a session this ledger was
    /// not told of).
    pub fn written_of(&self, session: SessionId) -> Vec<usize> {
        self.written
            .get(&session)
            .cloned()
            .unwrap_or_else(|| vec![0; self.appended_at.len()])
    }

    fn written_at(&self, session: SessionId, layer: usize) -> usize {
        self.written
            .get(&session)
            .and_then(|w| w.get(layer).copied())
            .unwrap_or(0)
    }

    /// Every row of `session`'s first `len` in `layer` was written by an append.
    ///
    /// # Errors
    /// Rows no append wrote (a step that failed after its reserve), naming the session, the
    /// layer, the rows and `what`.
    pub fn check_written(
        &self,
        session: SessionId,
        layer: usize,
        len: usize,
        what: &'static str,
    ) -> Result<()> {
        let w = self.written_at(session, layer);
        if w < len {
            return Err(unwritten(what, session, layer, w, len));
        }
        Ok(())
    }

    /// The sessions of a reserve, with their lengths before it, may grow: none holds rows no
    /// append wrote in a layer that appends have written. A reserve grows every session of
    /// its batch in every layer, and the batch's appends would then be refused for such a
    /// session's sake, leaving the others with unwritten rows too. Layers no append ever
    /// wrote are exempt (a caller that keeps some layers elsewhere, as the Python package
    /// does for Gemma 3's sliding-window layers).
    ///
    /// # Errors
    /// The first such session, naming it, the layer, the rows and `what`.
    pub fn check_grow(&self, sessions: &[(SessionId, usize)], what: &'static str) -> Result<()> {
        for &(session, len) in sessions {
            for layer in self.appended_layers() {
                self.check_written(session, layer, len, what)?;
            }
        }
        Ok(())
    }

    /// An append of `layer` for `batch` may launch: the batch is the current one, unchanged,
    /// and each session's rows before its new ones are written in `layer`.
    ///
    /// # Errors
    /// Another batch, or a session with rows no append wrote, naming `what`.
    pub fn check_append(
        &self,
        batch: &AppendBatch,
        layer: usize,
        what: &'static str,
    ) -> Result<()> {
        self.check_current(batch, what)?;
        self.check_prefixes(batch, &[layer], what)
    }

    /// Each session of `batch` has its rows before the new ones written in each of `layers`.
    fn check_prefixes(
        &self,
        batch: &AppendBatch,
        layers: &[usize],
        what: &'static str,
    ) -> Result<()> {
        for p in &batch.plans {
            for &l in layers {
                self.check_written(p.session, l, p.first_token, what)?;
            }
        }
        Ok(())
    }

    /// The rows `batch`'s append of `layer` wrote.
    fn mark_written(&mut self, batch: &AppendBatch, layer: usize) {
        let layers = self.appended_at.len();
        for p in &batch.plans {
            let w = self
                .written
                .entry(p.session)
                .or_insert_with(|| vec![0; layers]);
            if let Some(w) = w.get_mut(layer) {
                if *w >= p.first_token {
                    *w = (*w).max(p.first_token + p.tokens);
                }
            }
        }
    }

    /// The reserve returned `batch`.
    pub fn reserved(&mut self, batch: &AppendBatch) {
        self.current = Some(batch.clone());
    }

    /// `batch` is the last reserve's, unchanged.
    ///
    /// # Errors
    /// Any other batch, naming `what`.
    pub fn check_current(&self, batch: &AppendBatch, what: &'static str) -> Result<()> {
        if self.current.as_ref() != Some(batch) {
            return Err(CudaError::invalid(
                what,
                "the batch is not the one the cache's last reserve returned (its plans, rows or offsets were changed)",
            ));
        }
        Ok(())
    }

    /// `layer`'s append for `batch` was launched (or recorded, inside a capture).
    pub fn appended(&mut self, batch: &AppendBatch, layer: usize) {
        match &mut self.captured {
            Some(c) => c[layer] = true,
            None => {
                self.appended_at[layer] = batch.step;
                self.mark_written(batch, layer);
            }
        }
    }

    /// `batch` is the current one and `layer` was appended in its step (inside a capture:
    /// earlier in the capture). `layer` is in range (checked before, with the stale step).
    ///
    /// # Errors
    /// Another batch, or a layer not yet appended, naming `what`.
    pub fn check_read(&self, batch: &AppendBatch, layer: usize, what: &'static str) -> Result<()> {
        self.check_current(batch, what)?;
        let done = match &self.captured {
            Some(c) => c[layer],
            None => self.appended_at[layer] == batch.step,
        };
        if !done {
            return Err(CudaError::invalid(
                what,
                format!(
                    "layer {layer} has not been appended in this step: append the step's K/V rows of the layer first (its new tokens' slots hold nothing yet)"
                ),
            ));
        }
        for p in &batch.plans {
            // Inside a capture the step's own rows are the recorded append's; the rows before
            // them must be written already.
            let len = match &self.captured {
                Some(_) => p.first_token,
                None => p.first_token + p.tokens,
            };
            self.check_written(p.session, layer, len, what)?;
        }
        Ok(())
    }

    /// A capture begins: appends from here are recorded, not run.
    pub fn begin_capture(&mut self) {
        self.captured = Some(vec![false; self.appended_at.len()]);
    }

    /// The capture ends (successfully or not): the layers it appended, for its graph.
    pub fn end_capture(&mut self) -> Vec<bool> {
        self.captured
            .take()
            .unwrap_or_else(|| vec![false; self.appended_at.len()])
    }

    /// A graph whose step appends `layers` may be replayed for `batch`: the batch is the
    /// current one and, in every layer the graph appends, each session's rows before its new
    /// ones are written.
    ///
    /// # Errors
    /// As [`StepLedger::check_append`], naming `what`.
    pub fn check_replay(
        &self,
        batch: &AppendBatch,
        layers: &[bool],
        what: &'static str,
    ) -> Result<()> {
        self.check_current(batch, what)?;
        let appended: Vec<usize> = (0..layers.len()).filter(|&l| layers[l]).collect();
        self.check_prefixes(batch, &appended, what)
    }

    /// A graph whose step appends `layers` was replayed for `batch`.
    pub fn replayed(&mut self, batch: &AppendBatch, layers: &[bool]) {
        for (l, &done) in layers.iter().enumerate().take(self.appended_at.len()) {
            if done {
                self.appended_at[l] = batch.step;
                self.mark_written(batch, l);
            }
        }
    }
}

/// The error for rows `written..len` of `session`'s `layer` that no append wrote.
pub(super) fn unwritten(
    what: &'static str,
    session: SessionId,
    layer: usize,
    written: usize,
    len: usize,
) -> CudaError {
    CudaError::invalid(
        what,
        format!(
            "{session} has rows {written}..{len} of layer {layer} that no append wrote (a step failed between its reserve and its appends): its layer-{layer} slots hold nothing; truncate the session to its written rows, or free it"
        ),
    )
}

/// The layer exists and `batch` is the cache's current reserve.
pub(super) fn check_step(
    cfg: &CacheConfig,
    batch: &AppendBatch,
    current_step: u64,
    layer: usize,
) -> Result<()> {
    if layer >= cfg.shape.layers {
        return Err(CudaError::invalid(
            "layer",
            format!("{layer} (the cache has {} layers)", cfg.shape.layers),
        ));
    }
    if batch.step != current_step {
        return Err(CudaError::invalid(
            "append batch",
            format!(
                "batch of step {} is stale: the cache has reserved step {current_step} since",
                batch.step
            ),
        ));
    }
    Ok(())
}
