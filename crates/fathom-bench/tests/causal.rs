//! Causal stores in fidelity (docs/SPEC.md §5): at a position inside a block, every method's
//! scores come from an index over keys up to that position only. A key after the position in
//! the same block (here a huge outlier, which would set that block's fp16 scales) must change
//! nothing: the run equals one on the capture cut right after the position. SYNTHETIC keys.

use fathom_baselines::{DoubleSparsity, Exact, Landmark, Loki, Quest, SparQ, Thumbnail};
use fathom_bench::calib::Calibration;
use fathom_bench::fidelity::{run, FidelityParams, InMemory};
use fathom_bench::synthetic::{generate, SyntheticParams};
use fathom_plan::scanner::{DepthRule, Fathom, Scanner, StoreBasis};

const D: usize = 32;
const HKV: usize = 2;

fn calibration(src: &InMemory) -> Calibration {
    Calibration::statistics_only(src, "synthetic, cut after the position").unwrap()
}

fn methods() -> Vec<Box<dyn Scanner>> {
    let mut klt = Fathom::new(48.0);
    klt.basis = StoreBasis::Klt;
    klt.label = "fathom-klt:48".into();
    let mut uni = Fathom::new(48.0);
    uni.rule = DepthRule::Uniform;
    uni.label = "fathom-uniform:48".into();
    vec![
        Box::new(Exact),
        Box::new(Fathom::new(24.0)),
        Box::new(klt),
        Box::new(uni),
        Box::new(SparQ { r: 8 }),
        Box::new(DoubleSparsity { r: 8 }),
        Box::new(Loki { r: 8 }),
        Box::new(Thumbnail),
        Box::new(Landmark),
        Box::new(Quest),
    ]
}

#[test]
fn a_later_key_in_the_same_block_changes_no_score() {
    // Positions at least 32 past their block's start: the local window (32) does not cover the
    // whole block, so its earlier keys compete on their scores.
    for (pos, outlier) in [(180usize, 185usize), (250, 253), (120, 127)] {
        let (mut info, mut layers) = generate(&SyntheticParams {
            layers: 1,
            hkv: HKV,
            g: 4,
            d: D,
            n: 256,
            p: 1,
            seed: pos as u64,
            ..Default::default()
        });
        // The query of the last position, asked at `pos` instead.
        info.positions = vec![pos];
        let cut_n = pos + 1;
        let cut = InMemory {
            info: fathom_bench::capture::CaptureInfo {
                n: cut_n,
                ..info.clone()
            },
            layers: vec![fathom_bench::capture::LayerData {
                k: layers[0].k[..cut_n * HKV * D].to_vec(),
                v: layers[0].v[..cut_n * HKV * D].to_vec(),
                ..layers[0].clone()
            }],
        };
        // The outlier, after `pos` in the same 64-token block.
        assert_eq!(pos / 64, outlier / 64);
        for x in &mut layers[0].k[outlier * HKV * D..(outlier + 1) * HKV * D] {
            *x *= 1000.0;
        }
        let full = InMemory { info, layers };
        // Calibrate on the cut capture for both, so only the stores can differ.
        let cal = calibration(&cut);
        let mut p = FidelityParams::default();
        p.select.k = 16;
        let ms = methods();
        let a = run(&full, Some(&cal), &ms, &p, &|_| {}).unwrap();
        let b = run(&cut, Some(&cal), &ms, &p, &|_| {}).unwrap();
        for (x, y) in a.methods.iter().zip(&b.methods) {
            assert!(
                (x.error - y.error).abs() <= 1e-12 * y.error.max(1e-30),
                "pos {pos}, {}: {} with a later outlier, {} without",
                x.name,
                x.error,
                y.error
            );
        }
    }
}
