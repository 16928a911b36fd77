//! Real-text corpora from one pinned, immutable PyPI file, split into calibration and
//! held-out evaluation documents.
//!
//! Both corpora come from Django 5.1.4's source distribution ([`DJANGO_SDIST`], 10.7 MB, sha256
//! pinned), which PyPI serves unchanged on every OS and forever:
//!
//! * **prose**: `docs/**/*.txt`, Django's documentation: about 6 MB of English reStructuredText
//!   written by people over two decades (tutorials, topic guides, reference, release notes);
//! * **code**: `django/**/*.py`, Django's own Python source (about 5.5 MB).
//!
//! Why this source: the evaluation needs long, coherent, human-written English and real code
//! (contexts of 2k–32k tokens are assembled from whole documents), several MB of each so that
//! the held-out split alone fills a 32k context many times over, and content that a model has
//! to attend across (cross-references, API names repeated far apart). A documentation tree and
//! the code it documents give both from one file. The only tool it needs is Python's `pip`
//! ([`crate::pypi`]); the archive is read with Rust's `flate2` and `tar`, never a shell tool.
//!
//! [`fetch_corpus`] keeps every matching file of at least [`MIN_DOC_BYTES`] bytes as one
//! document, with its path inside the archive minus the top folder (`docs/intro/overview.txt`),
//! sorted by path; a text found under several paths is kept once, under the first. A document is in the **eval** split iff the first byte of `sha256(path)` is
//! `< 52` (≈ 20 %), otherwise in **calib**, so the splits are disjoint, and stable when files
//! are added. The result is written to `<cache>/corpus/<kind>/{calib,eval}.jsonl` (one
//! `{"path","sha256","text"}` per line) and a `manifest.json` with the source file, per-document
//! sha256 and split. [`documents_from_file`] reads a user's own text (plain or JSONL) instead.
//!
//! ```no_run
//! use fathom_model::corpus::{load_split, CorpusKind, CorpusOptions, Split};
//! let docs = load_split(CorpusKind::Prose, Split::Eval, &CorpusOptions::default())?;
//! println!("{} held-out prose documents, first {}", docs.len(), docs[0].path);
//! # Ok::<(), fathom_model::Error>(())
//! ```

use std::fs;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{io_err, Error, Result};
use crate::fetch::{default_cache_dir, sha256_bytes};
use crate::pypi::{fetch_pypi_file, PypiFile, DJANGO_SDIST};
use crate::tokenizer::Tokenizer;

/// Files smaller than this are not documents.
pub const MIN_DOC_BYTES: usize = 1024;

/// The manifest format this code writes; a cached corpus of another format is rebuilt.
pub const MANIFEST_FORMAT: u32 = 3;

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
    /// Both corpora.
    pub const ALL: [CorpusKind; 2] = [CorpusKind::Prose, CorpusKind::Code];

    /// `prose` or `code`.
    pub fn name(self) -> &'static str {
        match self {
            CorpusKind::Prose => "prose",
            CorpusKind::Code => "code",
        }
    }

    /// Where its documents come from.
    pub fn source(self) -> &'static CorpusSource {
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

/// The pinned file a corpus is read from, and which of its files are documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CorpusSource {
    /// The archive on PyPI.
    pub file: &'static PypiFile,
    /// The folder of the documents, below the archive's top folder.
    pub folder: &'static str,
    /// The suffix of a document's file name.
    pub suffix: &'static str,
    /// Folders below `folder` whose files are not documents (a theme's licence files).
    pub exclude: &'static [&'static str],
}

impl CorpusSource {
    /// Whether the file at `rel` (below the top folder) is a document of this corpus.
    pub fn selects(&self, rel: &str) -> bool {
        rel.starts_with(self.folder)
            && rel.ends_with(self.suffix)
            && !self.exclude.iter().any(|x| rel.starts_with(x))
    }

    /// `folder**/*suffix`, with the exclusions.
    pub fn describe(&self) -> String {
        let mut s = format!("{}**/*{}", self.folder, self.suffix);
        for x in self.exclude {
            s.push_str(&format!(" except {x}**"));
        }
        s
    }
}

/// Django's documentation (its Sphinx theme's files excluded).
pub static PROSE: CorpusSource = CorpusSource {
    file: &DJANGO_SDIST,
    folder: "docs/",
    suffix: ".txt",
    exclude: &["docs/_theme/"],
};

/// Django's own Python source.
pub static CODE: CorpusSource = CorpusSource {
    file: &DJANGO_SDIST,
    folder: "django/",
    suffix: ".py",
    exclude: &[],
};

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

