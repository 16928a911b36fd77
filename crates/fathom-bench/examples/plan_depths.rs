//! How the planner spends a budget on the labelled synthetic generator (`synthetic-gqa-v1`,
//! the offload benchmarks' keys): mean active channels per plan and the mean number of
//! channels at each depth, over 4 layers × 8 decode steps × 8 KV heads at the Qwen3-8B
//! attention shape. In HBM residency the scan's work follows the active channels, not the
//! bits (`results/device/engine/hbm-1m/README.md`), so this is what a method's scan costs
//! there. CPU only.
//!
//! ```text
//! cargo run --release -p fathom-bench --example plan_depths [BUDGET_BITS]   # default 48
//! ```
use fathom_bench::offload::{synth_layer, SynthParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let budget: f32 = std::env::args().nth(1).map_or(Ok(48.0), |s| s.parse())?;
    let (heads, group, dim) = (8, 4, 128);
    let p = SynthParams {
        heads,
        group,
        dim,
        tokens: 4096,
        seed: 1,
    };
    let mut at_depth = [0usize; 5];
    let mut plans = 0usize;
    for layer in 0..4 {
        let src = synth_layer(&p, layer)?;
        for step in 0..8 {
            let q = src.queries(step);
            for h in 0..heads {
                // docs/SPEC.md §3: w_c = σ_c² Σ_g q_gc².
                let w: Vec<f32> = (0..dim)
                    .map(|c| {
                        let q2: f32 = (0..group)
                            .map(|g| q[(h * group + g) * dim + c].powi(2))
                            .sum();
                        src.sigma2[h * dim + c] * q2
                    })
                    .collect();
                let plan = fathom_plan::water_fill(&w, budget)?;
                for &t in &plan.depths {
                    at_depth[usize::from(t)] += 1;
                }
                plans += 1;
            }
        }
    }
    let per = |x: usize| x as f64 / plans as f64;
    println!(
        "fathom:{budget} on {}: {plans} plans, {:.1} active channels per plan; channels at depth 1..4: {:.1}, {:.1}, {:.1}, {:.1}",
        fathom_bench::offload::SYNTH_LABEL,
        per(at_depth[1..].iter().sum()),
        per(at_depth[1]),
        per(at_depth[2]),
        per(at_depth[3]),
        per(at_depth[4]),
    );
    Ok(())
}
