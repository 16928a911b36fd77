//! What the timing examples share: the SYNTHETIC generator and device uploads.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

/// Seeded uniform numbers in [-1, 1) (a 64-bit LCG's top 24 bits): the SYNTHETIC workload.
pub struct Uniform(u64);

impl Uniform {
    /// The generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Uniform(seed)
    }

    /// The next number.
    pub fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    /// `n` numbers.
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }

    /// `n` numbers in device memory.
    pub fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
    ) -> Result<CudaSlice<f32>, Box<dyn std::error::Error>> {
        Ok(stream.clone_htod(&self.vec(n))?)
    }
}
