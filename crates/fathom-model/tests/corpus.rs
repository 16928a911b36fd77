//! Corpus splits: deterministic, disjoint, and (when built) equal to the pinned content; the
//! archive reader and a user's own text on **fake** inputs made here (labelled as such).

use std::io::Write;
use std::path::Path;

use fathom_model::corpus::{
    documents_from_file, fetch_corpus, read_tar_gz, split_of, CorpusKind, CorpusOptions, Split,
    MIN_DOC_BYTES, PROSE,
};
use fathom_model::pypi::skip_missing_data;
use fathom_model::Error;

#[test]
fn split_is_a_pure_function_of_the_path() {
    // Fixed expectations: changing the rule would silently change every calibration.
    let cases = [
        ("docs/howto/custom-template-tags.txt", Split::Eval),
        ("docs/howto/deployment/asgi/hypercorn.txt", Split::Eval),
        ("docs/faq/admin.txt", Split::Calib),
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

/// Corpus sha256 (over `path sha256` lines), documents and eval documents observed when the
/// corpora were first built from Django-5.1.4.tar.gz.
const PINNED: [(CorpusKind, &str, usize, usize); 2] = [
    (
        CorpusKind::Prose,
        "6be45ba1873bbf521e91047d8dfff06579208710886eb3e986c1b2e6d8cf68c7",
        423,
        80,
    ),
    (
        CorpusKind::Code,
        "8cdcdefabda225f8d36bbfe40d1d4104dcddc2c0eb68d51cfadd65cd343bb8f1",
        549,
        110,
    ),
];

#[test]
fn built_corpora_match_their_pins_and_splits_are_disjoint() {
    let opts = CorpusOptions {
        offline: true,
        ..Default::default()
    };
    for (kind, sha, n, n_eval) in PINNED {
        let m = match fetch_corpus(kind, &opts) {
            Ok(m) => m,
            Err(e) => {
                skip_missing_data(&format!(
                    "{} corpus not built ({e}); run `fathom fetch-corpus`",
                    kind.name()
                ));
                continue;
            }
        };
        assert_eq!(m.corpus_sha256, sha, "{}", kind.name());
        assert_eq!(m.documents.len(), n, "{}", kind.name());
        assert_eq!(m.count(Split::Eval).0, n_eval, "{}", kind.name());
        for d in &m.documents {
            assert_eq!(d.split, split_of(&d.path));
            assert!(kind.source().selects(&d.path), "{}", d.path);
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

/// A FAKE sdist: `fake-0.0.1/<path>` entries with the given contents.
fn fake_sdist(path: &Path, files: &[(&str, String)]) {
    let f = std::fs::File::create(path).unwrap();
    let gz = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    for (name, text) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(text.len() as u64);
        h.set_mode(0o644);
        h.set_cksum();
        b.append_data(&mut h, format!("fake-0.0.1/{name}"), text.as_bytes())
            .unwrap();
    }
    b.into_inner().unwrap().finish().unwrap().flush().unwrap();
}

#[test]
fn the_archive_reader_selects_documents_and_rejects_a_truncated_archive() {
    let tmp = tempfile::tempdir().unwrap();
    let long = "Prose written by a person. ".repeat(MIN_DOC_BYTES / 20);
    let files = [
        ("docs/intro.txt", long.clone()),
        ("docs/short.txt", "too short".to_string()),
        ("docs/_theme/LICENSE.txt", long.clone()),
        ("docs/code.py", long.clone()),
        ("README.txt", long.clone()),
    ];
    let p = tmp.path().join("fake.tar.gz");
    fake_sdist(&p, &files);
    let docs = read_tar_gz(&p, |rel| PROSE.selects(rel)).unwrap();
    let paths: Vec<&str> = docs.iter().map(|d| d.path.as_str()).collect();
    assert_eq!(paths, ["docs/intro.txt"]);
    assert_eq!(docs[0].text, long);

    let bytes = std::fs::read(&p).unwrap();
    let cut = tmp.path().join("cut.tar.gz");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let err = read_tar_gz(&cut, |_| true).unwrap_err();
    assert!(
        matches!(&err, Error::Invalid(m) if m.contains("corrupt or truncated")),
        "{err}"
    );
}

#[test]
fn a_users_text_is_plain_or_jsonl_and_bad_lines_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let plain = tmp.path().join("notes.txt");
    std::fs::write(&plain, "One plain document.\nTwo lines.\n").unwrap();
    let d = documents_from_file(&plain).unwrap();
    assert_eq!(d.len(), 1);
    assert!(d[0].text.starts_with("One plain"));

    let jl = tmp.path().join("chats.jsonl");
    std::fs::write(
        &jl,
        "{\"text\": \"first\"}\n\n{\"text\": \"second\", \"id\": 2}\n",
    )
    .unwrap();
    let d = documents_from_file(&jl).unwrap();
    assert_eq!(
        d.iter().map(|d| d.text.as_str()).collect::<Vec<_>>(),
        ["first", "second"]
    );
    assert!(d[1].path.ends_with("chats.jsonl:3"), "{}", d[1].path);

    std::fs::write(&jl, "{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n").unwrap();
    let e = documents_from_file(&jl).unwrap_err().to_string();
    assert!(e.contains("chats.jsonl:2") && e.contains("\"text\""), "{e}");
    std::fs::write(&jl, "not json\n").unwrap();
    let e = documents_from_file(&jl).unwrap_err().to_string();
    assert!(e.contains(":1: not JSON"), "{e}");
    std::fs::write(&plain, "  \n").unwrap();
    let e = documents_from_file(&plain).unwrap_err().to_string();
    assert!(e.contains("no text"), "{e}");
    std::fs::write(&plain, [0xff, 0xfe, b'a']).unwrap();
    let e = documents_from_file(&plain).unwrap_err().to_string();
    assert!(e.contains("not UTF-8"), "{e}");
}

#[test]
fn an_offline_fetch_names_the_file_the_command_and_the_cache_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = CorpusOptions {
        cache_dir: Some(tmp.path().to_path_buf()),
        offline: true,
        ..Default::default()
    };
    let e = fetch_corpus(CorpusKind::Prose, &opts).unwrap_err();
    assert!(matches!(e, Error::Download { .. }), "{e:?}");
    let msg = e.to_string();
    for want in [
        "django==5.1.4",
        "Django-5.1.4.tar.gz",
        "pip download --no-deps",
        "--no-binary :all:",
        "sources",
    ] {
        assert!(msg.contains(want), "{want:?} missing from: {msg}");
    }
    assert!(
        !msg.contains("wheel"),
        "no wheel advice for an sdist: {msg}"
    );
}

#[test]
fn a_tampered_source_file_is_a_checksum_error() {
    let tmp = tempfile::tempdir().unwrap();
    let opts = CorpusOptions {
        cache_dir: Some(tmp.path().to_path_buf()),
        offline: true,
        ..Default::default()
    };
    let dir = opts.sources_dir();
    std::fs::create_dir_all(&dir).unwrap();
    fake_sdist(
        &dir.join("Django-5.1.4.tar.gz"),
        &[("docs/a.txt", "x".repeat(2000))],
    );
    let e = fetch_corpus(CorpusKind::Code, &opts).unwrap_err();
    assert!(matches!(e, Error::Checksum { .. }), "{e:?}");
    assert!(e.to_string().contains("delete"), "{e}");
}
