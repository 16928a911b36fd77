//! A **synthetic** GQA workload: keys with heavy-tailed channel variances, queries aimed at
//! a few earlier keys so that attention is peaked. For unit tests and the embedded demo
//! until real captures are used; every number it produces is labelled synthetic.

use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal, StandardNormal};

use crate::capture::{CaptureInfo, LayerData, LayerKind};

/// Shape and seed of the synthetic workload.
#[derive(Debug, Clone)]
pub struct SyntheticParams {
    /// Layers.
    pub layers: usize,
    /// KV heads.
    pub hkv: usize,
    /// Query heads per KV head.
    pub g: usize,
    /// Channels.
    pub d: usize,
    /// Tokens.
    pub n: usize,
    /// Query positions (the last `p` tokens).
    pub p: usize,
    /// Log-std of channel scales (heavier tails with larger values).
    pub channel_sigma: f64,
    /// Seed.
    pub seed: u64,
}

impl Default for SyntheticParams {
    fn default() -> Self {
        Self {
            layers: 4,
            hkv: 2,
            g: 4,
            d: 128,
            n: 4096,
            p: 16,
            channel_sigma: 1.0,
            seed: 0x5eed,
        }
    }
}

/// Generates the workload: capture-shaped info and one [`LayerData`] per layer.
pub fn generate(p: &SyntheticParams) -> (CaptureInfo, Vec<LayerData>) {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let hq = p.hkv * p.g;
    let positions: Vec<usize> = (p.n - p.p..p.n).collect();
    let scale_dist = LogNormal::new(0.0, p.channel_sigma).expect("valid lognormal");
    let mut layers = Vec::with_capacity(p.layers);
    for l in 0..p.layers {
        let mut k = vec![0f32; p.n * p.hkv * p.d];
        let mut v = vec![0f32; p.n * p.hkv * p.d];
        let mut q = vec![0f32; p.p * hq * p.d];
        for h in 0..p.hkv {
            let scale: Vec<f32> = (0..p.d)
                .map(|_| scale_dist.sample(&mut rng) as f32)
                .collect();
            let bias: Vec<f32> = (0..p.d)
                .map(|c| 0.5 * scale[c] * rng.sample::<f32, _>(StandardNormal))
                .collect();
            for i in 0..p.n {
                for c in 0..p.d {
                    let z: f32 = rng.sample(StandardNormal);
                    k[(i * p.hkv + h) * p.d + c] = bias[c] + scale[c] * z;
                    v[(i * p.hkv + h) * p.d + c] = rng.sample(StandardNormal);
                }
            }
            for (pi, &pos) in positions.iter().enumerate() {
                for gi in 0..p.g {
                    // Aim at three earlier keys, with noise; logits spread over ~10 nats.
                    let targets: Vec<usize> = (0..3).map(|_| rng.gen_range(0..=pos)).collect();
                    let qh = h * p.g + gi;
                    for c in 0..p.d {
                        let mut x: f32 = 0.0;
                        for &t in &targets {
                            x += k[(t * p.hkv + h) * p.d + c] - bias[c];
                        }
                        let noise: f32 = rng.sample(StandardNormal);
                        x = x / (scale[c] * scale[c] + 0.3) + 0.7 * noise;
                        q[(pi * hq + qh) * p.d + c] = x;
                    }
                    // Normalise to a fixed logit scale.
                    let row = &mut q[(pi * hq + qh) * p.d..(pi * hq + qh + 1) * p.d];
                    let norm = row.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-6);
                    let target = 2.5 * (p.d as f32).sqrt();
                    row.iter_mut().for_each(|x| *x *= target / norm);
                }
            }
        }
        layers.push(LayerData {
            index: l,
            kind: LayerKind::Global,
            q,
            k,
            v,
            o: None,
        });
    }
    let info = CaptureInfo {
        model: "synthetic-gqa".into(),
        qk_norm: false,
        softcap: None,
        positions,
        layers: (0..p.layers).collect(),
        kinds: vec![LayerKind::Global; p.layers],
        n: p.n,
        hq,
        hkv: p.hkv,
        d: p.d,
    };
    (info, layers)
}
