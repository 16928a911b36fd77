//! The English words that needle keys are made of (RULER: an adjective-noun pair).
//!
//! Source: Debian's `wamerican` list at [`DICT_PATH`] (`apt-get install wamerican`). It has no
//! parts of speech, so adjectives are the lowercase alphabetic entries with a typical adjective
//! suffix (`-ous -ful -ive -able -ible -less -ical -ish -ent -ant -ary`), and nouns the other
//! lowercase alphabetic entries of 4–9 letters without those suffixes or a verb/adverb ending
//! (`-ly -ing -ed -s`). When the list is absent, [`WordList::from_text`] builds the same split
//! from the words of a corpus text instead (documented in the results as `source`).

use std::collections::BTreeSet;
use std::path::Path;

use crate::EvalError;

/// Where Debian installs the `wamerican` list.
pub const DICT_PATH: &str = "/usr/share/dict/words";

const ADJ_SUFFIXES: [&str; 11] = [
    "ous", "ful", "ive", "able", "ible", "less", "ical", "ish", "ent", "ant", "ary",
];

/// Adjectives and nouns, sorted and deduplicated.
#[derive(Debug, Clone)]
pub struct WordList {
    /// Adjective candidates.
    pub adjectives: Vec<String>,
    /// Noun candidates.
    pub nouns: Vec<String>,
    /// Where the words came from.
    pub source: String,
}

impl WordList {
    /// Reads [`DICT_PATH`].
    pub fn system() -> Result<Self, EvalError> {
        Self::from_file(Path::new(DICT_PATH))
    }

    /// Reads a one-word-a-line list.
    pub fn from_file(path: &Path) -> Result<Self, EvalError> {
        let text = std::fs::read_to_string(path).map_err(|source| EvalError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::build(text.lines(), format!("{} (wamerican)", path.display()))
    }

    /// Words of a running text (the fallback when no word list is installed).
    pub fn from_text(text: &str, source: &str) -> Result<Self, EvalError> {
        Self::build(
            text.split(|c: char| !c.is_ascii_alphabetic()),
            source.into(),
        )
    }

    fn build<'a>(words: impl Iterator<Item = &'a str>, source: String) -> Result<Self, EvalError> {
        let mut adj = BTreeSet::new();
        let mut noun = BTreeSet::new();
        for w in words {
            let w = w.trim();
            if !(4..=10).contains(&w.len()) || !w.bytes().all(|b| b.is_ascii_lowercase()) {
                continue;
            }
            if ADJ_SUFFIXES.iter().any(|s| w.ends_with(s)) {
                adj.insert(w.to_string());
            } else if w.len() <= 9 && !["ly", "ing", "ed", "s"].iter().any(|s| w.ends_with(s)) {
                noun.insert(w.to_string());
            }
        }
        if adj.len() < 50 || noun.len() < 50 {
            return Err(EvalError::Invalid(format!(
                "{source}: too few words ({} adjectives, {} nouns)",
                adj.len(),
                noun.len()
            )));
        }
        Ok(WordList {
            adjectives: adj.into_iter().collect(),
            nouns: noun.into_iter().collect(),
            source,
        })
    }
}
