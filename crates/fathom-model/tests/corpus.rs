//! Corpus splits: deterministic, disjoint, and (when built) equal to the pinned content.

use fathom_model::corpus::{fetch_corpus, split_of, CorpusKind, CorpusOptions, Split};

#[test]
fn split_is_a_pure_function_of_the_path() {
    // Fixed expectations: changing the rule would silently change every calibration.
    let cases = [
        (
            "usr/share/doc/python3.11/html/_sources/about.rst.txt",
            Split::Eval,
        ),
        (
            "usr/share/doc/python3.11/html/_sources/c-api/exceptions.rst.txt",
            Split::Eval,
        ),
    ];
    for (p, want) in cases {
        assert_eq!(split_of(p), want, "{p}");
    }
    let n = 2000;
    let eval = (0..n)
        .filter(|i| split_of(&format!("doc{i}.txt")) == Split::Eval)
        .count();
    assert!((300..500).contains(&eval), "≈20 % eval, got {eval}/{n}");
}

/// corpus sha256 (over `path sha256` lines) observed when the corpora were first built.
const PINNED: [(CorpusKind, &str, &str); 2] = [
    (
        CorpusKind::Prose,
        "3.11.2-6+deb12u8",
        "a837f409ae34564348d145a5c32fb8c644763efb322ada6b9162cb5f2990fabe",
    ),
    (
        CorpusKind::Code,
        "3.11.2-6+deb12u8",
        "2ab9ccab038097b6be6b4fe4ba643e4836693ab8521ac160c854d2eca7a27a69",
    ),
];

#[test]
fn built_corpora_match_their_pins_and_splits_are_disjoint() {
    let opts = CorpusOptions {
        offline: true,
        ..Default::default()
    };
    for (kind, version, sha) in PINNED {
        let m = match fetch_corpus(kind, &opts) {
            Ok(m) => m,
            Err(e) => {
                eprintln!(
                    "SKIP: {} corpus not built ({e}); run `fathom fetch-corpus`",
                    kind.name()
                );
                continue;
            }
        };
        if m.version == version {
            assert_eq!(m.corpus_sha256, sha, "{}", kind.name());
        }
        for d in &m.documents {
            assert_eq!(d.split, split_of(&d.path));
        }
        let calib: std::collections::HashSet<_> = m
            .documents
            .iter()
            .filter(|d| d.split == Split::Calib)
            .map(|d| &d.sha256)
            .collect();
        let overlap = m
            .documents
            .iter()
            .filter(|d| d.split == Split::Eval && calib.contains(&d.sha256))
            .count();
        assert_eq!(
            overlap,
            0,
            "{}: an eval document's text also appears in calib",
            kind.name()
        );
    }
}
