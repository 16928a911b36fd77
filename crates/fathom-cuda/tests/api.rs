//! Both backends expose one API: this file is compiled against the stub (`cargo test`) and
//! against the CUDA backend (`cargo check --features cuda --all-targets`, which CI runs), and
//! the generic code below uses only the traits of `fathom_cuda::api`.

use fathom_cuda::api::{Device, KvCache};
use fathom_cuda::cache::CacheConfig;
use fathom_cuda::pages::PageConfig;
use fathom_cuda::{CudaError, Gpu, HostPages, ModelShape, PagedCache, Residency};

/// A small cache and one empty session, written against the traits alone.
fn one_session<C: KvCache>(gpu: &C::Device) -> Result<usize, CudaError> {
    let cfg = CacheConfig {
        shape: ModelShape::parse("1,1,4,64")?,
        pages: PageConfig {
            page_tokens: 1024,
            pages: 4,
            max_sessions: 2,
            max_tokens: 4096,
        },
        max_batch: 2,
        max_k: 64,
        row_cache: 256,
        residency: Residency::Host,
        pca_index: false,
        block_tables: false,
        host_pages: HostPages::Driver,
        options: Default::default(),
    };
    let mut cache = C::new(gpu, cfg)?;
    let s = cache.create()?;
    cache.len(s)
}

#[test]
fn both_backends_implement_the_api() {
    // Opening through the trait and through the type agree.
    match (<Gpu as Device>::open(0), Gpu::open(0)) {
        (Ok(gpu), Ok(_)) => {
            let n = one_session::<PagedCache>(&gpu).expect("one session through the trait API");
            assert_eq!(n, 0);
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string());
            assert!(
                matches!(
                    a,
                    CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. }
                ),
                "{a}"
            );
            eprintln!("no GPU path ({a}); the API itself is checked at compile time");
        }
        (a, b) => panic!("the trait and the type disagree: {a:?} vs {b:?}"),
    }
}

#[test]
fn missing_gpu_path_is_a_typed_error() {
    match Gpu::open(0) {
        Ok(g) => eprintln!("device present: {:?}", g.info()),
        Err(CudaError::NotCompiledWithCuda) => {
            let built_with_cuda = cfg!(feature = "cuda");
            assert!(!built_with_cuda, "NotCompiledWithCuda from a cuda build");
        }
        Err(CudaError::NoDevice { message }) => {
            let built_with_cuda = cfg!(feature = "cuda");
            assert!(built_with_cuda, "NoDevice from a build without cuda");
            assert!(!message.is_empty());
        }
        Err(e) => panic!("unexpected {e}"),
    }
}
