//! The throughput plot: made-up points (not a measurement) render to a PNG written atomically;
//! nothing to plot is an error, not an empty image.

#[test]
fn tokens_against_batch_renders_and_refuses_an_empty_plot() {
    let dir = std::env::temp_dir().join(format!("fathom-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tps.png");
    let pts: Vec<(String, usize, f64)> = [
        ("dense", 1, 40.0),
        ("dense", 4, 120.0),
        ("fathom:48", 1, 90.0),
        ("fathom:48", 4, 330.0),
        ("fathom:48", 16, 1100.0),
    ]
    .iter()
    .map(|&(m, b, t)| (m.to_string(), b, t))
    .collect();
    fathom_report::plot::tokens_vs_batch(&pts, "made-up points", &path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let e = fathom_report::plot::tokens_vs_batch(&[], "none", &dir.join("none.png")).unwrap_err();
    assert!(e.to_string().contains("nothing to plot"), "{e}");
    assert!(!dir.join("none.png").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tokens_against_context_renders_with_k_labels() {
    let dir = std::env::temp_dir().join(format!("fathom-plot-ctx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("ctx.png");
    let pts: Vec<(String, usize, f64)> = [
        ("sparq:32", 65536, 48.0),
        ("sparq:32", 524288, 13.0),
        ("fathom:48", 65536, 60.0),
        ("fathom:48", 262144, 35.0),
        ("fathom:48", 524288, 24.0),
    ]
    .iter()
    .map(|&(m, n, t)| (m.to_string(), n, t))
    .collect();
    fathom_report::plot::tokens_vs_context(&pts, "made-up points", &path).unwrap();
    assert_eq!(&std::fs::read(&path).unwrap()[..8], b"\x89PNG\r\n\x1a\n");
    let _ = std::fs::remove_dir_all(&dir);
}

/// On the committed H200 runs: the one-session entries of the host runs (64k, 256k, 512k)
/// make the one curve against context; the HBM and split runs have B = 4 only.
#[test]
fn the_committed_decode_runs_make_one_context_curve() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../results/device/decode-bench");
    let inp = fathom_report::collect(&dir, None, &dir).unwrap();
    let groups = fathom_report::decode_context_points(&inp);
    assert_eq!(
        groups.len(),
        1,
        "{:?}",
        groups.iter().map(|g| &g.0).collect::<Vec<_>>()
    );
    let ((model, residency, real), pts) = &groups[0];
    assert_eq!(
        (model.as_str(), residency.as_str(), *real),
        ("qwen3-8b", "host", false)
    );
    let mut ctx: Vec<usize> = pts
        .iter()
        .filter(|p| p.0 == "fathom:48")
        .map(|p| p.1)
        .collect();
    ctx.sort_unstable();
    assert_eq!(ctx, [65536, 262144, 524288]);
    // Longer contexts decode slower, for every method.
    for m in ["fathom:48", "sparq:32", "dense"] {
        let mut c: Vec<(usize, f64)> = pts
            .iter()
            .filter(|p| p.0 == m)
            .map(|p| (p.1, p.2))
            .collect();
        c.sort_by_key(|p| p.0);
        assert!(c.windows(2).all(|w| w[1].1 < w[0].1), "{m}: {c:?}");
    }
}
