//! What `cargo xtask repro` runs: the settings (model, context, k), their method lists and
//! downstream commands for `--quick` and `--full`, and the stages they expand to.

use super::*;

/// One (model, context) setting of the pipeline.
#[derive(Clone, Copy)]
pub(crate) struct Setting {
    pub(crate) model: &'static str,
    pub(crate) context: usize,
    pub(crate) positions: usize,
    pub(crate) k: usize,
    /// Evaluate the plan calibrated here at this other context too (cross-context ablation).
    pub(crate) cross: Option<usize>,
}

/// Head dimension of each model the pipeline runs.
pub(crate) fn head_dim(model: &str) -> usize {
    match model {
        "gemma3-270m" => 256,
        _ => 64,
    }
}

/// The main method list at head dimension `d`: [`MAIN_METHODS`] plus the baselines at the
/// fixed-fraction convention r = D/4 (docs/SPEC.md §4) where it differs from r = 32, with the
/// Fathom sweep extended to their bits.
pub(crate) fn main_methods(d: usize) -> String {
    let r = d / 4;
    if r == 32 {
        return MAIN_METHODS.to_string();
    }
    let top = (136.0f64).max(4.25 * r as f64);
    let top = (top / 8.0).floor() as usize * 8;
    let mut list: Vec<String> = MAIN_METHODS
        .split(',')
        .map(|m| {
            if m == "fathom-sweep:24-136/8" {
                format!("fathom-sweep:24-{top}/8")
            } else {
                m.to_string()
            }
        })
        .collect();
    for m in [format!("sparq:{r}"), format!("ds:{r}"), format!("loki:{r}")] {
        if !list.contains(&m) {
            list.push(m);
        }
    }
    list.join(",")
}

pub(crate) const MAIN_METHODS: &str = "dense,exact,fathom-sweep:24-136/8,fathom-layer:48,fathom-layer:64,fathom-uniform:48,fathom-uniform:64,sparq:16,sparq:32,sparq-union:16,sparq-union:32,ds:32,loki:32,thumb2,landmark,quest";
pub(crate) const ABLATION_METHODS: &str = "exact,fathom-raw:32,fathom-raw:48,fathom-raw:64,fathom-raw:92,fathom-raw:136,fathom-klt:32,fathom-klt:48,fathom-klt:64,fathom-klt:92,fathom-klt:136,fathom-blockmax:48,fathom-blockmax:64,loki:32,loki-f16:32,loki-f16:8";
pub(crate) const CROSS_METHODS: &str =
    "exact,fathom:48,fathom:64,fathom-layer:48,fathom-layer:64,ds:32";
pub(crate) const K_METHODS: &str = "exact,fathom:48,fathom:64,fathom:92,sparq:32,ds:32,loki:32";

/// Rough seconds of a downstream stage at `context` tokens on 2 cores (measured: ~6 s per
/// RULER sample and method at 4k; ~4.5 s per agent session and method for 64 teacher-forced
/// steps at 4k).
pub(crate) fn downstream_estimate(cmd: &str, context: usize) -> f64 {
    let flag = |name: &str| -> f64 {
        let parts: Vec<&str> = cmd.split(' ').collect();
        parts
            .windows(2)
            .find(|w| w[0] == name)
            .map_or(1.0, |w| w[1].split(',').count() as f64)
    };
    let count = |name: &str| -> f64 {
        let parts: Vec<&str> = cmd.split(' ').collect();
        parts
            .windows(2)
            .find(|w| w[0] == name)
            .and_then(|w| w[1].parse().ok())
            .unwrap_or(1.0)
    };
    let per = context as f64 / 700.0;
    if cmd.starts_with("ruler") {
        count("--samples") * flag("--tasks") * flag("--methods") * per
    } else {
        count("--sessions") * flag("--methods") * per * count("--steps") / 80.0
    }
}

/// The experiment matrix of one repro mode, as data: the (model, context) settings, the k
/// values of the k-varied study, the downstream commands and the speed table's contexts.
/// Each fidelity stage records its study (`--study`), which is how the report tables it.
pub(crate) struct Matrix {
    pub(crate) settings: Vec<Setting>,
    pub(crate) ks: Vec<usize>,
    pub(crate) downstream: Vec<String>,
    pub(crate) speed: Vec<(&'static str, &'static str)>,
}

