//! Typed, versioned result documents: what every Fathom run writes and what the report reads.
//!
//! One struct per kind, each serialised with a `kind` tag and a schema `version`
//! ([`VERSION`]) by the one writer, [`write()`], and parsed by the one reader, [`read()`]:
//!
//! | kind | struct | written by |
//! |---|---|---|
//! | `fidelity` | [`fidelity::FidelityDoc`] | `fathom fidelity`, `fathom demo` |
//! | `calibration-summary` | [`calibration::CalibrationSummary`] | `fathom calibrate` |
//! | `offload-bench` | [`offload::OffloadBench`] | `fathom offload-bench` |
//! | `ruler` | [`downstream::RulerDoc`] | `fathom ruler` |
//! | `agent-steps` | [`downstream::AgentDoc`] | `fathom agent-steps` |
//! | `model-speed` | [`speed::ModelSpeed`] | `fathom speed` |
//! | `stage` | [`stages::StageRecord`] (one per line of `stages.jsonl`) | `cargo xtask repro` |
//!
//! ```
//! use fathom_results::{parse, speed::{ModelSpeed, SpeedRun}, Document, VERSION};
//! let doc = Document::ModelSpeed(ModelSpeed {
//!     version: VERSION,
//!     fathom: "0.1.0".into(),
//!     command: "fathom speed --model smollm2-135m".into(),
//!     model: "smollm2-135m".into(),
//!     cpu: "x86-64".into(),
//!     cores: 2,
//!     llama_threads: 2,
//!     text: "prose eval split".into(),
//!     runs: vec![],
//! });
//! let json = serde_json::to_string(&doc).unwrap();
//! assert!(json.starts_with(r#"{"kind":"model-speed","version":2"#));
//! assert_eq!(parse(json.as_bytes())?, doc);
//! # Ok::<(), fathom_results::ResultsError>(())
//! ```
//!
//! **Versions.** Version 1 is every file written before documents carried a `kind` (their
//! `version` was the crate's version string, or absent). [`legacy_kind`] recognises them by
//! their fields, once, here; they parse into the same structs, with the fields added since
//! at their defaults. A document of a newer version than this crate's is an error, never a
//! silent misreading.

#![deny(missing_docs)]

pub mod bench_hf;
pub mod calibration;
pub mod decode_bench;
pub mod downstream;
pub mod fidelity;
pub mod judged;
pub mod offload;
pub mod parity;
pub mod speed;
pub mod stages;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The schema version this crate writes (and the newest it reads).
pub const VERSION: u32 = 2;

/// The version of files written before documents carried a `kind`.
pub const LEGACY_VERSION: u32 = 1;

/// What went wrong reading or writing a result document.
#[derive(Debug, thiserror::Error)]
pub enum ResultsError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Not JSON, or JSON that does not fit the schema of its kind.
    #[error("{what}: {message}")]
    Schema {
        /// The file (or `<bytes>`).
        what: String,
        /// What does not fit.
        message: String,
    },
    /// A JSON object that is not a Fathom result document.
    #[error("{what}: not a Fathom result document ({why})")]
    NotAResult {
        /// The file (or `<bytes>`).
        what: String,
        /// Why.
        why: String,
    },
    /// An input of a run (a calibration file), not a result document: readers skip it.
    #[error("{what}: a calibration file (an input of `fathom fidelity --calib`; its `-summary.json` is the result)")]
    Input {
        /// The file (or `<bytes>`).
        what: String,
    },
    /// Written by a newer schema than this crate reads.
    #[error("{what}: schema version {version} is newer than this build reads ({VERSION}); update fathom")]
    TooNew {
        /// The file (or `<bytes>`).
        what: String,
        /// Its version.
        version: u64,
    },
}

/// A result document of any kind (serialised with its `kind` tag).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
#[allow(clippy::large_enum_variant)]
pub enum Document {
    /// `fathom fidelity` / `fathom demo`.
    Fidelity(fidelity::FidelityDoc),
    /// `fathom calibrate`'s summary.
    CalibrationSummary(calibration::CalibrationSummary),
    /// `fathom offload-bench`.
    OffloadBench(offload::OffloadBench),
    /// `fathom ruler`.
    Ruler(downstream::RulerDoc),
    /// `fathom agent-steps`.
    AgentSteps(downstream::AgentDoc),
    /// `fathom speed`.
    ModelSpeed(speed::ModelSpeed),
    /// One stage of `cargo xtask repro`.
    Stage(stages::StageRecord),
    /// `fathom gpu-parity`.
    GpuParity(parity::GpuParity),
    /// `fathom decode-bench`.
    DecodeBench(decode_bench::DecodeBench),
    /// `python -m fathom.bench_hf` (the wheel's).
    BenchHf(bench_hf::BenchHf),
}

