//! Model configurations for throughput runs with random weights (labelled in every output):
//! the Qwen3-8B and Llama-3.1-8B shapes, the vLLM `--load-format dummy` convention. Pure CPU.

use fathom_model::{Arch, Config, LayerKind, RopeStyle};

/// The label every output carries for a preset's weights.
pub const RANDOM_WEIGHTS: &str =
    "random bf16 (uniform, variance 1/n_in; created on the device; vLLM's --load-format dummy convention)";

fn llama_family(
    name: &str,
    layers: usize,
    ff: usize,
    vocab: usize,
    rope_base: f32,
    qk_norm: bool,
    rms_eps: f32,
) -> Config {
    Config {
        arch: Arch::Llama,
        name: name.into(),
        n_layers: layers,
        n_embd: 4096,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        n_ff: ff,
        vocab_size: vocab,
        rms_eps,
        rope_base,
        rope_base_local: rope_base,
        rope_style: RopeStyle::Neox,
        layer_kinds: vec![LayerKind::Global; layers],
        context_length: 1 << 20,
        qk_norm,
        embed_scale: 1.0,
        attn_softcap: None,
    }
}

/// `qwen3-8b` (36 layers, 32 query / 8 KV heads of 128, FFN 12288, QK-norm, vocabulary
/// 151936) or `llama3.1-8b` (32 layers, FFN 14336, vocabulary 128256); `None` otherwise.
pub fn preset(name: &str) -> Option<Config> {
    match name {
        "qwen3-8b" => Some(llama_family(
            "Qwen3-8B (shape)",
            36,
            12288,
            151_936,
            1e6,
            true,
            1e-6,
        )),
        "llama3.1-8b" => Some(llama_family(
            "Llama-3.1-8B (shape)",
            32,
            14336,
            128_256,
            5e5,
            false,
            1e-5,
        )),
        _ => None,
    }
}

/// The calibration of [`crate::GpuDecoder::fill_synthetic`]'s keys, for every KV head of a
/// layer: their exact channel variances (channel `c` is uniform on `±(0.1 + c/D)`, so
/// `σ²_c = (0.1 + c/D)² / 3`), Double Sparsity's channels widest first, and the PCA basis of
/// independent channels, the channel axes widest first (column j is channel `D − 1 − j`; it is
/// also the KLT, with the variances in that order). Labelled runs with random weights load it
/// on every layer.
pub fn synthetic_calibration(c: &Config) -> Vec<fathom_plan::scanner::HeadCalib> {
    let d = c.head_dim;
    let sigma2: Vec<f32> = (0..d)
        .map(|ch| (0.1 + ch as f32 / d as f32).powi(2) / 3.0)
        .collect();
    let mut axes = vec![0f32; d * d];
    for j in 0..d {
        axes[(d - 1 - j) * d + j] = 1.0;
    }
    vec![
        fathom_plan::scanner::HeadCalib {
            klt_sigma2: sigma2.iter().rev().copied().collect(),
            sigma2,
            ds_channels: (0..d as u16).rev().collect(),
            klt: axes.clone(),
            loki: axes,
            ..Default::default()
        };
        c.n_kv_heads
    ]
}

/// The preset names.
pub const PRESETS: [&str; 2] = ["qwen3-8b", "llama3.1-8b"];

/// Parameters of a configuration's matmuls and embeddings (tied LM head counted once more when
/// the preset has its own: both presets untie it).
pub fn parameters(c: &Config) -> usize {
    let (e, q, kv, f) = (
        c.n_embd,
        c.n_heads * c.head_dim,
        c.n_kv_heads * c.head_dim,
        c.n_ff,
    );
    let block = e * (q + 2 * kv) + q * e + 3 * e * f;
    c.n_layers * block + 2 * c.vocab_size * e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_models_parameter_counts() {
        // Qwen3-8B: 8.19 B; Llama-3.1-8B: 8.03 B (the model cards' totals).
        let q = parameters(&preset("qwen3-8b").unwrap()) as f64 / 1e9;
        let l = parameters(&preset("llama3.1-8b").unwrap()) as f64 / 1e9;
        assert!((q - 8.19).abs() < 0.05, "{q}");
        assert!((l - 8.03).abs() < 0.05, "{l}");
        for p in PRESETS {
            let c = preset(p).unwrap();
            assert_eq!(c.group(), 4);
            assert!(c.layer_kinds.iter().all(|k| *k == LayerKind::Global));
        }
        assert!(preset("gpt-2").is_none());
    }

    #[test]
    fn the_synthetic_calibration_is_the_fill_distributions_variance() {
        let c = preset("qwen3-8b").unwrap();
        let heads = synthetic_calibration(&c);
        assert_eq!(heads.len(), c.n_kv_heads);
        let s = &heads[0].sigma2;
        assert_eq!(s.len(), c.head_dim);
        // Uniform on ±w has variance w²/3: w = 0.1 at channel 0, 0.1 + 127/128 at the last.
        assert!((s[0] - 0.01 / 3.0).abs() < 1e-7);
        let w = 0.1 + 127.0 / 128.0;
        assert!((s[127] - w * w / 3.0).abs() < 1e-6);
        assert!(s.windows(2).all(|p| p[1] > p[0]));
        assert_eq!(heads[0].ds_channels[0], 127);
        // The PCA basis: coordinate j is channel D − 1 − j (its variance the j-th largest).
        let (u, d) = (&heads[0].loki, c.head_dim);
        assert_eq!(u.len(), d * d);
        for j in 0..d {
            let col: Vec<f32> = (0..d).map(|i| u[i * d + j]).collect();
            assert_eq!(col.iter().sum::<f32>(), 1.0);
            assert_eq!(col[d - 1 - j], 1.0);
            assert_eq!(heads[0].klt_sigma2[j], s[d - 1 - j]);
        }
    }
}
