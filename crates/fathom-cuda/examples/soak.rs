//! A seeded soak of the paged cache on the GPU: random sequences of session operations
//! (create, fork, truncate inside blocks, at block edges and across pages, free, ragged
//! reserves of prefill chunks and decode tokens, appends of every layer from host slices,
//! attends of every method of the grammar, and refusals: an over-full session, an attend over
//! unwritten rows, bad shapes), each checked against a CPU twin: every store bit for bit
//! against `fathom_store::KeyStore` of the kept keys (and the PCA index in its basis), every
//! K|V record, and every attend output against the per-head CPU protocol of docs/SPEC.md §5
//! (`fathom-plan`'s references). Epochs of [`EPOCH_SECONDS`] each draw a new cache shape and
//! cycle through the residencies asked for. Without a GPU it prints why and exits 0.
//!
//! ```text
//! cargo run --release --features cuda -p fathom-cuda --example soak -- \
//!     --seed 1 --seconds 600 --residency all --json soak.json
//! ```
//!
//! Exits 1 on any mismatch or fault, 2 on bad arguments. Keys, values and queries are a
//! labelled synthetic workload (seeded uniform numbers), not model activations.

// A crate root's modules sit beside it: these live in `examples/soak/`.
#[path = "soak/ops.rs"]
mod ops;
#[path = "soak/step.rs"]
mod step;
#[path = "soak/subject.rs"]
mod subject;
#[path = "soak/twin.rs"]
mod twin;

#[cfg(test)]
#[path = "soak/cpu.rs"]
mod cpu;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use fathom_cuda::api::{Device, KvCache};
use fathom_cuda::{CudaError, Gpu, PagedCache, Residency};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use ops::{draw_config, Soak, Tally};

/// Seconds of one epoch (one drawn cache); the last one ends at the deadline.
const EPOCH_SECONDS: u64 = 60;

const USAGE: &str =
    "usage: soak --seed S --seconds N [--residency host|index-hbm|hbm|all] [--json PATH]";

struct Args {
    seed: u64,
    seconds: u64,
    residencies: Vec<Residency>,
    json: Option<std::path::PathBuf>,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    let (mut seed, mut seconds, mut json) = (None, None, None);
    let mut residencies = vec![Residency::Host, Residency::IndexHbm, Residency::Hbm];
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--seed" => {
                seed = Some(
                    value()?
                        .parse::<u64>()
                        .map_err(|e| format!("--seed: {e}"))?,
                )
            }
            "--seconds" => {
                seconds = Some(
                    value()?
                        .parse::<u64>()
                        .map_err(|e| format!("--seconds: {e}"))?,
                )
            }
            "--residency" => {
                residencies = match value()?.as_str() {
                    "host" => vec![Residency::Host],
                    "index-hbm" => vec![Residency::IndexHbm],
                    "hbm" => vec![Residency::Hbm],
                    "all" => residencies,
                    other => return Err(format!("--residency {other}")),
                }
            }
            "--json" => json = Some(value()?.into()),
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Args {
        seed: seed.ok_or("--seed is required")?,
        seconds: seconds.ok_or("--seconds is required")?,
        residencies,
        json,
    })
}

fn residency_name(r: Residency) -> &'static str {
    match r {
        Residency::Host => "host",
        Residency::IndexHbm => "index-hbm",
        Residency::Hbm => "hbm",
    }
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("soak: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let gpu = match <Gpu as Device>::open(0) {
        Ok(g) => g,
        Err(e @ (CudaError::NotCompiledWithCuda | CudaError::NoDevice { .. })) => {
            eprintln!("no GPU path ({e}): nothing to soak");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("soak: opening the GPU: {e}");
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    let device = Device::info(&gpu).name.clone();
    let mut wrote = true;
    // The report after every epoch (`finished: false`), so that a run killed at a time limit
    // leaves the epochs it completed; then the final one.
    let mut write = |tally: &Tally, epochs: &[serde_json::Value], finished: bool| {
        let r = report(&args, &device, start, (tally, epochs), finished);
        let text = serde_json::to_string_pretty(&r).expect("a JSON value");
        if finished {
            println!("{text}");
        }
        if let Some(path) = &args.json {
            if let Err(e) = std::fs::write(path, text + "\n") {
                eprintln!("soak: writing {}: {e}", path.display());
                wrote = false;
            }
        }
    };
    let tally = soak(&gpu, &args, &mut write);
    if !wrote {
        return ExitCode::FAILURE;
    }
    if tally.mismatches.is_empty() && tally.faults == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The report: the arguments, the device, what was counted and found.
fn report(
    args: &Args,
    device: &str,
    start: Instant,
    (tally, epochs): (&Tally, &[serde_json::Value]),
    finished: bool,
) -> serde_json::Value {
    serde_json::json!({
        "seed": args.seed,
        "seconds": args.seconds,
        "elapsed_s": start.elapsed().as_secs_f64(),
        "finished": finished,
        "device": device,
        "residencies": args.residencies.iter().map(|&r| residency_name(r)).collect::<Vec<_>>(),
        "epochs": epochs,
        "counts": tally.counts,
        "heads_checked": tally.heads_checked,
        "stores_checked": tally.stores_checked,
        "mismatches": tally.mismatches.len(),
        "mismatch_details": tally.mismatches.iter().take(20).collect::<Vec<_>>(),
        "faults": tally.faults,
    })
}

/// Epochs until the deadline, each a new cache of a drawn shape in the next residency, with
/// `write(tally, epochs, finished)` after each and at the end; an epoch that finds a mismatch
/// or a fault ends there (the next starts afresh).
fn soak(
    gpu: &Gpu,
    args: &Args,
    write: &mut impl FnMut(&Tally, &[serde_json::Value], bool),
) -> Tally {
    let deadline = Instant::now() + Duration::from_secs(args.seconds);
    let mut rng = StdRng::seed_from_u64(args.seed);
    let mut tally = Tally::default();
    let mut epochs = Vec::new();
    while Instant::now() < deadline {
        let e = epochs.len();
        let residency = args.residencies[e % args.residencies.len()];
        let (cfg, methods) = draw_config(&mut rng, residency, ops::MAX_ROW_ELEMS);
        let epoch_rng = StdRng::seed_from_u64(rng.gen());
        let end = deadline.min(Instant::now() + Duration::from_secs(EPOCH_SECONDS));
        let failed_before = tally.mismatches.len() as u64 + tally.faults;
        let cache = match <PagedCache as KvCache>::new(gpu, cfg) {
            Ok(c) => c,
            Err(err) => {
                tally
                    .mismatches
                    .push(format!("epoch {e}: making the cache: {err}"));
                break;
            }
        };
        let ops = match Soak::new(cache, epoch_rng, &methods, &mut tally) {
            Ok(mut s) => s.run(|_| Instant::now() < end),
            Err(err) => {
                tally.mismatches.push(format!("epoch {e}: {err}"));
                0
            }
        };
        let s = cfg.shape;
        let epoch = serde_json::json!({
            "residency": residency_name(residency),
            "shape": [s.layers, s.kv_heads, s.group, s.dim],
            "page_tokens": cfg.pages.page_tokens,
            "max_tokens": cfg.pages.max_tokens,
            "row_cache": cfg.row_cache,
            "ops": ops,
            "failed": tally.mismatches.len() as u64 + tally.faults > failed_before,
        });
        eprintln!("soak: epoch {e}: {epoch}");
        epochs.push(epoch);
        write(&tally, &epochs, false);
    }
    write(&tally, &epochs, true);
    tally
}
