//! The forward's building blocks: cuBLAS matmuls, norms, conversions and the uploads of a
//! step's tokens and positions.

#[allow(unused_imports)]
use super::*;

impl GpuDecoder {
    /// `y[rows][w.rows] = x[rows][w.cols] · wᵀ` with bf16 `x` and `w`, f32 `y` and sums.
    pub(super) fn linear(&self, w: &Weight, x: u64, rows: usize, y: u64) -> Result<()> {
        let (alpha, beta) = (1f32, 0f32);
        // SAFETY: w holds rows·cols bf16; x holds `rows` rows of w.cols bf16 and y `rows` rows
        // of w.rows f32 (the work buffers are sized for max_rows); alpha/beta are host f32.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                w.rows as i32,
                rows as i32,
                w.cols as i32,
                &alpha as *const f32 as *const c_void,
                w.mem.ptr as *const c_void,
                bsys::cudaDataType::CUDA_R_16BF,
                w.cols as i32,
                x as *const c_void,
                bsys::cudaDataType::CUDA_R_16BF,
                w.cols as i32,
                &beta as *const f32 as *const c_void,
                y as *mut c_void,
                bsys::cudaDataType::CUDA_R_32F,
                w.rows as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("gemm_ex"))
    }

    /// Column-major f32 GEMM `C = α op(A) op(B)` (the prefill attention's two products).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sgemm(
        &self,
        ta: bool,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: u64,
        lda: usize,
        b: u64,
        ldb: usize,
        c: u64,
        ldc: usize,
    ) -> Result<()> {
        let beta = 0f32;
        let op = |t: bool| {
            if t {
                bsys::cublasOperation_t::CUBLAS_OP_T
            } else {
                bsys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        // SAFETY: the callers pass work buffers and cache reads sized for these extents.
        unsafe {
            blas::sgemm(
                *self.blas.handle(),
                op(ta),
                op(false),
                m as i32,
                n as i32,
                k as i32,
                &alpha,
                a as *const f32,
                lda as i32,
                b as *const f32,
                ldb as i32,
                &beta,
                c as *mut f32,
                ldc as i32,
            )
        }
        .map_err(blas_err("sgemm"))
    }

    pub(super) fn rmsnorm(&self, x: u64, w: u64, rows: usize, out: u64) -> Result<()> {
        let e = self.cfg.n_embd as u32;
        let eps = self.cfg.rms_eps;
        let mut b = self.stream.launch_builder(&self.kernels.rmsnorm_bf16);
        b.arg(&x).arg(&w).arg(&e).arg(&eps).arg(&out);
        // SAFETY: x and out hold `rows` rows of E; w holds E.
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch rmsnorm_bf16"))?;
        Ok(())
    }

    pub(super) fn norm_add(&self, w: Option<&Mem>, rows: usize) -> Result<()> {
        let (x, a) = (self.work.x.ptr, self.work.a.ptr);
        let wp = w.map_or(0u64, |m| m.ptr);
        let e = self.cfg.n_embd as u32;
        let eps = self.cfg.rms_eps;
        let mut b = self.stream.launch_builder(&self.kernels.norm_add);
        b.arg(&x).arg(&a).arg(&wp).arg(&e).arg(&eps);
        // SAFETY: x and a hold `rows` rows of E; w (when not null) holds E.
        unsafe { b.launch(launch((rows as u32, 1, 1), THREADS, 0)) }
            .map_err(drv("launch norm_add"))?;
        Ok(())
    }

    pub(super) fn to_bf16(&self, x: u64, n: usize, out: u64) -> Result<()> {
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.kernels.to_bf16);
        b.arg(&x).arg(&out).arg(&n64);
        // SAFETY: x holds n f32 and out n bf16.
        unsafe {
            b.launch(launch(
                (n.div_ceil(THREADS as usize) as u32, 1, 1),
                THREADS,
                0,
            ))
        }
        .map_err(drv("launch to_bf16"))?;
        Ok(())
    }

    /// Uploads this forward's token ids and positions (pageable copies: staged by the driver
    /// before the call returns).
    pub(super) fn upload(&self, tokens: &[u32], pos: &[u32]) -> Result<()> {
        // SAFETY: both buffers hold max_rows u32 and the slices are no longer (checked by the
        // callers).
        unsafe {
            result::memcpy_htod_async(self.work.tokens.ptr, tokens, self.stream.cu_stream())
                .map_err(drv("memcpy_htod tokens"))?;
            result::memcpy_htod_async(self.work.pos.ptr, pos, self.stream.cu_stream())
                .map_err(drv("memcpy_htod positions"))?;
        }
        Ok(())
    }
}