impl Document {
    /// The kind tag (`fidelity`, `offload-bench`, …).
    pub fn kind(&self) -> &'static str {
        match self {
            Document::Fidelity(_) => "fidelity",
            Document::CalibrationSummary(_) => "calibration-summary",
            Document::OffloadBench(_) => "offload-bench",
            Document::Ruler(_) => "ruler",
            Document::AgentSteps(_) => "agent-steps",
            Document::ModelSpeed(_) => "model-speed",
            Document::Stage(_) => "stage",
            Document::GpuParity(_) => "gpu-parity",
            Document::DecodeBench(_) => "decode-bench",
            Document::BenchHf(_) => "bench-hf",
        }
    }
}

macro_rules! into_document {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl From<$t> for Document {
            fn from(x: $t) -> Document {
                Document::$v(x)
            }
        }
    )*};
}
into_document!(
    fidelity::FidelityDoc => Fidelity,
    calibration::CalibrationSummary => CalibrationSummary,
    offload::OffloadBench => OffloadBench,
    downstream::RulerDoc => Ruler,
    downstream::AgentDoc => AgentSteps,
    speed::ModelSpeed => ModelSpeed,
    stages::StageRecord => Stage,
    parity::GpuParity => GpuParity,
    decode_bench::DecodeBench => DecodeBench,
    bench_hf::BenchHf => BenchHf,
);

/// The kind of a document written before documents carried one (schema version 1), from the
/// fields only that kind has; `None` for JSON that is no Fathom result (a calibration file,
/// an ad hoc comparison table). This is the only place such sniffing happens.
pub fn legacy_kind(v: &Value) -> Option<&'static str> {
    let has = |k: &str| v.get(k).is_some();
    if has("methods") && has("equal_error") {
        Some("fidelity")
    } else if v.get("format").and_then(Value::as_str) == Some(calibration::LEGACY_SUMMARY_FORMAT) {
        Some("calibration-summary")
    } else if has("results") && has("h2d_gbps") {
        Some("offload-bench")
    } else if v.get("task").and_then(Value::as_str) == Some("ruler") {
        Some("ruler")
    } else if v.get("task").and_then(Value::as_str) == Some("agent-steps") {
        Some("agent-steps")
    } else if v.get("task").and_then(Value::as_str) == Some("model-speed") {
        Some("model-speed")
    } else if has("stage") && has("ok") && has("command") {
        Some("stage")
    } else {
        None
    }
}

/// Brings a version-1 document to the current field names: the kind tag from
/// [`legacy_kind`], the crate version string moved from `version` to `fathom`, and
/// `version` set to [`LEGACY_VERSION`].
fn upgrade_legacy(what: &str, mut v: Value) -> Result<Value, ResultsError> {
    let Some(kind) = legacy_kind(&v) else {
        if v.get("format").and_then(Value::as_str) == Some("fathom-calibration") {
            return Err(ResultsError::Input { what: what.into() });
        }
        let why = match v.get("kind").and_then(Value::as_str) {
            Some(k) => format!("`kind` {k:?} is none this crate reads, and no earlier schema fits"),
            None => "no `kind` field, and not a document of an earlier schema either".into(),
        };
        return Err(ResultsError::NotAResult {
            what: what.into(),
            why,
        });
    };
    let obj = v.as_object_mut().ok_or_else(|| ResultsError::NotAResult {
        what: what.into(),
        why: "not a JSON object".into(),
    })?;
    if let Some(Value::String(s)) = obj.remove("version") {
        obj.insert("fathom".into(), Value::String(s));
    }
    obj.insert("version".into(), LEGACY_VERSION.into());
    obj.insert("kind".into(), kind.into());
    match kind {
        "fidelity" => fidelity::upgrade_legacy(what, obj),
        "offload-bench" => offload::upgrade_legacy(what, obj),
        "calibration-summary" => {
            obj.remove("format");
        }
        _ => {}
    }
    Ok(v)
}

