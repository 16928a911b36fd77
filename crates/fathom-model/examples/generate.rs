//! `cargo run --release -p fathom-model --example generate -- smollm2-135m "The capital of France is" 8`
use std::time::Instant;

use fathom_model::fetch::{fetch_model, FetchOptions, ModelId};
use fathom_model::{generate_greedy, Dense, LoadOptions, Model};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let id: ModelId = args
        .get(1)
        .map(|s| s.as_str())
        .unwrap_or("smollm2-135m")
        .parse()?;
    let prompt = args
        .get(2)
        .cloned()
        .unwrap_or_else(|| "The capital of France is".into());
    let n: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let t0 = Instant::now();
    let path = fetch_model(id, &FetchOptions::default())?;
    let model = Model::load(&path, &LoadOptions::default())?;
    eprintln!(
        "loaded {} in {:.2?}: {:?}",
        path.display(),
        t0.elapsed(),
        model.config()
    );
    let ids = model.tokenizer().encode(&prompt)?;
    eprintln!("prompt ids {ids:?}");
    let t1 = Instant::now();
    let out = generate_greedy(&model, &ids, n, 512, &mut Dense)?;
    eprintln!("generated {out:?} in {:.2?}", t1.elapsed());
    println!("{}{}", prompt, model.tokenizer().decode(&out)?);
    Ok(())
}
