//! Agent-session contexts: real source files framed as a coding agent's transcript (docs/SPEC.md §7).
//!
//! A session is a system prompt, a user request naming the files, then one
//! `read_file` tool call and its result (the file's full text) per file, in turn, until the
//! target length. The last file is cut at a line boundary inside it; the prompt is everything
//! up to the cut (at most `context − steps` tokens) and the **continuation** is the next
//! `steps` tokens of that real file, which the evaluation teacher-forces.
//!
//! Files come from the project's code corpus (Django 5.1.4's own Python source, held-out split),
//! in corpus order from a seeded starting document; each piece is tokenized on its own and
//! the pieces are joined (BOS only at the start), as `fathom_model::corpus::context_tokens`
//! does.

use fathom_model::corpus::Document;
use fathom_model::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::EvalError;

mod orchestrate;
pub use orchestrate::{run, AgentPlan, AgentRun, MethodAgreement, SessionRun, StepAgreement};

/// One session.
#[derive(Debug, Clone, Serialize)]
pub struct Session {
    /// Session index.
    pub index: usize,
    /// Its seed.
    pub seed: u64,
    /// Files read, in order (the last is the one being continued).
    pub files: Vec<String>,
    /// The prompt's tokens.
    #[serde(skip)]
    pub prompt_ids: Vec<u32>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// The true continuation (teacher-forced).
    #[serde(skip)]
    pub continuation: Vec<u32>,
    /// Its text.
    pub continuation_text: String,
}

const SYSTEM: &str = "System: You are a coding agent working in a checkout of the Django web framework. You can call the tool read_file(path), which returns the file's contents as a tool message. Read the files the user asks about before you answer.\n\n";

fn call(path: &str) -> String {
    format!(
        "Assistant: <tool_call>{{\"name\": \"read_file\", \"arguments\": {{\"path\": \"{path}\"}}}}</tool_call>\n\nTool (read_file {path}):\n"
    )
}

/// (path, call ids, text ids) of one file of a session.
type FileIds = (String, Vec<u32>, Vec<u32>);

/// Files from `start` on (wrapping): whole ones while they fit beside a header of
/// `header_est` tokens, then one long enough to hold the cut and `steps` after it.
fn pick_files(
    docs: &[Document],
    tok: &Tokenizer,
    start: usize,
    budget: usize,
    steps: usize,
    header_est: usize,
) -> Result<Vec<FileIds>, EvalError> {
    let mut files = Vec::new();
    let mut used = vec![false; docs.len()];
    let mut total = header_est;
    let mut i = start;
    let mut tried = 0;
    loop {
        // Two passes: a file too short to end the session when the room was large is
        // considered again once smaller files have filled the room.
        if tried >= 2 * docs.len() {
            return Err(EvalError::Invalid(
                "no code file is long enough to end the session".into(),
            ));
        }
        let j = i % docs.len();
        let d = &docs[j];
        i += 1;
        tried += 1;
        if used[j] {
            continue;
        }
        // Corpus paths are already relative to the checkout (`django/db/models/base.py`).
        let path = d.path.clone();
        let c = tok.encode_raw(&call(&path))?;
        let t = tok.encode_raw(&format!("{}\n\n", d.text))?;
        let len = c.len() + t.len();
        // A whole file must leave room for the last one: its call and ≥ 64 tokens before the
        // cut (otherwise small files can fill the budget until no file can end the session).
        if total + len + c.len() + 64 <= budget {
            total += len;
            used[j] = true;
            files.push((path, c, t));
            continue;
        }
        // The last file: the cut must leave ≥ 64 tokens of it before and `steps` after.
        let room = budget.saturating_sub(total + c.len());
        if room >= 64 && t.len() >= room + steps {
            files.push((path, c, t));
            return Ok(files);
        }
    }
}

/// Builds session `index` at `context` tokens with `steps` forced tokens (module docs).
pub fn session(
    docs: &[Document],
    tok: &Tokenizer,
    context: usize,
    steps: usize,
    seed: u64,
    index: usize,
) -> Result<Session, EvalError> {
    if docs.is_empty() {
        return Err(EvalError::Invalid("no code documents".into()));
    }
    let s = seed ^ (index as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rng = StdRng::seed_from_u64(s);
    let budget = context
        .checked_sub(steps)
        .filter(|b| *b > 512)
        .ok_or_else(|| {
            EvalError::Invalid(format!("context {context} too short for {steps} steps"))
        })?;
    let start = rng.gen_range(0..docs.len());
    // Pick files against an estimate of the header (system prompt + the user's request, which
    // names every file); when the measured header is longer, pick again against it.
    let mut header_est = 200;
    let (files, mut ids) = loop {
        let files = pick_files(docs, tok, start, budget, steps, header_est)?;
        let names: Vec<String> = files.iter().map(|f| f.0.clone()).collect();
        let request = match names.as_slice() {
            [one] => one.clone(),
            [init @ .., last] => format!("{} and then {last}", init.join(", ")),
            [] => String::new(),
        };
        let user = format!(
            "User: I am reviewing some modules of this codebase. Please read {request}, in that order, and keep their code in mind.\n\n"
        );
        let mut ids = Vec::with_capacity(context);
        if tok.add_bos() {
            ids.extend(tok.bos());
        }
        ids.extend(tok.encode_raw(SYSTEM)?);
        ids.extend(tok.encode_raw(&user)?);
        if ids.len() > header_est {
            if header_est >= budget / 2 {
                return Err(EvalError::Invalid(format!(
                    "the session header alone takes {} of {budget} tokens",
                    ids.len()
                )));
            }
            header_est = ids.len();
            continue;
        }
        let (last, full) = files.split_last().expect("at least one file");
        for (_, c, t) in full {
            ids.extend(c);
            ids.extend(t);
        }
        ids.extend(&last.1);
        if ids.len() + 64 > budget {
            return Err(EvalError::Invalid(
                "the files before the last one overflow the budget (header longer than estimated)"
                    .into(),
            ));
        }
        break (files, ids);
    };
    let names: Vec<String> = files.iter().map(|f| f.0.clone()).collect();
    let last = files.last().expect("at least one file");
    // Cut the last file at a line boundary at or before `budget`.
    let mut cut = (budget - ids.len()).min(last.2.len() - steps);
    while cut > 1 && !tok.decode(&last.2[cut - 1..cut])?.contains('\n') {
        cut -= 1;
    }
    ids.extend(&last.2[..cut]);
    let continuation = last.2[cut..cut + steps].to_vec();
    Ok(Session {
        index,
        seed: s,
        files: names,
        prompt_tokens: ids.len(),
        prompt_ids: ids,
        continuation_text: tok.decode(&continuation)?,
        continuation,
    })
}

/// Agreement of two prediction sequences: the fraction of equal positions.
pub fn agreement(a: &[u32], b: &[u32]) -> f64 {
    let n = a.len().min(b.len());
    if n == 0 {
        return 0.0;
    }
    a.iter().zip(b).filter(|(x, y)| x == y).count() as f64 / n as f64
}
