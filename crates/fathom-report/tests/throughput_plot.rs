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
