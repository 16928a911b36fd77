//! What the timing examples share: the SYNTHETIC generator and the cache configuration of `b`
//! sessions.

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
}

/// The timing examples' cache: `b` sessions of up to `max_tokens` tokens of `shape` in pages of
/// [`fathom_cuda::cache::DEFAULT_PAGE_TOKENS`] (host memory, k ≤ 512, no row cache).
pub fn timing_config(
    shape: fathom_cuda::ModelShape,
    b: usize,
    max_tokens: usize,
) -> fathom_cuda::cache::CacheConfig {
    let page = fathom_cuda::cache::DEFAULT_PAGE_TOKENS;
    fathom_cuda::cache::CacheConfig {
        shape,
        pages: fathom_cuda::pages::PageConfig {
            page_tokens: page,
            pages: b * max_tokens.div_ceil(page) + b,
            max_sessions: b,
            max_tokens,
        },
        max_batch: b,
        max_k: 512,
        row_cache: 0,
        residency: fathom_cuda::Residency::Host,
        pca_index: false,
        block_tables: false,
        host_pages: fathom_cuda::HostPages::Driver,
        options: Default::default(),
    }
}
