//! NVRTC: every kernel source compiled at run time for the device's architecture, and the
//! table of the device's own kernels (the zero-copy gather of the link probes).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::CudaFunction;
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};

use crate::error::{CudaError, Result};

const COMMON: &str = include_str!("../../kernels/common.cuh");
/// The sources compiled at `-DGQ=<G> -DDIM=<D>` besides the paged cache's own (`append.cu`,
/// `kernels/attend/`): the plan kernels the cache loads, and the gather of the link probes.
pub(crate) const KERNELS: [(&str, &str); 2] = [
    ("plan.cu", include_str!("../../kernels/plan.cu")),
    ("gather.cu", include_str!("../../kernels/gather.cu")),
];

/// The device's own kernels: the zero-copy gather that the link probes time.
pub(crate) struct Kernels {
    pub(crate) gather_runs: CudaFunction,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Kernels { .. }")
    }
}

/// Compiles one `.cu` source (with `common.cuh` inlined) for `arch` with `defines`.
pub(crate) fn compile_one(
    arch: &'static str,
    name: &'static str,
    src: &str,
    defines: Vec<String>,
) -> Result<cudarc::nvrtc::Ptx> {
    let src = src.replace("#include \"common.cuh\"", COMMON);
    // One compile per (arch, source, options) in a process: every cache of one shape loads the
    // same PTX, and NVRTC takes seconds per source.
    let key = (arch, src.clone(), defines.clone());
    static MEMO: OnceLock<Mutex<HashMap<PtxKey, String>>> = OnceLock::new();
    let memo = MEMO.get_or_init(Default::default);
    if let Some(ptx) = memo.lock().ok().and_then(|m| m.get(&key).cloned()) {
        return Ok(cudarc::nvrtc::Ptx::from_src(ptx));
    }
    let opts = CompileOptions {
        arch: Some(arch),
        options: defines,
        name: Some(name.to_string()),
        ..Default::default()
    };
    let ptx = std::panic::catch_unwind(|| compile_ptx_with_opts(&src, opts))
        .map_err(|_| CudaError::NoDevice {
            message: "NVRTC library (libnvrtc) not found".into(),
        })?
        .map_err(|e| CudaError::Compile {
            kernel: name,
            log: format!("{e:?}"),
        })?;
    if let Ok(mut m) = memo.lock() {
        m.insert(key, ptx.to_src());
    }
    Ok(ptx)
}

/// The compile options of `kernels/attend/` (the paged cache's kernels) at `G` query heads per KV
/// head and head dim `D`: the one list that every compile of it uses, so that
/// [`crate::PagedCache`] and [`compile_kernels`] build the same kernels.
pub(crate) fn attend_defines(g: usize, d: usize) -> Vec<String> {
    vec![
        format!("-DGQ={g}"),
        format!("-DDIM={d}"),
        format!("-DTS_G={}", crate::cache::table_scan_groups(d, g)),
    ]
}

/// Architecture, source with `common.cuh` inlined, and compile options.
type PtxKey = (&'static str, String, Vec<String>);

pub(crate) fn compile_all(
    arch: &'static str,
    g: usize,
    d: usize,
) -> Result<Vec<(&'static str, cudarc::nvrtc::Ptx)>> {
    let mut out = Vec::new();
    for (name, src) in KERNELS {
        let o = vec![format!("-DGQ={g}"), format!("-DDIM={d}")];
        out.push((name, compile_one(arch, name, src, o)?));
    }
    let append = compile_one(
        arch,
        "append.cu",
        crate::cuda::cache::APPEND_SRC,
        vec![format!("-DDIM={d}")],
    )?;
    out.push(("append.cu", append));
    if g <= 8 {
        out.push((
            "attend.cu",
            compile_one(
                arch,
                "attend.cu",
                crate::cuda::cache::ATTEND_SRC,
                attend_defines(g, d),
            )?,
        ));
    }
    Ok(out)
}

/// Compiles every kernel with NVRTC for `arch` (e.g. `sm_90`) at `G`, `D`, without a device:
/// a check that needs only the NVRTC library.
///
/// # Errors
/// [`CudaError::Compile`] with the compiler log; [`CudaError::NoDevice`] without libnvrtc.
pub fn compile_kernels(arch: &'static str, g: usize, d: usize) -> Result<usize> {
    let all = compile_all(arch, g, d)?;
    if let Some(dir) = std::env::var_os("FATHOM_PTX_DIR") {
        for (name, ptx) in &all {
            let path = std::path::Path::new(&dir).join(format!("{name}.G{g}.D{d}.ptx"));
            let _ = std::fs::write(path, ptx.to_src());
        }
    }
    Ok(all.len())
}
