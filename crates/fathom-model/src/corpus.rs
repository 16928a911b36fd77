//! Real-text corpora from pinned Debian packages, split into calibration and held-out
//! evaluation documents.
//!
//! * **prose**: the reStructuredText sources of the Python 3.11 documentation
//!   (`python3.11-doc`, `usr/share/doc/python3.11/html/_sources/**/*.rst.txt`);
//! * **code**: the CPython 3.11 standard library (`libpython3.11-stdlib`,
//!   `usr/lib/python3.11/**/*.py`).
//!
//! [`fetch_corpus`] runs `apt-get download <package>=<version>` (pinned versions and `.deb`
//! sha256s below; the first one available is used), extracts it with `dpkg-deb -x`, and keeps
//! every file of at least [`MIN_DOC_BYTES`] bytes as one document, sorted by path. A document
//! is in the **eval** split iff the first byte of `sha256(path)` is `< 52` (≈ 20 %), otherwise in
//! **calib**, so the splits are disjoint and stable when files are added. The result is written to
//! `<cache>/corpus/<kind>/{calib,eval}.jsonl` (one `{"path","sha256","text"}` per line) and a
//! `manifest.json` with the package, version, per-document sha256 and split.

use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::{Deserialize, Serialize};

use crate::error::{io_err, Error, Result};
use crate::fetch::{default_cache_dir, sha256_bytes, sha256_file};
use crate::tokenizer::Tokenizer;

/// Files smaller than this are not documents.
pub const MIN_DOC_BYTES: usize = 1024;

/// Which corpus.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CorpusKind {
    /// Human-written documentation prose (reStructuredText).
    Prose,
    /// Real source code (Python).
    Code,
}

impl CorpusKind {
    /// `prose` or `code`.
    pub fn name(self) -> &'static str {
        match self {
            CorpusKind::Prose => "prose",
            CorpusKind::Code => "code",
        }
    }
    fn source(self) -> &'static DebSource {
        match self {
            CorpusKind::Prose => &PROSE,
            CorpusKind::Code => &CODE,
        }
    }
}

impl std::str::FromStr for CorpusKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "prose" => Ok(CorpusKind::Prose),
            "code" => Ok(CorpusKind::Code),
            o => Err(Error::Invalid(format!(
                "unknown corpus {o:?} (prose, code)"
            ))),
        }
    }
}

/// Calibration or held-out evaluation documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    /// Calibration (≈ 80 %).
    Calib,
    /// Held-out evaluation (≈ 20 %).
    Eval,
}

impl Split {
    /// `calib` or `eval`.
    pub fn name(self) -> &'static str {
        match self {
            Split::Calib => "calib",
            Split::Eval => "eval",
        }
    }
}

impl std::str::FromStr for Split {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "calib" => Ok(Split::Calib),
            "eval" => Ok(Split::Eval),
            o => Err(Error::Invalid(format!("unknown split {o:?} (calib, eval)"))),
        }
    }
}

/// The split of a document, from its path: eval iff `sha256(path)[0] < 52`.
pub fn split_of(path: &str) -> Split {
    let h = sha256_bytes(path.as_bytes());
    let b0 = u8::from_str_radix(&h[..2], 16).unwrap_or(255);
    if b0 < 52 {
        Split::Eval
    } else {
        Split::Calib
    }
}

struct DebSource {
    package: &'static str,
    /// (version, sha256 of the .deb), tried in order.
    versions: &'static [(&'static str, &'static str)],
    root: &'static str,
    suffix: &'static str,
}

static PROSE: DebSource = DebSource {
    package: "python3.11-doc",
    versions: &[
        (
            "3.11.2-6+deb12u8",
            "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
        ),
        (
            "3.11.2-6+deb12u9",
            "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be",
        ),
    ],
    root: "usr/share/doc/python3.11/html/_sources/",
    suffix: ".rst.txt",
};

static CODE: DebSource = DebSource {
    package: "libpython3.11-stdlib",
    versions: &[
        (
            "3.11.2-6+deb12u8",
            "890b3540dad8a1ccc0deeca025db735bcc82629a76adacbe3b50fcc06ed528ca",
        ),
        (
            "3.11.2-6+deb12u9",
            "10f13e000ee757f5f2d2d3569f9e30546214a0c850acd78695feae373bfa3e53",
        ),
    ],
    root: "usr/lib/python3.11/",
    suffix: ".py",
};