/// One document.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Document {
    /// Path inside the source (or `FILE:LINE` for a user's JSONL).
    pub path: String,
    /// sha256 of the text (hex).
    pub sha256: String,
    /// The text (UTF-8; files that are not are skipped).
    pub text: String,
}

impl Document {
    /// A document with its sha256 computed.
    pub fn new(path: String, text: String) -> Self {
        Document {
            sha256: sha256_bytes(text.as_bytes()),
            path,
            text,
        }
    }
}

/// The pinned file a corpus was built from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    /// PyPI package.
    pub package: String,
    /// Its version.
    pub version: String,
    /// The file name on PyPI.
    pub file: String,
    /// sha256 of the file.
    pub sha256: String,
}

impl std::fmt::Display for SourceFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}=={} ({})", self.package, self.version, self.file)
    }
}

/// `manifest.json` of a built corpus.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT`].
    pub format: u32,
    /// Corpus kind.
    pub kind: CorpusKind,
    /// The PyPI file it was built from.
    pub source: SourceFile,
    /// The folder inside the archive and the suffix of the kept files.
    pub selection: String,
    /// Every document: path, sha256, bytes, split.
    pub documents: Vec<ManifestEntry>,
    /// sha256 over the `path sha256` lines of all documents, in order.
    pub corpus_sha256: String,
}

impl Manifest {
    /// Documents and bytes in one split.
    pub fn count(&self, split: Split) -> (usize, usize) {
        self.documents
            .iter()
            .filter(|d| d.split == split)
            .fold((0, 0), |(n, b), d| (n + 1, b + d.bytes))
    }
}

/// One line of the manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Path inside the archive, below its top folder.
    pub path: String,
    /// sha256 of the text.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: usize,
    /// Split.
    pub split: Split,
}

/// Options of [`fetch_corpus`].
#[derive(Clone, Debug)]
pub struct CorpusOptions {
    /// Cache root; `None` means [`default_cache_dir`].
    pub cache_dir: Option<PathBuf>,
    /// Never run pip; fail when the corpus is not built yet and its file is not cached.
    pub offline: bool,
    /// Python interpreter that runs pip.
    pub python: String,
}

impl Default for CorpusOptions {
    fn default() -> Self {
        CorpusOptions {
            cache_dir: None,
            offline: false,
            python: crate::fetch::default_python(),
        }
    }
}

impl CorpusOptions {
    /// The cache root.
    pub fn root(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(default_cache_dir)
    }

    /// Where pinned source files (sdists, wheels) are kept: `<cache>/sources`.
    pub fn sources_dir(&self) -> PathBuf {
        self.root().join("sources")
    }
}

fn corpus_dir(kind: CorpusKind, opts: &CorpusOptions) -> PathBuf {
    opts.root().join("corpus").join(kind.name())
}

/// Build the corpus if needed; returns its manifest.
///
/// Fetches [`CorpusKind::source`]'s file into [`CorpusOptions::sources_dir`] (or takes it from
/// there), checks its sha256, and reads the archive in Rust.
pub fn fetch_corpus(kind: CorpusKind, opts: &CorpusOptions) -> Result<Manifest> {
    let dir = corpus_dir(kind, opts);
    let mpath = dir.join("manifest.json");
    let source = kind.source();
    let src = source.file;
    if let Ok(s) = fs::read_to_string(&mpath) {
        if let Ok(m) = serde_json::from_str::<Manifest>(&s) {
            if m.format == MANIFEST_FORMAT
                && m.source.sha256 == src.sha256
                && m.selection == source.describe()
            {
                return Ok(m);
            }
        }
    }
    let archive = fetch_pypi_file(src, &opts.sources_dir(), &opts.python, opts.offline)?;
    let mut docs = read_tar_gz(&archive, |rel| source.selects(rel))?;
    docs.sort_by(|a, b| a.path.cmp(&b.path));
    // A text that appears under several paths is kept once, under its first path, so that no
    // eval text is also a calibration text.
    let mut seen = std::collections::HashSet::new();
    docs.retain(|d| seen.insert(d.sha256.clone()));
    if docs.is_empty() {
        return Err(Error::Invalid(format!(
            "{}: no {} file of at least {MIN_DOC_BYTES} bytes",
            archive.display(),
            source.describe()
        )));
    }
    fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
    for split in [Split::Calib, Split::Eval] {
        let p = dir.join(format!("{}.jsonl", split.name()));
        crate::fetch::write_atomic_with(&p, |tmp| {
            let mut w =
                std::io::BufWriter::new(fs::File::create(tmp).map_err(io_err("create", tmp))?);
            for d in docs.iter().filter(|d| split_of(&d.path) == split) {
                let line = serde_json::to_string(d).map_err(|e| Error::Invalid(e.to_string()))?;
                writeln!(w, "{line}").map_err(io_err("write", tmp))?;
            }
            w.flush().map_err(io_err("write", tmp))
        })?;
    }
    let listing: String = docs
        .iter()
        .map(|d| format!("{} {}\n", d.path, d.sha256))
        .collect();
    let manifest = Manifest {
        format: MANIFEST_FORMAT,
        kind,
        source: SourceFile {
            package: src.package.into(),
            version: src.version.into(),
            file: src.file_name.into(),
            sha256: src.sha256.into(),
        },
        selection: source.describe(),
        corpus_sha256: sha256_bytes(listing.as_bytes()),
        documents: docs
            .iter()
            .map(|d| ManifestEntry {
                path: d.path.clone(),
                sha256: d.sha256.clone(),
                bytes: d.text.len(),
                split: split_of(&d.path),
            })
            .collect(),
    };
    let js = serde_json::to_string_pretty(&manifest).map_err(|e| Error::Invalid(e.to_string()))?;
    crate::fetch::write_atomic(&mpath, js.as_bytes())?;
    Ok(manifest)
}

