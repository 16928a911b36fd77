//! The backend without the `cuda` feature: the same types, every entry point returns
//! [`CudaError::NotCompiledWithCuda`].

use crate::config::{Method, SessionConfig};
use crate::error::{CudaError, Result};
use crate::synth::LayerSource;
use crate::types::{DeviceInfo, LayerDebug, SessionLayout, StepStats};

/// A CUDA device (stub: cannot be opened without the `cuda` feature).
#[derive(Debug)]
pub struct Gpu {
    info: DeviceInfo,
}

impl Gpu {
    /// Opens device `ordinal`.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn open(_ordinal: usize) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// The device description.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    /// Host-to-device bandwidth of one pinned `memcpy` of `bytes`, GB/s.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn h2d_bandwidth(&self, _bytes: usize) -> Result<f64> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Bandwidth of the zero-copy gather kernel over one run of `bytes`, GB/s.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn gather_bandwidth(&self, _bytes: usize) -> Result<f64> {
        Err(CudaError::NotCompiledWithCuda)
    }
}

/// A decode session on the device (stub).
#[derive(Debug)]
pub struct Session {
    layout: SessionLayout,
}

impl Session {
    /// Allocates and fills the session.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn new(
        _gpu: &Gpu,
        _cfg: &SessionConfig,
        _sources: &[LayerSource],
        _methods: &[Method],
    ) -> Result<Self> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Where the data lives.
    pub fn layout(&self) -> &SessionLayout {
        &self.layout
    }
    /// Empties the HBM row cache.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn reset_cache(&mut self) -> Result<()> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Changes the pipelining of later steps (see the CUDA build's `Session::set_pipeline`).
    pub fn set_pipeline(&mut self, _groups: usize, _gather_ctas: usize) {}
    /// Runs one decode step over all layers.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn run_step(
        &mut self,
        _method: Method,
        _step: usize,
        _instrument: bool,
    ) -> Result<StepStats> {
        Err(CudaError::NotCompiledWithCuda)
    }
    /// Runs one layer's step and reads back every intermediate.
    ///
    /// # Errors
    /// Always [`CudaError::NotCompiledWithCuda`] in this build.
    pub fn layer_debug(
        &mut self,
        _method: Method,
        _layer: usize,
        _step: usize,
    ) -> Result<LayerDebug> {
        Err(CudaError::NotCompiledWithCuda)
    }
}