/// One document.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Document {
    /// Path inside the package.
    pub path: String,
    /// sha256 of the text (hex).
    pub sha256: String,
    /// The text (UTF-8; files that are not are skipped).
    pub text: String,
}

/// `manifest.json` of a built corpus.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Corpus kind.
    pub kind: CorpusKind,
    /// Debian package.
    pub package: String,
    /// Its version.
    pub version: String,
    /// sha256 of the `.deb`.
    pub deb_sha256: String,
    /// Every document: path, sha256, bytes, split.
    pub documents: Vec<ManifestEntry>,
    /// sha256 over the `path sha256` lines of all documents, in order.
    pub corpus_sha256: String,
}

/// One line of the manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Path inside the package.
    pub path: String,
    /// sha256 of the text.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: usize,
    /// Split.
    pub split: Split,
}

/// Options of [`fetch_corpus`].
#[derive(Clone, Debug, Default)]
pub struct CorpusOptions {
    /// Cache root; `None` means [`default_cache_dir`].
    pub cache_dir: Option<PathBuf>,
    /// Never run apt-get; fail when the corpus is not built yet.
    pub offline: bool,
}

fn corpus_dir(kind: CorpusKind, opts: &CorpusOptions) -> PathBuf {
    opts.cache_dir
        .clone()
        .unwrap_or_else(default_cache_dir)
        .join("corpus")
        .join(kind.name())
}