/// The full run's RULER wording and task shape: the one `scripts/device/downstream.sh tune`
/// kept on the GPU for both models (dense-only probes on a held-out seed,
/// `results/downstream/gpu/tune/`), i.e. the committed 20-sample GPU runs' setting.
pub(crate) const RULER_FULL: &str = "ruler --prompt chat --shape small,needle=passkey --tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,fwe --samples 20 --methods dense,exact,fathom:48,fathom:64,fathom:92,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest";
pub(crate) const RULER_QUICK: &str =
    "ruler --tasks niah_single,niah_multikey,vt --samples 1 --methods dense,exact,fathom:48,fathom:92,sparq:32,ds:32";
pub(crate) const AGENT_FULL: &str = "agent-steps --sessions 4 --steps 64 --methods dense,exact,fathom:48,fathom:64,fathom:92,sparq:16,sparq:32,ds:32,loki:32,thumb2,landmark,quest";
pub(crate) const AGENT_QUICK: &str =
    "agent-steps --sessions 1 --steps 16 --methods dense,exact,fathom:48,fathom:92,sparq:32,ds:32";
/// A downstream command for `--device cuda`: the same methods (the paged cache runs every one
/// of the full lists: Loki through its PCA index, landmark and Quest through its block
/// tables), on the GPU.
pub(crate) fn on_gpu(cmd: &str) -> String {
    format!("{cmd} --device cuda")
}

