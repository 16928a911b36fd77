//! The English words that needle keys are made of (RULER: an adjective-noun pair).
//!
//! Source: the hand-curated part-of-speech lists of the `wonderwords` 2.2.0 wheel on PyPI
//! ([`fathom_model::pypi::WONDERWORDS`], sha256 pinned): `wonderwords/assets/adjectivelist.txt`
//! and `nounlist.txt`, minus every entry of its `profanitylist.txt`. A published PyPI file never
//! changes, so the keys are the same on every machine and OS, and no system word list is read.
//! Kept: lowercase ASCII alphabetic entries of 4–10 letters, sorted and deduplicated.
//!
//! ```no_run
//! use fathom_eval::words::WordList;
//! use fathom_model::corpus::CorpusOptions;
//! let w = WordList::fetch(&CorpusOptions::default())?;
//! println!("{} adjectives, {} nouns from {}", w.adjectives.len(), w.nouns.len(), w.source);
//! # Ok::<(), fathom_eval::EvalError>(())
//! ```

use std::collections::BTreeSet;

use fathom_model::corpus::CorpusOptions;
use fathom_model::pypi::{fetch_pypi_file, read_wheel_member, WONDERWORDS};

use crate::EvalError;

/// The fewest adjectives and nouns a usable list has.
pub const MIN_WORDS: usize = 50;

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
    /// The pinned lists, fetched into [`CorpusOptions::sources_dir`] with pip when not cached
    /// (never when `offline`).
    pub fn fetch(opts: &CorpusOptions) -> Result<Self, EvalError> {
        let whl = fetch_pypi_file(
            &WONDERWORDS,
            &opts.sources_dir(),
            &opts.python,
            opts.offline,
        )?;
        let member = |name: &str| -> Result<String, EvalError> {
            let bytes = read_wheel_member(&whl, &format!("wonderwords/assets/{name}"))?;
            String::from_utf8(bytes)
                .map_err(|_| EvalError::Invalid(format!("{}: {name} is not UTF-8", whl.display())))
        };
        Self::from_lists(
            &member("adjectivelist.txt")?,
            &member("nounlist.txt")?,
            &member("profanitylist.txt")?,
            format!(
                "{}=={} ({}: adjectivelist.txt, nounlist.txt)",
                WONDERWORDS.package, WONDERWORDS.version, WONDERWORDS.file_name
            ),
        )
    }

    /// One-word-a-line lists of adjectives and nouns; words in `exclude` are dropped.
    pub fn from_lists(
        adjectives: &str,
        nouns: &str,
        exclude: &str,
        source: String,
    ) -> Result<Self, EvalError> {
        let banned: BTreeSet<&str> = exclude.lines().map(str::trim).collect();
        let keep = |list: &str| -> Vec<String> {
            list.lines()
                .map(str::trim)
                .filter(|w| (4..=10).contains(&w.len()))
                .filter(|w| w.bytes().all(|b| b.is_ascii_lowercase()))
                .filter(|w| !banned.contains(w))
                .map(String::from)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect()
        };
        let (adjectives, nouns) = (keep(adjectives), keep(nouns));
        if adjectives.len() < MIN_WORDS || nouns.len() < MIN_WORDS {
            return Err(EvalError::Invalid(format!(
                "{source}: too few words ({} adjectives, {} nouns; at least {MIN_WORDS} of each)",
                adjectives.len(),
                nouns.len()
            )));
        }
        Ok(WordList {
            adjectives,
            nouns,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(prefix: &str, n: u8) -> String {
        (0..n)
            .map(|i| {
                let (a, b) = (char::from(b'a' + i / 26), char::from(b'a' + i % 26));
                format!("{prefix}{a}{b}\n")
            })
            .collect()
    }

    #[test]
    fn lists_are_filtered_and_a_short_list_is_an_error() {
        // 60 adjectives twice over, plus entries the filter drops.
        let adj = format!(
            "{0}{0}Capital\nok\nbad-word\nabcdefghijk\n",
            words("adj", 60)
        );
        let w = WordList::from_lists(&adj, &words("noun", 80), "nounaa\n", "test".into()).unwrap();
        assert_eq!(
            w.adjectives.len(),
            60,
            "deduplicated, ASCII lowercase 4-10 letters only"
        );
        assert_eq!(w.nouns.len(), 79, "the excluded word is gone");
        assert!(!w.nouns.iter().any(|n| n == "nounaa"));
        let e = WordList::from_lists("tiny\n", &words("noun", 80), "", "short".into()).unwrap_err();
        assert!(e.to_string().contains("too few words"), "{e}");
    }
}