/// The UTF-8 files of a `.tar.gz` whose path below the archive's top folder `select`s, of at
/// least [`MIN_DOC_BYTES`] bytes, as documents named by that relative path, in archive order.
/// A truncated or corrupt archive is an error, not a shorter corpus.
pub fn read_tar_gz(archive: &Path, select: impl Fn(&str) -> bool) -> Result<Vec<Document>> {
    let bad = |e: std::io::Error| {
        Error::Invalid(format!(
            "{}: corrupt or truncated archive ({e}); delete it and fetch again",
            archive.display()
        ))
    };
    let f = fs::File::open(archive).map_err(io_err("open", archive))?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(BufReader::new(f)));
    let mut docs = Vec::new();
    for entry in tar.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let full = entry.path().map_err(bad)?.to_string_lossy().into_owned();
        // Below the top folder (`Django-5.1.4/`).
        let Some((_, rel)) = full.split_once('/') else {
            continue;
        };
        if !select(rel) {
            continue;
        }
        let mut bytes = Vec::with_capacity(entry.size() as usize);
        entry.read_to_end(&mut bytes).map_err(bad)?;
        if bytes.len() < MIN_DOC_BYTES {
            continue;
        }
        if let Ok(text) = String::from_utf8(bytes) {
            docs.push(Document::new(rel.to_string(), text));
        }
    }
    Ok(docs)
}

/// A user's own text as documents: JSONL (every non-empty line a JSON object with a string
/// field `text`; the file name ends in `.jsonl`) gives one document per line, named
/// `FILE:LINE`; any other file is one plain-text document. Empty input, a line that is not such
/// an object, or text that is not UTF-8 is an error that names the line.
pub fn documents_from_file(path: &Path) -> Result<Vec<Document>> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::Invalid(format!(
            "{}: not UTF-8 text (byte {})",
            path.display(),
            e.utf8_error().valid_up_to()
        ))
    })?;
    let name = path.display().to_string();
    let jsonl = path.extension().is_some_and(|e| e == "jsonl");
    let mut docs = Vec::new();
    if jsonl {
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(line)
                .map_err(|e| Error::Invalid(format!("{name}:{}: not JSON: {e}", i + 1)))?;
            let t = v.get("text").and_then(|t| t.as_str()).ok_or_else(|| {
                Error::Invalid(format!("{name}:{}: no string field \"text\"", i + 1))
            })?;
            if !t.trim().is_empty() {
                docs.push(Document::new(format!("{name}:{}", i + 1), t.to_string()));
            }
        }
    } else if !text.trim().is_empty() {
        docs.push(Document::new(name.clone(), text));
    }
    if docs.is_empty() {
        return Err(Error::Invalid(format!("{name}: no text")));
    }
    Ok(docs)
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

/// [`context_tokens`] for a user's own text, which is never repeated to fill the context: when
/// the documents from the first on give fewer than `n_tokens` tokens, the error says how many
/// they give.
pub fn text_tokens(
    docs: &[Document],
    tokenizer: &Tokenizer,
    n_tokens: usize,
) -> Result<(Vec<u32>, Vec<String>)> {
    let short = |have: usize| {
        Error::Invalid(format!(
            "the text gives {have} tokens, fewer than the {n_tokens} the context needs; give more text or a shorter context"
        ))
    };
    match context_tokens(docs, tokenizer, n_tokens, 0) {
        Ok((ids, used)) if used.len() <= docs.len() => Ok((ids, used)),
        _ => {
            let mut have = usize::from(tokenizer.add_bos());
            for d in docs {
                have += tokenizer.encode_raw(&format!("{}\n\n", d.text))?.len();
            }
            Err(short(have))
        }
    }
}