/// Whether this machine shows an NVIDIA GPU (`nvidia-smi -L` lists one), with the reason when not.
pub(crate) fn gpu_present() -> std::result::Result<(), String> {
    match Command::new("nvidia-smi").arg("-L").output() {
        Ok(o) if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("GPU") => Ok(()),
        Ok(o) => Err(format!(
            "nvidia-smi -L lists no GPU ({})",
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Err(format!("nvidia-smi not found ({e})")),
    }
}

pub(crate) const fn setting(
    model: &'static str,
    context: usize,
    k: usize,
    cross: Option<usize>,
) -> Setting {
    Setting {
        model,
        context,
        positions: 128,
        k,
        cross,
    }
}

pub(crate) const FULL_SETTINGS: [Setting; 5] = [
    setting("smollm2-135m", 4096, 128, Some(8192)),
    setting("smollm2-135m", 8192, 256, None),
    setting("gemma3-270m", 8192, 256, None),
    setting("gemma3-270m", 16384, 256, None),
    setting("gemma3-270m", 32768, 512, None),
];
pub(crate) const QUICK_SETTING: Setting = Setting {
    model: "smollm2-135m",
    context: 2048,
    positions: 16,
    k: 128,
    cross: Some(4096),
};

/// The matrix of `--full` or `--quick`; the downstream commands only where the CLI has them
/// (`help` is `fathom --help`).
pub(crate) fn matrix(full: bool, help: &str) -> Matrix {
    let mut downstream = Vec::new();
    if help.contains("ruler") {
        downstream.push(if full { RULER_FULL } else { RULER_QUICK }.to_string());
    }
    if help.contains("agent-steps") {
        downstream.push(if full { AGENT_FULL } else { AGENT_QUICK }.to_string());
    }
    if full {
        Matrix {
            settings: FULL_SETTINGS.to_vec(),
            ks: vec![64, 128, 256, 512, 1024],
            downstream,
            speed: vec![
                ("smollm2-135m", "2048,8176"),
                ("gemma3-270m", "2048,8192,32752"),
            ],
        }
    } else {
        Matrix {
            settings: vec![QUICK_SETTING],
            ks: vec![64, 256],
            downstream,
            speed: vec![("smollm2-135m", "2048")],
        }
    }
}

/// The stages of one setting: its captures, calibration, fidelity studies (main, ablation,
/// k, cross-context), and, in `later`, its downstream runs.
pub(crate) fn setting_stages(
    s: &Setting,
    ks: &[usize],
    out: &str,
    cache: &str,
    downstream: &[String],
    st: &mut Vec<Stage>,
    later: &mut Vec<Stage>,
) {
    let (model, context, k) = (s.model, s.context, s.k);
    let tag = format!("{model}-{}k", context / 1024);
    let dir = format!("{out}/{tag}");
    let cap =
        |split: &str, ctx: usize| format!("{cache}/{model}-{split}-{}k.safetensors", ctx / 1024);
    let est = context as f64 / 150.0;
    let capture = |split: &str, ctx: usize| {
        format!(
            "capture --model {model} --corpus prose --split {split} --context {ctx} --positions {} --dtype f16 --out {}",
            s.positions,
            cap(split, ctx)
        )
    };
    for split in ["calib", "eval"] {
        st.push(stage_cmd(
            &format!("{tag}: capture {split}"),
            est,
            &capture(split, context),
        ));
    }
    let calib = format!("{dir}/calibration.json");
    st.push(stage_cmd(
        &format!("{tag}: calibrate"),
        est / 2.0,
        &format!(
            "calibrate --capture {} --out {calib} --targets 48,64 --k {k}",
            cap("calib", context)
        ),
    ));
    let eval = cap("eval", context);
    let fidelity = |methods: &str, k: usize, json: &str, study: &str| {
        format!("fidelity --capture {eval} --calib {calib} --methods {methods} --k {k} --json {dir}/{json} --study {study}")
    };
    let main = main_methods(head_dim(model));
    st.push(stage_cmd(
        &format!("{tag}: fidelity"),
        est,
        &format!(
            "{} --plot {dir}/fidelity.png",
            fidelity(&main, k, "fidelity.json", "main")
        ),
    ));
    st.push(stage_cmd(
        &format!("{tag}: ablations (basis, proxy, Loki fp16)"),
        est,
        &format!(
            "{} --plot {dir}/ablations.png",
            fidelity(ABLATION_METHODS, k, "ablations.json", "ablation")
        ),
    ));
    for &kk in ks {
        st.push(stage_cmd(
            &format!("{tag}: k = {kk}"),
            est / 3.0,
            &fidelity(K_METHODS, kk, &format!("k{kk}.json"), "k"),
        ));
    }
    if let Some(c2) = s.cross {
        st.push(stage_cmd(
            &format!("{tag}: capture eval at {}k (cross-context)", c2 / 1024),
            c2 as f64 / 150.0,
            &capture("eval", c2),
        ));
        st.push(stage_cmd(
            &format!("{tag}: plan calibrated at {}k, evaluated at {}k", context / 1024, c2 / 1024),
            c2 as f64 / 150.0,
            &format!(
                "fidelity --capture {} --calib {calib} --methods {CROSS_METHODS} --k {k} --json {dir}/cross-context-{}k.json --study ablation",
                cap("eval", c2),
                c2 / 1024
            ),
        ));
    }
    for d in downstream {
        let name = d.split(' ').next().unwrap_or("");
        later.push(stage_cmd(
            &format!("{tag}: {name}"),
            downstream_estimate(d, context),
            &format!("{d} --model {model} --context {context} --json {dir}/{name}.json"),
        ));
    }
}

/// The speed table's stages.
pub(crate) fn speed_stages(speed: &[(&str, &str)], out: &str, st: &mut Vec<Stage>) {
    for (model, ctxs) in speed {
        let n: f64 = ctxs.split(',').filter_map(|c| c.parse::<f64>().ok()).sum();
        st.push(stage(
            &format!("{model}: speed beside llama.cpp at {ctxs} tokens"),
            n / 100.0,
            &[
                "speed",
                "--model",
                model,
                "--context",
                ctxs,
                "--decode-steps",
                "16",
                "--json",
                &format!("{out}/speed-{model}.json"),
            ],
        ));
    }
}

/// Every stage of a run, in order: fetches, each distinct capture once, the fidelity work and
/// speed table, then the downstream runs (so that a time budget cuts the most expensive
/// part first).
pub(crate) fn pipeline(m: &Matrix, out: &str, cache: &str) -> Vec<Stage> {
    let mut st = vec![
        stage("fetch models", 5.0, &["fetch-models"]),
        stage("fetch corpus", 10.0, &["fetch-corpus"]),
    ];
    let mut later = Vec::new();
    for s in &m.settings {
        setting_stages(s, &m.ks, out, cache, &m.downstream, &mut st, &mut later);
    }
    speed_stages(&m.speed, out, &mut st);
    st.extend(later);
    // Captures first (they depend only on the fetches), each distinct command once: a budgeted
    // run spends its first minutes on the model forward passes, and a later run reuses them.
    let (mut caps, rest): (Vec<Stage>, Vec<Stage>) =
        st.into_iter().partition(|s| s.args[0] == "capture");
    let mut seen = std::collections::HashSet::new();
    caps.retain(|s| seen.insert(s.args.clone()));
    let (fetch, rest): (Vec<Stage>, Vec<Stage>) = rest
        .into_iter()
        .partition(|s| s.args[0].starts_with("fetch-"));
    fetch.into_iter().chain(caps).chain(rest).collect()
}
