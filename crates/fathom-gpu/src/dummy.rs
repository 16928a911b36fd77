//! The stub of a build without the `cuda` feature: the same types, every entry point
//! returns [`fathom_cuda::CudaError::NotCompiledWithCuda`].

use fathom_cuda::pages::SessionId;
use fathom_cuda::{CudaError, Gpu};
use fathom_model::DenseWeights;

use crate::decoder::{Attention, Decoder};
use crate::error::Result;
use crate::layout::DecoderConfig;

/// A model's weights on a device and its sessions in the offloaded cache (stub).
#[derive(Debug)]
pub struct GpuDecoder {
    _never: std::convert::Infallible,
}

impl GpuDecoder {
    /// Uploads the weights and makes the cache.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn new(_gpu: &Gpu, _weights: &DenseWeights, _cfg: DecoderConfig) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// A decoder with random weights.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn random(
        _gpu: &Gpu,
        _cfg: fathom_model::Config,
        _seed: u64,
        _dcfg: DecoderConfig,
    ) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// Appends synthetic K/V rows.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn fill_synthetic(
        &mut self,
        _session: SessionId,
        _tokens: usize,
        _seed: u64,
    ) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// One decode step sampled greedily on the device.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn decode_greedy(
        &mut self,
        _batch: &[(SessionId, u32)],
        _attention: &Attention,
    ) -> Result<Vec<u32>> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// A greedy decode step captured as a CUDA graph.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn capture_greedy(
        &mut self,
        _batch: &[(SessionId, u32)],
        _attention: &Attention,
    ) -> Result<(Vec<u32>, StepGraph)> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// A replay of a captured step.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn replay_greedy(
        &mut self,
        _graph: &StepGraph,
        _batch: &[(SessionId, u32)],
    ) -> Result<Vec<u32>> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// Turns per-stage timing on or off (nothing to time in this build).
    pub fn set_instrument(&mut self, _on: bool) {}

    /// The stage times of the instrumented steps.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn take_stage_times(&mut self) -> Result<crate::StageTimes> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// Bytes of device memory in use.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn device_bytes_in_use(&self) -> Result<u64> {
        Err(CudaError::NotCompiledWithCuda.into())
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &fathom_model::Config {
        match self._never {}
    }

    /// The decoder's limits.
    pub fn decoder_config(&self) -> &DecoderConfig {
        match self._never {}
    }

    /// The cache (for calibrations and counters).
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn cache_mut(&mut self) -> Result<&mut fathom_cuda::PagedCache> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
}

impl Decoder for GpuDecoder {
    fn create(&mut self) -> Result<SessionId> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
    fn fork(&mut self, _parent: SessionId) -> Result<SessionId> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
    fn free(&mut self, _session: SessionId) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
    fn len(&self, _session: SessionId) -> Result<usize> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
    fn truncate(&mut self, _session: SessionId, _len: usize) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
    fn prefill(&mut self, _session: SessionId, _tokens: &[u32]) -> Result<Vec<f32>> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
    fn decode(&mut self, _batch: &[(SessionId, u32)], _attention: &Attention) -> Result<Vec<f32>> {
        Err(CudaError::NotCompiledWithCuda.into())
    }
}

/// A captured decode step (never made in this build).
#[derive(Debug)]
pub struct StepGraph {
    _never: (),
}