/// Parses a document from JSON `v` (`what` names it in errors).
pub fn from_value(what: &str, v: Value) -> Result<Document, ResultsError> {
    if !v.is_object() {
        return Err(ResultsError::NotAResult {
            what: what.into(),
            why: "not a JSON object".into(),
        });
    }
    let v = if v.get("kind").and_then(Value::as_str).is_some_and(|k| {
        // `kind` also names a corpus in older `fetch-corpus` output; only a known tag counts.
        KINDS.contains(&k)
    }) {
        v
    } else {
        upgrade_legacy(what, v)?
    };
    match v.get("version").and_then(Value::as_u64) {
        Some(x) if x > u64::from(VERSION) => {
            return Err(ResultsError::TooNew {
                what: what.into(),
                version: x,
            })
        }
        Some(_) => {}
        None => {
            return Err(ResultsError::Schema {
                what: what.into(),
                message: "`version` is missing or not an integer".into(),
            })
        }
    }
    serde_json::from_value(v).map_err(|e| ResultsError::Schema {
        what: what.into(),
        message: e.to_string(),
    })
}

/// Every kind tag, in the order of [`Document`].
pub const KINDS: [&str; 10] = [
    "fidelity",
    "calibration-summary",
    "offload-bench",
    "ruler",
    "agent-steps",
    "model-speed",
    "stage",
    "gpu-parity",
    "decode-bench",
    "bench-hf",
];

/// Parses a document from JSON bytes.
pub fn parse(bytes: &[u8]) -> Result<Document, ResultsError> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| ResultsError::Schema {
        what: "<bytes>".into(),
        message: e.to_string(),
    })?;
    from_value("<bytes>", v)
}

/// Reads the document at `path`.
pub fn read(path: &Path) -> Result<Document, ResultsError> {
    let what = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|source| ResultsError::Io {
        path: path.into(),
        source,
    })?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| ResultsError::Schema {
        what: what.clone(),
        message: format!("not JSON: {e}"),
    })?;
    from_value(&what, v)
}

/// Writes `doc` to `path` atomically (pretty JSON with its `kind` and `version`).
pub fn write(path: &Path, doc: impl Into<Document>) -> Result<(), ResultsError> {
    let doc = doc.into();
    let bytes = serde_json::to_vec_pretty(&doc).map_err(|e| ResultsError::Schema {
        what: path.display().to_string(),
        message: e.to_string(),
    })?;
    fathom_store::write_atomic(path, &bytes).map_err(|e| ResultsError::Io {
        path: path.into(),
        source: std::io::Error::other(e.to_string()),
    })
}

/// The command line of this process, as documents record it.
pub fn command_line() -> String {
    std::env::args().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newer_version_is_refused() {
        let j =
            r#"{"kind":"stage","version":99,"stage":"x","ok":true,"seconds":1.0,"command":"c"}"#;
        assert!(matches!(
            parse(j.as_bytes()),
            Err(ResultsError::TooNew { version: 99, .. })
        ));
    }

    #[test]
    fn json_that_is_no_result_is_named_so() {
        let j = r#"{"format":"fathom-calibration","version":1,"heads":[]}"#;
        assert!(matches!(
            parse(j.as_bytes()),
            Err(ResultsError::Input { .. })
        ));
        let j = r#"{"rows":[]}"#;
        assert!(matches!(
            parse(j.as_bytes()),
            Err(ResultsError::NotAResult { .. })
        ));
        assert!(matches!(
            parse(b"[1,2]"),
            Err(ResultsError::NotAResult { .. })
        ));
    }

    #[test]
    fn a_known_kind_with_a_wrong_field_names_the_field() {
        let j =
            r#"{"kind":"stage","version":2,"stage":"x","ok":"yes","seconds":1.0,"command":"c"}"#;
        let e = parse(j.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("invalid type"), "{e}");
    }

    #[test]
    fn every_kind_tag_is_listed() {
        let stage = Document::Stage(stages::StageRecord::ok("s", 1.0, "c"));
        let v = serde_json::to_value(&stage).unwrap();
        assert_eq!(v["kind"], stage.kind());
        assert!(KINDS.contains(&stage.kind()));
    }
}
