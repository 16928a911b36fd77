//! The `stage` record: one line of the stage log (`stages.jsonl`) that `cargo xtask repro`
//! writes, saying how each number of a report was made.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Document, ResultsError, VERSION};

/// One stage of a reproduction run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StageRecord {
    /// Schema version.
    pub version: u32,
    /// Stage name (`smollm2-135m-4k: fidelity`).
    pub stage: String,
    /// It ran and exited 0 (or was skipped on purpose).
    pub ok: bool,
    /// Wall seconds.
    pub seconds: f64,
    /// The command it ran.
    pub command: String,
    /// The error, when it failed.
    #[serde(default)]
    pub error: String,
    /// Why it did not run (`cached: …`, a missing input, the budget), empty when it ran.
    #[serde(default)]
    pub skipped: String,
}

impl StageRecord {
    /// A stage that ran and succeeded.
    pub fn ok(stage: &str, seconds: f64, command: &str) -> StageRecord {
        StageRecord {
            version: VERSION,
            stage: stage.into(),
            ok: true,
            seconds,
            command: command.into(),
            error: String::new(),
            skipped: String::new(),
        }
    }

    /// The status as the report prints it.
    pub fn status(&self) -> String {
        if self.skipped.starts_with("cached") {
            "ok (capture reused: same command)".into()
        } else if !self.skipped.is_empty() {
            format!("not run: {}", self.skipped)
        } else if self.ok {
            "ok".into()
        } else {
            format!("**FAILED**: {}", self.error)
        }
    }

    /// This record as one line of a stage log (compact JSON with its `kind`, no newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(&Document::Stage(self.clone())).unwrap_or_default()
    }
}

/// Reads a stage log: one [`StageRecord`] per non-empty line; a line that does not parse is an
/// error naming its line number.
pub fn read_stage_log(path: &Path) -> Result<Vec<StageRecord>, ResultsError> {
    let text = std::fs::read_to_string(path).map_err(|source| ResultsError::Io {
        path: path.into(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let what = format!("{}:{}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| ResultsError::Schema {
                what: what.clone(),
                message: e.to_string(),
            })?;
        match crate::from_value(&what, v)? {
            Document::Stage(s) => out.push(s),
            other => {
                return Err(ResultsError::Schema {
                    what,
                    message: format!("a `{}` document in a stage log", other.kind()),
                })
            }
        }
    }
    Ok(out)
}