/// Build the corpus if needed; returns its manifest.
pub fn fetch_corpus(kind: CorpusKind, opts: &CorpusOptions) -> Result<Manifest> {
    let dir = corpus_dir(kind, opts);
    let mpath = dir.join("manifest.json");
    if let Ok(s) = fs::read_to_string(&mpath) {
        if let Ok(m) = serde_json::from_str::<Manifest>(&s) {
            return Ok(m);
        }
    }
    let src = kind.source();
    let fail = |detail: String| Error::Download {
        package: src.package.into(),
        version: src
            .versions
            .iter()
            .map(|v| v.0)
            .collect::<Vec<_>>()
            .join(" or "),
        python: "apt-get download".into(),
        wheel_dir: dir.clone(),
        detail,
    };
    if opts.offline {
        return Err(fail("offline mode and the corpus is not built".into()));
    }
    let work = dir.join("work");
    let _ = fs::remove_dir_all(&work);
    fs::create_dir_all(&work).map_err(io_err("create", &work))?;
    let mut got = None;
    let mut errors = Vec::new();
    for (ver, sha) in src.versions {
        let out = Command::new("apt-get")
            .arg("download")
            .arg(format!("{}={}", src.package, ver))
            .current_dir(&work)
            .output()
            .map_err(|e| fail(format!("cannot run apt-get: {e}")))?;
        if !out.status.success() {
            errors.push(format!(
                "{ver}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
            continue;
        }
        let deb = fs::read_dir(&work)
            .map_err(io_err("read", &work))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .ok_or_else(|| fail("apt-get succeeded but no .deb appeared".into()))?;
        let (actual, size) = sha256_file(&deb)?;
        if actual != *sha {
            return Err(Error::Checksum {
                path: deb,
                expected: (*sha).into(),
                actual,
                expected_size: 0,
                actual_size: size,
                wheel_dir: work,
            });
        }
        got = Some((ver.to_string(), sha.to_string(), deb));
        break;
    }
    let Some((version, deb_sha256, deb)) = got else {
        return Err(fail(format!(
            "no pinned version is downloadable ({}); run `apt-get update` first, or update the pins in \
             fathom-model's corpus.rs",
            errors.join("; ")
        )));
    };
    let tree = work.join("tree");
    let st = Command::new("dpkg-deb")
        .arg("-x")
        .arg(&deb)
        .arg(&tree)
        .status()
        .map_err(|e| fail(format!("cannot run dpkg-deb: {e}")))?;
    if !st.success() {
        return Err(fail(format!("dpkg-deb -x failed: {st}")));
    }
    let mut files = Vec::new();
    collect_files(&tree.join(src.root), &mut files)?;
    files.sort();
    let mut docs: Vec<(Split, Document)> = Vec::new();
    for f in files {
        let rel = f
            .strip_prefix(&tree)
            .unwrap_or(&f)
            .to_string_lossy()
            .to_string();
        if !rel.ends_with(src.suffix) {
            continue;
        }
        let bytes = fs::read(&f).map_err(io_err("read", &f))?;
        if bytes.len() < MIN_DOC_BYTES {
            continue;
        }
        let Ok(text) = String::from_utf8(bytes) else {
            continue;
        };
        docs.push((
            split_of(&rel),
            Document {
                sha256: sha256_bytes(text.as_bytes()),
                path: rel,
                text,
            },
        ));
    }
    for split in [Split::Calib, Split::Eval] {
        let p = dir.join(format!("{}.jsonl", split.name()));
        crate::fetch::write_atomic_with(&p, |tmp| {
            let mut w =
                std::io::BufWriter::new(fs::File::create(tmp).map_err(io_err("create", tmp))?);
            for (_, d) in docs.iter().filter(|(s, _)| *s == split) {
                let line = serde_json::to_string(d).map_err(|e| Error::Invalid(e.to_string()))?;
                writeln!(w, "{line}").map_err(io_err("write", tmp))?;
            }
            w.flush().map_err(io_err("write", tmp))
        })?;
    }
    let listing: String = docs
        .iter()
        .map(|(_, d)| format!("{} {}\n", d.path, d.sha256))
        .collect();
    let manifest = Manifest {
        kind,
        package: src.package.into(),
        version,
        deb_sha256,
        corpus_sha256: sha256_bytes(listing.as_bytes()),
        documents: docs
            .iter()
            .map(|(s, d)| ManifestEntry {
                path: d.path.clone(),
                sha256: d.sha256.clone(),
                bytes: d.text.len(),
                split: *s,
            })
            .collect(),
    };
    let js = serde_json::to_string_pretty(&manifest).map_err(|e| Error::Invalid(e.to_string()))?;
    crate::fetch::write_atomic(&mpath, js.as_bytes())?;
    let _ = fs::remove_dir_all(&work);
    Ok(manifest)
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for e in fs::read_dir(dir).map_err(io_err("read", dir))? {
        let p = e.map_err(io_err("read", dir))?.path();
        if p.is_dir() {
            collect_files(&p, out)?;
        } else if p.is_file() {
            out.push(p);
        }
    }
    Ok(())
}

/// The documents of one split, in path order (builds the corpus first if needed).
pub fn load_split(kind: CorpusKind, split: Split, opts: &CorpusOptions) -> Result<Vec<Document>> {
    fetch_corpus(kind, opts)?;
    let p = corpus_dir(kind, opts).join(format!("{}.jsonl", split.name()));
    let f = fs::File::open(&p).map_err(io_err("open", &p))?;
    let mut docs = Vec::new();
    for line in BufReader::new(f).lines() {
        let line = line.map_err(io_err("read", &p))?;
        let d: Document = serde_json::from_str(&line)
            .map_err(|e| Error::Invalid(format!("{}: {e}", p.display())))?;
        if sha256_bytes(d.text.as_bytes()) != d.sha256 {
            return Err(Error::Invalid(format!(
                "{}: document {} fails its sha256; delete the corpus dir",
                p.display(),
                d.path
            )));
        }
        docs.push(d);
    }
    Ok(docs)
}

/// Exactly `n_tokens` tokens of real text: documents from index `start` on (wrapping), each
/// tokenized on its own and joined (BOS, if the model uses one, only at the start). Returns the
/// ids and the paths of the documents used.
pub fn context_tokens(
    docs: &[Document],
    tokenizer: &Tokenizer,
    n_tokens: usize,
    start: usize,
) -> Result<(Vec<u32>, Vec<String>)> {
    if docs.is_empty() {
        return Err(Error::Invalid("no documents".into()));
    }
    let mut ids = Vec::with_capacity(n_tokens + 1024);
    if tokenizer.add_bos() {
        ids.extend(tokenizer.bos());
    }
    let mut used = Vec::new();
    let mut i = start % docs.len();
    let mut rounds = 0;
    while ids.len() < n_tokens {
        let d = &docs[i];
        ids.extend(tokenizer.encode_raw(&format!("{}\n\n", d.text))?);
        used.push(d.path.clone());
        i = (i + 1) % docs.len();
        if i == start % docs.len() {
            rounds += 1;
            if rounds > 1 {
                return Err(Error::Invalid(format!(
                    "split too small for {n_tokens} tokens"
                )));
            }
        }
    }
    ids.truncate(n_tokens);
    Ok((ids, used))
}
